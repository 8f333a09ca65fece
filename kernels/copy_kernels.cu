#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/copy_kernels.h"
#include "kernels/e4m3_quotient.h"
#include "plan/dtype.h"

namespace refit {
namespace {

// Element bits from any address (staging may sit at any byte offset).
__device__ __forceinline__ uint32_t LoadBits(const unsigned char* p, int size) {
  if ((reinterpret_cast<uint64_t>(p) & (size - 1)) == 0) {
    return size == 2 ? *reinterpret_cast<const uint16_t*>(p)
                     : *reinterpret_cast<const uint32_t*>(p);
  }
  uint32_t u = 0;
  for (int i = 0; i < size; ++i) u |= static_cast<uint32_t>(p[i]) << (8 * i);
  return u;
}

__device__ __forceinline__ void StoreBits(uint32_t u, unsigned char* p, int size) {
  if ((reinterpret_cast<uint64_t>(p) & (size - 1)) == 0) {
    if (size == 2)
      *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(u);
    else
      *reinterpret_cast<uint32_t*>(p) = u;
    return;
  }
  for (int i = 0; i < size; ++i) p[i] = static_cast<unsigned char>(u >> (8 * i));
}

__device__ __forceinline__ float BitsToFloat(uint32_t u, uint8_t dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::kBF16:
      return __uint_as_float(u << 16);
    case DType::kF16:
      return __half2float(__ushort_as_half(static_cast<unsigned short>(u)));
    default:
      return __uint_as_float(u);
  }
}

// Round to nearest even, NaN kept quiet: the same bits as plan/convert.cc.
__device__ __forceinline__ uint32_t FloatToBits(float v, uint8_t dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::kBF16: {
      uint32_t u = __float_as_uint(v);
      if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40;
      u += 0x7FFFu + ((u >> 16) & 1u);
      return u >> 16;
    }
    case DType::kF16:
      return __half_as_ushort(__float2half_rn(v));
    default:
      return __float_as_uint(v);
  }
}

// 8 elements per lane with 16-byte accesses: both ends 16-byte aligned, n a multiple of 8.
__device__ __noinline__ void WarpConvertVector(const unsigned char* s, unsigned char* d, int64_t n,
                                               uint8_t sdt, uint8_t ddt, int ss, int ds, int lane) {
  for (int64_t chunk = lane; chunk < n / 8; chunk += 32) {
    uint32_t in[8], out[8];
    const uint4* s4 = reinterpret_cast<const uint4*>(s + chunk * 8 * ss);
    if (ss == 2) {
      const uint4 w = s4[0];
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      for (int i = 0; i < 4; ++i) in[2 * i] = words[i] & 0xFFFF, in[2 * i + 1] = words[i] >> 16;
    } else {
      const uint4 a = s4[0], b = s4[1];
      in[0] = a.x, in[1] = a.y, in[2] = a.z, in[3] = a.w, in[4] = b.x, in[5] = b.y, in[6] = b.z,
      in[7] = b.w;
    }
    for (int i = 0; i < 8; ++i) out[i] = FloatToBits(BitsToFloat(in[i], sdt), ddt);
    uint4* d4 = reinterpret_cast<uint4*>(d + chunk * 8 * ds);
    if (ds == 2) {
      d4[0] = make_uint4(out[0] | (out[1] << 16), out[2] | (out[3] << 16), out[4] | (out[5] << 16),
                         out[6] | (out[7] << 16));
    } else {
      d4[0] = make_uint4(out[0], out[1], out[2], out[3]);
      d4[1] = make_uint4(out[4], out[5], out[6], out[7]);
    }
  }
}

__device__ __forceinline__ int Size(uint8_t dtype) {
  const DType d = static_cast<DType>(dtype);
  return d == DType::kBF16 || d == DType::kF16  ? 2
         : d == DType::kF32 || d == DType::kI32 ? 4
         : d == DType::kI64                     ? 8
                                                : 1;
}

// Accesses of B bytes: the register type, and its 32-bit words (B < 4: one, zero-extended).
template <int B>
struct Access;
template <>
struct Access<16> {
  using T = uint4;
};
template <>
struct Access<8> {
  using T = uint2;
};
template <>
struct Access<4> {
  using T = uint32_t;
};
template <>
struct Access<2> {
  using T = uint16_t;
};
template <>
struct Access<1> {
  using T = uint8_t;
};

template <int B>
__device__ __forceinline__ void ToWords(const typename Access<B>::T& v, uint32_t* w) {
  if constexpr (B == 16)
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  else if constexpr (B == 8)
    w[0] = v.x, w[1] = v.y;
  else
    w[0] = v;
}

template <int B>
__device__ __forceinline__ typename Access<B>::T FromWords(const uint32_t* w) {
  if constexpr (B == 16)
    return make_uint4(w[0], w[1], w[2], w[3]);
  else if constexpr (B == 8)
    return make_uint2(w[0], w[1]);
  else
    return static_cast<typename Access<B>::T>(w[0]);
}

// Element i (of S bytes, 2 or 4) of words w, and back.
template <int S>
__device__ __forceinline__ uint32_t Element(const uint32_t* w, int i) {
  if constexpr (S == 4)
    return w[i];
  else
    return (w[i / 2] >> (16 * (i & 1))) & 0xFFFFu;
}

template <int S>
__device__ __forceinline__ void SetElement(uint32_t* w, int i, uint32_t bits) {
  if constexpr (S == 4)
    w[i] = bits;
  else if (i & 1)
    w[i / 2] |= bits << 16;
  else
    w[i / 2] = bits;
}

// ---- Spans: one contiguous run (or a segment of one). ----

// Aligned 16-byte copy of n vectors: four loads in flight per lane before their stores. One at
// a time (the compiler cannot move a load above the previous store, which might alias it) kept a
// colocated 16 GB refit at 0.34 of the copy engine.
__device__ __forceinline__ void WarpCopy16Inline(const uint4* s4, uint4* d4, int64_t n, int lane) {
  constexpr int kInFlight = 4;
  int64_t i = lane;
  for (; i + (kInFlight - 1) * 32 < n; i += kInFlight * 32) {
    uint4 r[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) r[k] = s4[i + k * 32];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) d4[i + k * 32] = r[k];
  }
  for (; i < n; i += 32) d4[i] = s4[i];
}

__device__ __noinline__ void WarpCopy16(const uint4* s4, uint4* d4, int64_t n, int lane) {
  WarpCopy16Inline(s4, d4, n, lane);
}

// 16 bytes from the 32 at lo, hi (little-endian), starting at byte 4 * Q + r / 8.
template <int Q>
__device__ __forceinline__ uint4 Shifted(const uint4& lo, const uint4& hi, int r) {
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  return make_uint4(__funnelshift_r(w[Q], w[Q + 1], r), __funnelshift_r(w[Q + 1], w[Q + 2], r),
                    __funnelshift_r(w[Q + 2], w[Q + 3], r), __funnelshift_r(w[Q + 3], w[Q + 4], r));
}

// n 16-byte vectors to aligned d4 from s, which is k = 4 * Q + r / 8 bytes (1..15) past the
// aligned address `base`: each lane reads the two aligned vectors its 16 bytes straddle and
// funnel-shifts them. Both aligned vectors hold bytes of the span (k > 0), so nothing is read
// outside the 16-byte chunks the span touches; the second is the next lane's first, an L1 hit.
// Without this, a run whose ends differ in alignment fell to byte accesses (1- and 2-byte:
// FSDP shards start at any element).
template <int Q>
__device__ __noinline__ void WarpCopyShifted(const uint4* base, uint4* d4, int64_t n, int r,
                                             int lane) {
  constexpr int kInFlight = 4;
  for (int64_t i0 = lane; i0 < n; i0 += kInFlight * 32) {
    uint4 lo[kInFlight], hi[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      if (i0 + k * 32 < n) lo[k] = base[i0 + k * 32], hi[k] = base[i0 + k * 32 + 1];
    }
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      if (i0 + k * 32 < n) d4[i0 + k * 32] = Shifted<Q>(lo[k], hi[k], r);
    }
  }
}

// A warp copies `bytes` bytes from s to d: 16-byte accesses when both ends are aligned (the
// long aligned case, unchanged); else single bytes up to d's next 16-byte boundary and after
// its last one, and the body between in aligned 16-byte stores, from aligned 16-byte loads
// (shifted where s's misalignment differs from d's).
__device__ __forceinline__ void WarpCopyBytes(const unsigned char* s, unsigned char* d,
                                              int64_t bytes, int lane) {
  if (((reinterpret_cast<uint64_t>(s) | reinterpret_cast<uint64_t>(d) |
        static_cast<uint64_t>(bytes)) &
       15) == 0) {
    WarpCopy16(reinterpret_cast<const uint4*>(s), reinterpret_cast<uint4*>(d), bytes / 16, lane);
    return;
  }
  if (bytes < 64) {
    for (int64_t i = lane; i < bytes; i += 32) d[i] = s[i];
    return;
  }
  const int head = static_cast<int>((16 - (reinterpret_cast<uint64_t>(d) & 15)) & 15);
  if (lane < head) d[lane] = s[lane];
  s += head, d += head, bytes -= head;
  const int64_t body = bytes & ~int64_t{15};
  if (lane < bytes - body) d[body + lane] = s[body + lane];
  const int k = static_cast<int>(reinterpret_cast<uint64_t>(s) & 15);
  uint4* d4 = reinterpret_cast<uint4*>(d);
  const uint4* base = reinterpret_cast<const uint4*>(s - k);
  const int r = (k & 3) * 8;
  switch (k >> 2) {
    case 0:
      if (k == 0)
        WarpCopy16(base, d4, body / 16, lane);
      else
        WarpCopyShifted<0>(base, d4, body / 16, r, lane);
      break;
    case 1:
      WarpCopyShifted<1>(base, d4, body / 16, r, lane);
      break;
    case 2:
      WarpCopyShifted<2>(base, d4, body / 16, r, lane);
      break;
    default:
      WarpCopyShifted<3>(base, d4, body / 16, r, lane);
      break;
  }
}

// ---- Tiles: a stretch of an item's [rows, inner] index space, crossing rows. ----

// Where a tile's accesses go. Positions count accesses (of `vector` bytes or elements, see
// CopyItem::vector): a row has inner_v of them. The access loops below take a view by value and
// are called, not inlined (see CopyItemsKernel), so a view is kept small: RowsView, the usual
// one, travels in registers; TileView's 100-odd bytes went through the stack at every call (the
// general kernel's kilobyte of stack, millions of local-memory requests for many small tensors).

// Each row one run (count[0] = count[1] = 1, most items, and a span as a tile of one row): row r
// at r * stride at both ends.
struct RowsView {
  const unsigned char* s;
  unsigned char* d;
  int64_t sst, dst;  // bytes between rows
  uint32_t inner_v;

  __device__ __forceinline__ int64_t SourceOffset(uint64_t row) const {
    return static_cast<int64_t>(row) * sst;
  }
  __device__ __forceinline__ int64_t DestinationOffset(uint64_t row) const {
    return static_cast<int64_t>(row) * dst;
  }
};

// Several loops (3-D and 4-D tensors): row r of the item is run (a, b, c) of its loops.
struct TileView {
  const unsigned char* s;
  unsigned char* d;
  int64_t sst[3], dst[3];  // bytes between runs of each loop
  int64_t c1, c2;          // count[1], count[2]
  uint32_t inner_v;

  __device__ __forceinline__ int64_t SourceOffset(uint64_t row) const {
    int64_t so, dof;
    RowOffsets(row, so, dof);
    return so;
  }
  __device__ __forceinline__ int64_t DestinationOffset(uint64_t row) const {
    int64_t so, dof;
    RowOffsets(row, so, dof);
    return dof;
  }

  // Byte offsets of row `row` at both ends: divisions per access, rare enough; 32-bit when they
  // fit.
  __device__ __forceinline__ void RowOffsets(uint64_t row, int64_t& so, int64_t& dof) const {
    int64_t a, b, c;
    if ((row >> 32) == 0 && ((c1 | c2) >> 32) == 0) {
      const uint32_t r = static_cast<uint32_t>(row), q = r / static_cast<uint32_t>(c2);
      c = r - q * static_cast<uint32_t>(c2);
      a = q / static_cast<uint32_t>(c1);
      b = q - static_cast<uint32_t>(a) * static_cast<uint32_t>(c1);
    } else {
      const uint64_t q = row / static_cast<uint64_t>(c2);
      c = static_cast<int64_t>(row - q * c2);
      a = static_cast<int64_t>(q / c1);
      b = static_cast<int64_t>(q) - a * c1;
    }
    so = a * sst[0] + b * sst[1] + c * sst[2];
    dof = a * dst[0] + b * dst[1] + c * dst[2];
  }
};

// A lane's position in the tile: its first access is lane positions past (row0, col0), then
// every step 32 further. The row and column are carried by adds and one compare, never a
// division per access: 32 positions are step_rows whole rows and step_cols columns.
struct TileWalk {
  uint64_t row;
  uint32_t col, inner_v, step_rows, step_cols;
  __device__ __forceinline__ TileWalk(uint64_t row0, uint32_t col0, uint32_t inner, int lane)
      : inner_v(inner) {
    const uint32_t c = col0 + static_cast<uint32_t>(lane), extra = c / inner;
    row = row0 + extra;
    col = c - extra * inner;
    step_rows = 32 / inner;
    step_cols = 32 - step_rows * inner;
  }
  __device__ __forceinline__ void Next() {
    col += step_cols;
    row += step_rows;
    if (col >= inner_v) col -= inner_v, ++row;
  }
};

// Same dtype: nv accesses of V bytes, K loads in flight per lane before their stores (more for
// narrow accesses, so that a warp keeps as many bytes in flight).
template <int V, int K, class View>
__device__ __forceinline__ void TileCopyInline(const View& t, uint64_t row0, uint32_t col0,
                                               int64_t nv, int lane) {
  using T = typename Access<V>::T;
  TileWalk w(row0, col0, t.inner_v, lane);
  for (int64_t i = lane; i < nv; i += 32 * K) {
    T r[K];
    // The stores walk the same positions again from here: recomputing an offset costs less
    // than K destination pointers held in registers (occupancy).
    const TileWalk at = w;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (i + 32 * k < nv)
        r[k] = *reinterpret_cast<const T*>(t.s + t.SourceOffset(w.row) +
                                           static_cast<int64_t>(w.col) * V);
      w.Next();
    }
    w = at;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (i + 32 * k < nv)
        *reinterpret_cast<T*>(t.d + t.DestinationOffset(w.row) + static_cast<int64_t>(w.col) * V) =
            r[k];
      w.Next();
    }
  }
}

template <int V, int K, class View>
__device__ __noinline__ void TileCopy(const View t, uint64_t row0, uint32_t col0, int64_t nv,
                                      int lane) {
  TileCopyInline<V, K>(t, row0, col0, nv, lane);
}

// Converting: nv accesses of E elements (E * SS bytes read, E * DS written).
template <int SS, int DS, int E, int K, class View>
__device__ __noinline__ void TileConvert(const View t, uint64_t row0, uint32_t col0, int64_t nv,
                                         uint8_t sdt, uint8_t ddt, int lane) {
  using TS = typename Access<E * SS>::T;
  using TD = typename Access<E * DS>::T;
  TileWalk w(row0, col0, t.inner_v, lane);
  for (int64_t i = lane; i < nv; i += 32 * K) {
    TS r[K];
    const TileWalk at = w;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (i + 32 * k < nv) {
        r[k] = *reinterpret_cast<const TS*>(t.s + t.SourceOffset(w.row) +
                                            static_cast<int64_t>(w.col) * (E * SS));
      }
      w.Next();
    }
    w = at;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (i + 32 * k < nv) {
        uint32_t in[(E * SS + 3) / 4], out[(E * DS + 3) / 4];
        ToWords<E * SS>(r[k], in);
#pragma unroll
        for (int e = 0; e < E; ++e)
          SetElement<DS>(out, e, FloatToBits(BitsToFloat(Element<SS>(in, e), sdt), ddt));
        *reinterpret_cast<TD*>(t.d + t.DestinationOffset(w.row) +
                               static_cast<int64_t>(w.col) * (E * DS)) = FromWords<E * DS>(out);
      }
      w.Next();
    }
  }
}

// Converting at addresses that are not multiples of the element size: element by element, bytes.
template <class View>
__device__ __noinline__ void TileConvertBytes(const View t, uint64_t row0, uint32_t col0,
                                              int64_t nv, uint8_t sdt, uint8_t ddt, int lane) {
  const int ss = Size(sdt), ds = Size(ddt);
  TileWalk w(row0, col0, t.inner_v, lane);
  for (int64_t i = lane; i < nv; i += 32) {
    const uint32_t bits =
        LoadBits(t.s + t.SourceOffset(w.row) + static_cast<int64_t>(w.col) * ss, ss);
    StoreBits(FloatToBits(BitsToFloat(bits, sdt), ddt),
              t.d + t.DestinationOffset(w.row) + static_cast<int64_t>(w.col) * ds, ds);
    w.Next();
  }
}

template <int SS, int DS, class View>
__device__ __forceinline__ void TileConvertE(const View t, uint64_t row0, uint32_t col0, int64_t nv,
                                             int e, uint8_t sdt, uint8_t ddt, int lane) {
  constexpr int kMaxE = 16 / (SS > DS ? SS : DS);
  if (e >= 8 && kMaxE >= 8)
    TileConvert<SS, DS, (kMaxE >= 8 ? 8 : 1), 4>(t, row0, col0, nv, sdt, ddt, lane);
  else if (e >= 4)
    TileConvert<SS, DS, 4, 4>(t, row0, col0, nv, sdt, ddt, lane);
  else if (e == 2)
    TileConvert<SS, DS, 2, 8>(t, row0, col0, nv, sdt, ddt, lane);
  else
    TileConvert<SS, DS, 1, 8>(t, row0, col0, nv, sdt, ddt, lane);
}

// e elements per access (0: bytes, at any address; CutIntoUnits sets 0 for pairs other than these).
template <class View>
__device__ __forceinline__ void ConvertTile(const View t, uint64_t row0, uint32_t col0, int64_t nv,
                                            int e, uint8_t sdt, uint8_t ddt, int lane) {
  const int ss = Size(sdt), ds = Size(ddt);
  if (e == 0)
    TileConvertBytes(t, row0, col0, nv, sdt, ddt, lane);
  else if (ss == 2 && ds == 4)
    TileConvertE<2, 4>(t, row0, col0, nv, e, sdt, ddt, lane);
  else if (ss == 4 && ds == 2)
    TileConvertE<4, 2>(t, row0, col0, nv, e, sdt, ddt, lane);
  else
    TileConvertE<2, 2>(t, row0, col0, nv, e, sdt, ddt, lane);
}

// Bytes per access at the source end of a tiled item.
__device__ __forceinline__ int SourceGrain(const CopyItem& it) {
  const int ss = Size(it.src_dtype);
  if (it.src_dtype == it.dst_dtype) return it.vector;
  return it.vector == 0 ? ss : it.vector * ss;
}

// An item's view: its rows' ends (RowsView) when count[0] = count[1] = 1, else its loops.
__device__ __forceinline__ RowsView RowsViewOf(const CopyItem& it, int sg) {
  const int ss = Size(it.src_dtype), ds = Size(it.dst_dtype);
  RowsView t;
  t.s = reinterpret_cast<const unsigned char*>(it.src);
  t.d = reinterpret_cast<unsigned char*>(it.dst);
  t.sst = it.src_stride[2] * ss;
  t.dst = it.dst_stride[2] * ds;
  t.inner_v = static_cast<uint32_t>(it.inner * ss / sg);
  return t;
}

__device__ __forceinline__ TileView TileViewOf(const CopyItem& it, int sg) {
  const int ss = Size(it.src_dtype), ds = Size(it.dst_dtype);
  TileView t;
  t.s = reinterpret_cast<const unsigned char*>(it.src);
  t.d = reinterpret_cast<unsigned char*>(it.dst);
  for (int k = 0; k < 3; ++k) t.sst[k] = it.src_stride[k] * ss, t.dst[k] = it.dst_stride[k] * ds;
  t.c1 = it.count[1];
  t.c2 = it.count[2];
  t.inner_v = static_cast<uint32_t>(it.inner * ss / sg);
  return t;
}

// nv accesses of sg source bytes through view t from position (row0, col0).
template <class View>
__device__ __forceinline__ void CopyTileIn(const View& t, int sg, uint8_t sdt, uint8_t ddt, int e,
                                           uint64_t row0, uint32_t col0, int64_t nv, int lane) {
  if (sdt == ddt) {
    switch (sg) {
      case 16:
        TileCopy<16, 4>(t, row0, col0, nv, lane);
        return;
      case 8:
        TileCopy<8, 8>(t, row0, col0, nv, lane);
        return;
      case 4:
        TileCopy<4, 8>(t, row0, col0, nv, lane);
        return;
      case 2:
        TileCopy<2, 8>(t, row0, col0, nv, lane);
        return;
      default:
        TileCopy<1, 8>(t, row0, col0, nv, lane);
        return;
    }
  }
  ConvertTile(t, row0, col0, nv, e, sdt, ddt, lane);
}

// A warp runs nv accesses of a tiled item from position (row0, col0).
__device__ __forceinline__ void CopyTile(const CopyItem& it, uint64_t row0, uint32_t col0,
                                         int64_t nv, int lane) {
  const int sg = SourceGrain(it);
  if (it.count[0] == 1 && it.count[1] == 1 && sg == 16 && it.src_dtype == it.dst_dtype) {
    TileCopyInline<16, 4>(RowsViewOf(it, sg), row0, col0, nv, lane);
  } else if (it.count[0] == 1 && it.count[1] == 1) {
    CopyTileIn(RowsViewOf(it, sg), sg, it.src_dtype, it.dst_dtype, it.vector, row0, col0, nv, lane);
  } else {
    CopyTileIn(TileViewOf(it, sg), sg, it.src_dtype, it.dst_dtype, it.vector, row0, col0, nv, lane);
  }
}

// One work unit resolved: `n` elements from s (src dtype) to d (dst dtype). A quantizing unit is
// one block: n = block rows << 32 | block cols, its first element at s (rows ss elements apart),
// its codes at d (rows ds bytes apart) or its scale at d.
// A tile (tile >= 0, its item's index): n accesses from row s, column d of the item's
// [rows, inner_v] grid of accesses (TileView).
struct Unit {
  uint64_t s = 0, d = 0;
  int64_t n = 0;
  uint32_t dtypes = 0;  // src dtype | dst dtype << 8 | op << 16 | quant format << 24
  int64_t ss = 0, ds = 0;
  int tile = -1;
};

// ---- Quantization: the arithmetic of plan/fp8_block.cc, bit for bit. ----

// CopyItem::Mxfp8Rows and RowsPerUnit on the device (the header's are host code): MXFP8's 1 x 32
// blocks, whose units are tiles of Mxfp8UnitRows(segment) rows and `segment` columns.
__device__ __forceinline__ bool MxRows(const CopyItem& it) {
  return it.quant_format == kCopyItemMxfp8 && it.block_rows == 1 && it.block_cols == 32;
}
// (A 32-bit division: segment is at most kMxfp8UnitCols; 64-bit ones here, inlined into the
// units' resolving, made ptxas spill in the aligned copy kernel.)
__device__ __forceinline__ int64_t UnitRows(const CopyItem& it) {
  return MxRows(it) ? max(1u, static_cast<uint32_t>(kMxfp8UnitElements) /
                                  max(static_cast<uint32_t>(it.segment), 1u))
                    : static_cast<int64_t>(it.block_rows);
}

// FloatToE4M3 (plan/fp8_block.cc), ported line by line: round to nearest even on the exact fp32
// value, saturating to +-448 (inf too; 464 is 448), NaN -> 0x7f / 0xff with its sign, the sign of
// a zero result kept. Integer code rather than __nv_cvt_float_to_fp8, whose NaN sign and
// behaviour in [448, 464] the CPU reference would have to be checked against.
__device__ __forceinline__ uint8_t FloatToE4M3(float value) {
  const uint32_t u = __float_as_uint(value);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7F;   // NaN
  if (a >= 0x43E00000u) return sign | 0x7E;  // >= 448 and inf: saturate
  const uint32_t exp = a >> 23;
  if (exp < 121) {
    if (exp < 117) return sign;  // below 2^-10: rounds to zero (fp32 subnormals included)
    const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 141 - exp;  // 21..24
    uint32_t q = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (q & 1))) ++q;
    return sign | static_cast<uint8_t>(q);
  }
  uint32_t v = a >> 20;
  const uint32_t rest = a & 0xFFFFFu;
  if (rest > 0x80000u || (rest == 0x80000u && (v & 1))) ++v;
  return sign | static_cast<uint8_t>(v - (120u << 3));
}

// BlockFp8Scale: amax / 448 by IEEE division (not a reciprocal), raised to FLT_MIN; 1 for 0.
__device__ __forceinline__ float BlockFp8Scale(float amax) {
  if (amax == 0.0f) return 1.0f;
  const float scale = __fdiv_rn(amax, 448.0f);
  const float kMin = __uint_as_float(0x00800000u);  // 2^-126
  return scale < kMin ? kMin : scale;
}

// Mxfp8ScaleCode: floor(log2(amax)) from the bits, minus 8, clamped to -127; 127 for 0.
// Selects rather than an early return for 0 (whose bits give code 0 here): no branch per block.
__device__ __forceinline__ uint8_t Mxfp8ScaleCode(float amax) {
  const uint32_t u = __float_as_uint(amax) & 0x7FFFFFFFu;
  const int floor_log2 = (u >> 23) != 0 ? static_cast<int>(u >> 23) - 127 : (31 - __clz(u)) - 149;
  const int shared_exp = max(floor_log2 - 8, -127);
  return u == 0 ? 127 : static_cast<uint8_t>(shared_exp + 127);
}

// E8M0ToFloat for the codes Mxfp8ScaleCode makes (0..254): 2^(code - 127), 2^-127 a subnormal.
__device__ __forceinline__ float E8M0ToFloat(uint8_t code) {
  return code == 0 ? __uint_as_float(0x00400000u)
                   : __uint_as_float(static_cast<uint32_t>(code) << 23);
}

// Whether element bits of a float dtype (bf16, fp16, fp32) are a NaN; SignBit: their sign as
// e4m3's.
__device__ __forceinline__ bool IsNanBits(uint32_t u, uint8_t dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::kBF16:
      return (u & 0x7FFFu) > 0x7F80u;
    case DType::kF16:
      return (u & 0x7FFFu) > 0x7C00u;
    default:
      return (u & 0x7FFFFFFFu) > 0x7F800000u;
  }
}

__device__ __forceinline__ uint8_t SignBit(uint32_t u, int size) {
  return (u >> (8 * size - 1)) & 1 ? 0x80 : 0;
}

// The max of `amax` and the finite |x| of eight bf16 (a 16-byte chunk).
__device__ __forceinline__ float Bf16ChunkAmax(const uint4& v, float amax) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int h = 0; h < 8; ++h) {
    const float a = fabsf(__uint_as_float(h & 1 ? w[h / 2] & 0xFFFF0000u : w[h / 2] << 16));
    if (isfinite(a) && a > amax) amax = a;
  }
  return amax;
}

// Eight bf16 (a 16-byte chunk) as e4m3 codes of x / scale, a NaN encoded from its own bits.
__device__ __forceinline__ uint2 Bf16ChunkCodes(const uint4& v, float scale) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t code[2] = {0, 0};
#pragma unroll
  for (int h = 0; h < 8; ++h) {
    const uint32_t bits = h & 1 ? w[h / 2] >> 16 : w[h / 2] & 0xFFFFu;
    const uint32_t q = IsNanBits(bits, static_cast<uint8_t>(DType::kBF16))
                           ? (SignBit(bits, 2) | 0x7F)
                           : FloatToE4M3(__fdiv_rn(__uint_as_float(bits << 16), scale));
    code[h / 4] |= q << (8 * (h % 4));
  }
  return make_uint2(code[0], code[1]);
}

// Bf16ChunkCodes out of line, for the rare chunk that holds an inf or a NaN (its port of
// FloatToE4M3 inlined at every call site took registers and code).
__device__ __noinline__ uint2 Bf16ChunkCodesDivided(uint4 v, float scale) {
  return Bf16ChunkCodes(v, scale);
}

// Two finite fp32 values as e4m3 codes, lo in the low byte: the hardware's round to nearest even,
// saturating to +-448. For finite input this is FloatToE4M3 bit for bit: both round the exact
// fp32 value to nearest even over e4m3's normals and subnormals (k * 2^-9), keep the sign of a
// zero result, and give 448 for everything that rounds past it ([448, 464] rounds to 448, the
// rest would be 480, NaN's pattern, and saturates). kernels/e4m3_rule_test checks that rule against
// FloatToE4M3 for every fp32 pattern on the CPU; copy_kernels_test checks this instruction against
// the port for every finite pattern on the GPU. NaN and inf never reach it (callers see to that).
__device__ __forceinline__ uint32_t E4M3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// The largest bf16 magnitude bits among eight (a 16-byte chunk) and `m`, infs and NaNs included:
// for non-negative floats the bits' order is the values' order. A result of 0x7F80 or more means
// the chunks held an inf or a NaN, and the finite amax must be taken the slow way.
__device__ __forceinline__ uint32_t Bf16ChunkMagnitudeMax(const uint4& v, uint32_t m) {
  m = __vmaxu2(m, v.x & 0x7FFF7FFFu);
  m = __vmaxu2(m, v.y & 0x7FFF7FFFu);
  m = __vmaxu2(m, v.z & 0x7FFF7FFFu);
  return __vmaxu2(m, v.w & 0x7FFF7FFFu);
}

__device__ __forceinline__ uint32_t HalvesMax(uint32_t m) { return max(m & 0xFFFFu, m >> 16); }

// How a block's elements become x / scale, the same bits as the reference's division. MXFP8's
// scale is a power of two 2^k, so x * 2^-k (exactly representable, k in [-127, 127]) is the exact
// quotient rounded once. Block fp8 (`corrected`: an amax of kCorrectedQuotientMinAmax or more)
// takes the reciprocal once and an FMA-corrected product per element (kernels/e4m3_quotient.h;
// __fdiv_rn per element made the quantizing kernel compute-bound); other blocks divide.
struct Divisor {
  float scale, inverse;
  bool power_of_two, corrected;
};

__device__ __forceinline__ Divisor BlockDivisor(float amax, bool mx, uint8_t* code) {
  Divisor q;
  q.power_of_two = mx;
  if (mx) {
    *code = Mxfp8ScaleCode(amax);  // 0..254 (at most 246 for finite amax)
    q.scale = E8M0ToFloat(*code);
    q.inverse = E8M0ToFloat(static_cast<uint8_t>(254 - *code));  // 2^(127 - code)
    q.corrected = false;
  } else {
    *code = 0;
    q.scale = BlockFp8Scale(amax);
    q.inverse = ReciprocalOf(q.scale);
    q.corrected = amax >= kCorrectedQuotientMinAmax;
    // A block of zeros (amax 0) has scale 1, a power of two: the product by 1 is the division's
    // quotient (each element itself, its sign kept). Dividing them element by element made such a
    // block cost several times another's, and weights do hold them (the refit's checked fill has
    // one block in eleven: on an H100 the kernel took 12.65 ms on those values, 9.90 on others).
    q.power_of_two = amax == 0.0f;
  }
  return q;
}

// Eight bf16 (a 16-byte chunk) as Bf16ChunkCodes makes them, `finite` when none is an inf or a
// NaN: the quotients (finite: |x| <= amax) by the hardware conversion, two elements an
// instruction; Bf16ChunkCodes itself for a chunk that is not finite or a block that divides.
__device__ __forceinline__ uint2 Bf16ChunkCodesFast(const uint4& v, const Divisor& q, bool finite) {
  if (!finite || !(q.power_of_two || q.corrected)) return Bf16ChunkCodesDivided(v, q.scale);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t pair[4];
  if (q.power_of_two) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pair[i] = E4M3x2(__fmul_rn(__uint_as_float(w[i] << 16), q.inverse),
                       __fmul_rn(__uint_as_float(w[i] & 0xFFFF0000u), q.inverse));
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pair[i] = E4M3x2(CorrectedQuotient(__uint_as_float(w[i] << 16), q.scale, q.inverse),
                       CorrectedQuotient(__uint_as_float(w[i] & 0xFFFF0000u), q.scale, q.inverse));
    }
  }
  return make_uint2(pair[0] | (pair[1] << 16), pair[2] | (pair[3] << 16));
}

// The top bit of a quantizing unit's format byte: its nr x nc elements are MXFP8's one-row blocks
// (Resolve, Mxfp8UnitRows), not one block.
constexpr uint8_t kRowsMode = 0x80;

// A warp quantizes one block of nr x nc elements at s (rows ss elements apart): the max of |x|
// over its finite elements, reduced across the lanes (max is exact and order-free), the block's
// scale, then kQuantize: the codes e4m3(x / scale) at d (rows ds bytes apart), a NaN encoded from
// its own bits (sign kept), not divided; kScale: the scale at d (fp32 bits, or an e8m0 byte).
__device__ __forceinline__ void QuantizeOneBlock(const unsigned char* s, unsigned char* d, int nr,
                                                 int nc, int64_t ss, int64_t ds, uint8_t sdt,
                                                 uint8_t op, uint8_t format, int lane) {
  const int size = Size(sdt);
  // bf16 blocks of whole 16-byte rows (128 x 128 blocks of row-major weights): 8 elements per
  // 16-byte load and 8 codes per 8-byte store, four loads in flight per lane. 2-byte loads one at
  // a time made a 16 GB bf16 -> fp8 refit 4x slower than the bf16 copy.
  const bool vector = sdt == static_cast<uint8_t>(DType::kBF16) && nc % 8 == 0 &&
                      ((reinterpret_cast<uint64_t>(s) | static_cast<uint64_t>(ss * 2)) & 15) == 0 &&
                      (op != static_cast<uint8_t>(CopyOp::kQuantize) ||
                       ((reinterpret_cast<uint64_t>(d) | static_cast<uint64_t>(ds)) & 7) == 0);
  const int chunks_per_row = nc / 8, chunks = nr * chunks_per_row;
  auto chunk_at = [&](int k) {
    return reinterpret_cast<const uint4*>(
        s + (static_cast<int64_t>(k / chunks_per_row) * ss + (k % chunks_per_row) * 8) * 2);
  };
  float amax = 0.0f;
  if (vector) {
    constexpr int kInFlight = 4;
    for (int k0 = lane; k0 < chunks; k0 += 32 * kInFlight) {
      uint4 v[kInFlight];
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        if (k0 + 32 * i < chunks) v[i] = *chunk_at(k0 + 32 * i);
      }
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        if (k0 + 32 * i < chunks) amax = Bf16ChunkAmax(v[i], amax);
      }
    }
  } else {
    for (int r = 0; r < nr; ++r) {
      const unsigned char* row = s + r * ss * size;
      for (int c = lane; c < nc; c += 32) {
        const float a = fabsf(BitsToFloat(LoadBits(row + c * size, size), sdt));
        if (isfinite(a) && a > amax) amax = a;
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  const bool mx = format == kCopyItemMxfp8;
  const uint8_t code = mx ? Mxfp8ScaleCode(amax) : 0;
  const float scale = mx ? E8M0ToFloat(code) : BlockFp8Scale(amax);
  if (op == static_cast<uint8_t>(CopyOp::kScale)) {
    if (lane == 0) {
      if (mx)
        *d = code;
      else
        StoreBits(__float_as_uint(scale), d, 4);
    }
    return;
  }
  if (vector) {
    for (int k = lane; k < chunks; k += 32) {
      *reinterpret_cast<uint2*>(d + static_cast<int64_t>(k / chunks_per_row) * ds +
                                (k % chunks_per_row) * 8) = Bf16ChunkCodes(*chunk_at(k), scale);
    }
    return;
  }
  for (int r = 0; r < nr; ++r) {
    const unsigned char* row = s + r * ss * size;
    unsigned char* out = d + r * ds;
    for (int c = lane; c < nc; c += 32) {
      const uint32_t bits = LoadBits(row + c * size, size);
      out[c] = IsNanBits(bits, sdt) ? (SignBit(bits, size) | 0x7F)
                                    : FloatToE4M3(__fdiv_rn(BitsToFloat(bits, sdt), scale));
    }
  }
}

// MXFP8's block of one lane's chunk (eight bf16): its four chunks in lanes 4k..4k+3 (every lane of
// the warp calls it), the max of their finite |x| (xor 1, 2), its e8m0 code and divisor; `finite`
// when this chunk holds no inf or NaN.
__device__ __forceinline__ Divisor RowsBlockDivisor(const uint4& v, uint8_t* code, bool* finite) {
  const uint32_t m = HalvesMax(Bf16ChunkMagnitudeMax(v, 0));
  *finite = m < 0x7F80u;
  float amax = *finite ? __uint_as_float(m << 16) : Bf16ChunkAmax(v, 0.0f);
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
  return BlockDivisor(amax, true, code);
}

__device__ __forceinline__ void QuantizeBlock(const unsigned char* s, unsigned char* d, int nr,
                                              int nc, int64_t ss, int64_t ds, uint8_t sdt,
                                              uint8_t op, uint8_t format, int lane) {
  const bool quantize = op == static_cast<uint8_t>(CopyOp::kQuantize);
  const bool rows = (format & kRowsMode) != 0;
  format &= ~kRowsMode;
  // One block; or MXFP8's one-row blocks one after another, a warp each: the copy kernels meet
  // their tiles only without the quantizing kernel (LaunchCopyItems' `quantizing` false), which
  // sends here only rare shapes. A vector loop of the tiles inlined in the aligned kernel, with
  // 64-bit divisions at resolve, made ptxas spill 120 bytes there and its bf16 copies lost 2.5%
  // (11.16 -> 11.44 ms, one H100).
  if (!rows) {
    QuantizeOneBlock(s, d, nr, nc, ss, ds, sdt, op, format, lane);
    return;
  }
  const int size = Size(sdt);
  for (int r = 0; r < nr; ++r) {
    for (int c = 0; c < nc; c += 32) {
      QuantizeOneBlock(s + (r * ss + c) * size, d + r * ds + (quantize ? c : c / 32), 1,
                       min(32, nc - c), ss, ds, sdt, op, format, lane);
    }
  }
}

// The general kernel calls it (its own registers: inlined there, with tiles, it spilled); the
// aligned kernel inlines it, as before tiles (no spills: a 16 GB bf16 -> fp8 refit 27.7 ms,
// against 35.3 through the call).
__device__ __noinline__ void QuantizeUnit(const unsigned char* s, unsigned char* d, int nr, int nc,
                                          int64_t ss, int64_t ds, uint8_t sdt, uint8_t op,
                                          uint8_t format, int lane) {
  QuantizeBlock(s, d, nr, nc, ss, ds, sdt, op, format, lane);
}

// ---- The quantizing kernel (LaunchCopyItems' `quantizing`): a thread block per block fp8 block.
// ----

// A kQuantize item and the kScale item of the same region (same source, block and format): the
// quantizing kernel writes the scales with the codes, from one read (ScaleTwins on the host, whose
// QuantizingLaunchUnits gives such kScale items no units; where units remain, they do nothing).
__device__ __forceinline__ bool Twins(const CopyItem& q, const CopyItem& s) {
  return (q.op == static_cast<uint8_t>(CopyOp::kQuantize)) &
         (s.op == static_cast<uint8_t>(CopyOp::kScale)) & (q.src == s.src) &
         (q.src_dtype == s.src_dtype) & (q.inner == s.inner) & (q.count[0] == s.count[0]) &
         (q.count[1] == s.count[1]) & (q.count[2] == s.count[2]) &
         (q.src_stride[2] == s.src_stride[2]) & (q.block_rows == s.block_rows) &
         (q.block_cols == s.block_cols) & (q.quant_format == s.quant_format) &
         (q.segments == s.segments);
}

// Of item i: kQuantize, bit k set when items[i + 1 + k] is its twin (it writes their scales);
// kScale, 1 when some kQuantize item of the kTwinWindow before it is its twin (its units do
// nothing).
__device__ __noinline__ uint32_t TwinMask(const CopyItem* items, int n_items, int i) {
  const CopyItem& it = items[i];
  uint32_t mask = 0;
  if (it.op == static_cast<uint8_t>(CopyOp::kQuantize)) {
#pragma unroll
    for (int k = 0; k < kTwinWindow; ++k) {
      if (i + 1 + k < n_items && Twins(it, items[i + 1 + k])) mask |= 1u << k;
    }
  } else if (it.op == static_cast<uint8_t>(CopyOp::kScale)) {
#pragma unroll
    for (int k = 0; k < kTwinWindow; ++k) {
      if (i - 1 - k >= 0 && Twins(items[i - 1 - k], it)) mask = 1;
    }
  }
  return mask;
}

// The scale of block row `block_row` (of the item's grid), block column bj, in twin scale item t.
__device__ __forceinline__ unsigned char* TwinScaleAt(const CopyItem& t, int64_t block_row,
                                                      int64_t bj) {
  return reinterpret_cast<unsigned char*>(t.dst) +
         (block_row * t.dst_stride[2] + bj) * Size(t.dst_dtype);
}

// A quantizing unit as the quantizing kernel sees it: Resolve's fields, its item, the item's twins.
struct QuantUnit {
  Unit u;
  int item = -1;
  uint32_t twins = 0;
  __device__ __forceinline__ int nr() const { return static_cast<int>(u.n >> 32); }
  __device__ __forceinline__ int nc() const { return static_cast<int>(u.n & 0xFFFFFFFF); }
  __device__ __forceinline__ uint8_t sdt() const { return static_cast<uint8_t>(u.dtypes & 0xFF); }
  __device__ __forceinline__ uint8_t op() const {
    return static_cast<uint8_t>((u.dtypes >> 16) & 0xFF);
  }
  __device__ __forceinline__ uint8_t format() const { return static_cast<uint8_t>(u.dtypes >> 24); }
  __device__ __forceinline__ bool quantize() const {
    return op() == static_cast<uint8_t>(CopyOp::kQuantize);
  }
  // bf16 in whole 16-byte chunks, 16-byte aligned rows; codes (if any) in 8-byte aligned rows.
  __device__ __forceinline__ bool Vector() const {
    return sdt() == static_cast<uint8_t>(DType::kBF16) && nc() % 8 == 0 &&
           ((u.s | static_cast<uint64_t>(u.ss * 2)) & 15) == 0 &&
           (!quantize() || ((u.d | static_cast<uint64_t>(u.ds)) & 7) == 0);
  }
};

__device__ __forceinline__ QuantUnit ShflQuantUnit(const QuantUnit& q, int j) {
  QuantUnit r;
  r.u.s = __shfl_sync(0xFFFFFFFFu, static_cast<unsigned long long>(q.u.s), j);
  r.u.d = __shfl_sync(0xFFFFFFFFu, static_cast<unsigned long long>(q.u.d), j);
  r.u.n = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(q.u.n), j);
  r.u.ss = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(q.u.ss), j);
  r.u.ds = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(q.u.ds), j);
  r.u.dtypes = __shfl_sync(0xFFFFFFFFu, q.u.dtypes, j);
  r.item = __shfl_sync(0xFFFFFFFFu, q.item, j);
  r.twins = __shfl_sync(0xFFFFFFFFu, q.twins, j);
  return r;
}

// The unit's first row in its item and its first block's column (of the scale grid).
__device__ __forceinline__ void BlockOf(const CopyItem& it, int64_t local, int64_t* first_row,
                                        int64_t* bj) {
  *first_row = local / it.segments * UnitRows(it);
  *bj = MxRows(it) ? local % it.segments * it.segment / 32 : local % it.segments;
}

// The quantizing kernel's main work is block fp8 tiles: a block of at most kTileChunks 16-byte
// bf16 chunks (128 x 128 bf16), kChunksPerThread a thread, that the thread block quantizes together
// (its amax reduced through shared memory). The next tiles' chunks are copied into shared memory
// (cp.async, no registers held) while a tile converts and stores from registers, so that a thread
// block keeps 32 KB in flight: loading a tile only once the last one was written left the memory
// idle (27 ms for a Llama-3-8B to block fp8 on an H200, 4.5x the memory bound), and a second set of
// registers for the next tile spilled (128 registers a thread).
constexpr int kQuantThreads = 256;
constexpr int kQuantWarps = kQuantThreads / 32;
constexpr int kChunksPerThread = 8;
constexpr int kTileChunks = kQuantThreads * kChunksPerThread;  // 128 x 128 bf16
// Tiles' chunks in shared memory, [stage][i][thread] (a thread reads back only what it staged):
// the one converting and the next kStages - 1 in flight (three stages ran no faster than two:
// Llama-3-8B to block fp8 9.03 against 8.89 ms on an H200).
constexpr int kStages = 2;
constexpr int kStagedBytes = kStages * kChunksPerThread * kQuantThreads * 16;

// 16 bytes from global `src` to shared `dst` (zeros where !on; `src` must still be a valid
// address), without passing through registers; visible to this thread after WaitStaged.
__device__ __forceinline__ void Stage16(uint4* dst, const void* src, bool on) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(at), "l"(src),
               "r"(on ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CommitStaged() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits for this thread's groups but the kStages - 2 committed last (one group a tile, empty past
// the last).
__device__ __forceinline__ void WaitStaged() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
}

// MXFP8 units of one-row blocks (tiles of them: FinishRowsTile).
__device__ __forceinline__ bool RowsMode(const QuantUnit& q) {
  return q.item >= 0 && (q.format() & kRowsMode);
}

// A tile of whole 16-byte chunks, aligned; MXFP8 rows of whole blocks (a block's four chunks in
// four lanes of a row) with at most one twin.
__device__ __forceinline__ bool TileFits(const QuantUnit& q) {
  return q.Vector() &&
         (!(q.format() & kRowsMode) || (q.nc() % 32 == 0 && (q.twins & (q.twins - 1)) == 0)) &&
         static_cast<int64_t>(q.nr()) * (q.nc() / 8) <= kTileChunks;
}

// Whether the kernel runs a resolved unit: not a copy unit, and not a kScale unit whose twin
// writes its scales.
__device__ __forceinline__ bool Runs(const QuantUnit& q) {
  return q.item >= 0 && (q.quantize() || q.twins == 0);
}

// Where chunk i of this thread lies in a tile of `cpr` chunks a row: chunk t + kQuantThreads * i
// in row-major order. Rows of a power-of-two count of chunks up to kQuantThreads (128 columns: 16)
// keep the thread's column and step the row by kQuantThreads / cpr: no division per chunk (the
// divisions took a fifth of the kernel's instructions).
struct TileChunks {
  int cpr, row0, col0, rows_per_step;
  bool even;
  __device__ __forceinline__ explicit TileChunks(int chunks_per_row) : cpr(max(chunks_per_row, 1)) {
    even = (cpr & (cpr - 1)) == 0 && cpr <= kQuantThreads;
    const int t = threadIdx.x;
    row0 = even ? t >> (__ffs(cpr) - 1) : 0;
    col0 = even ? t & (cpr - 1) : 0;
    rows_per_step = even ? kQuantThreads >> (__ffs(cpr) - 1) : 0;
  }
  // Whether this thread's chunks are all inside a tile of nr rows, at rows row0 + rows_per_step * i
  // of column col0.
  __device__ __forceinline__ bool AllIn(int nr) const {
    return even && row0 + rows_per_step * (kChunksPerThread - 1) < nr;
  }
  __device__ __forceinline__ void At(int i, int* row, int* col) const {
    if (even) {
      *row = row0 + rows_per_step * i;
      *col = col0;
    } else {
      const int k = static_cast<int>(threadIdx.x) + kQuantThreads * i;
      *row = k / cpr;
      *col = k - *row * cpr;
    }
  }
};

// Stages this thread's chunks of tile q into staged[i * kQuantThreads + t], zeros past its end
// (`fallback` is the valid address the zero fills name); the caller commits the group.
__device__ __forceinline__ void StageTile(const QuantUnit& q, uint4* staged, const void* fallback) {
  const unsigned char* s = reinterpret_cast<const unsigned char*>(q.u.s);
  const TileChunks walk(q.nc() / 8);
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) {
    int row, c;
    walk.At(i, &row, &c);
    const bool in = row < q.nr();
    Stage16(staged + i * kQuantThreads + threadIdx.x,
            in ? s + (static_cast<int64_t>(row) * q.u.ss + c * 8) * 2 : fallback, in);
  }
}

// A tile's codes (and its twins' scales) or its scale, from its chunks in v (StageTile), the amax
// reduced across the thread block through `partial` (one __syncthreads). kStraight: with the
// straight-line path for the usual tile (compiled into the kernel for block fp8's tiles only: its
// registers cost the other path spills).
template <bool kStraight>
__device__ __forceinline__ void FinishTile(const QuantUnit& q, const CopyItem* items, int64_t local,
                                           float* partial, const uint4 (&v)[kChunksPerThread]) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) m = Bf16ChunkMagnitudeMax(v[i], m);
  const bool finite = HalvesMax(m) < 0x7F80u;  // all of this thread's chunks
  float amax = __uint_as_float(HalvesMax(m) << 16);
  if (!finite) {  // an inf or a NaN here: the max over the finite ones
    amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) amax = Bf16ChunkAmax(v[i], amax);
  }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  if (lane == 0) partial[warp] = amax;
  __syncthreads();
  amax = partial[0];
#pragma unroll
  for (int w = 1; w < kQuantWarps; ++w) amax = fmaxf(amax, partial[w]);
  const bool mx = (q.format() & ~kRowsMode) == kCopyItemMxfp8;
  uint8_t code;
  const Divisor div = BlockDivisor(amax, mx, &code);
  if (t == 0) {
    auto put = [&](unsigned char* at) {
      if (mx)
        *at = code;
      else
        StoreBits(__float_as_uint(div.scale), at, 4);
    };
    if (!q.quantize()) {
      put(reinterpret_cast<unsigned char*>(q.u.d));
    } else if (q.twins != 0) {
      const CopyItem& it = items[q.item];
      int64_t first_row, bj;
      BlockOf(it, local, &first_row, &bj);
      for (int k = 0; k < kTwinWindow; ++k) {
        if (q.twins >> k & 1)
          put(TwinScaleAt(items[q.item + 1 + k], first_row / it.block_rows, bj));
      }
    }
  }
  if (!q.quantize()) return;
  unsigned char* d = reinterpret_cast<unsigned char*>(q.u.d);
  const TileChunks walk(q.nc() / 8);
  if (kStraight && __all_sync(0xFFFFFFFFu, finite && walk.AllIn(q.nr())) &&
      (div.power_of_two || div.corrected)) {
    // The usual tile: straight-line code for one kind of quotient, the stores' addresses stepped.
    unsigned char* out = d + static_cast<int64_t>(walk.row0) * q.u.ds + walk.col0 * 8;
    const int64_t out_step = static_cast<int64_t>(walk.rows_per_step) * q.u.ds;
    if (div.corrected) {
      const Divisor corrected = {div.scale, div.inverse, false, true};
#pragma unroll
      for (int i = 0; i < kChunksPerThread; ++i)
        *reinterpret_cast<uint2*>(out + i * out_step) = Bf16ChunkCodesFast(v[i], corrected, true);
    } else {
      const Divisor pow2 = {div.scale, div.inverse, true, false};
#pragma unroll
      for (int i = 0; i < kChunksPerThread; ++i)
        *reinterpret_cast<uint2*>(out + i * out_step) = Bf16ChunkCodesFast(v[i], pow2, true);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) {
    int row, c;
    walk.At(i, &row, &c);
    if (row < q.nr())
      *reinterpret_cast<uint2*>(d + static_cast<int64_t>(row) * q.u.ds + c * 8) =
          Bf16ChunkCodesFast(v[i], div, finite);
  }
}

// A tile of MXFP8's one-row blocks from its chunks in v (StageTile): no thread block's amax; each
// block's four chunks are in four consecutive threads of one row (TileChunks: a row's chunks run
// along the threads), which take its amax and code (RowsBlockDivisor) and write their codes; the
// block's first thread writes its code into the kScale unit's grid, or (kQuantize) into its
// twin's, so that the source is read once for both. kStraight: with the straight-line path for
// the usual tile (compiled into the kernel for MXFP8's tiles only, as FinishTile's).
template <bool kStraight>
__device__ __forceinline__ void FinishRowsTile(const QuantUnit& q, const CopyItem* items,
                                               int64_t local, const uint4 (&v)[kChunksPerThread]) {
  const bool quantize = q.quantize();
  // Where block (row, 0) of the tile puts its code, and the grid's row stride: the kScale unit's,
  // or its twin's (TileFits: one at most).
  unsigned char* scale = reinterpret_cast<unsigned char*>(q.u.d);
  int64_t scale_stride = q.u.ds;
  if (quantize) {
    scale = nullptr;
    if (q.twins != 0) {
      int64_t first_row, bj;
      BlockOf(items[q.item], local, &first_row, &bj);
      const CopyItem& twin = items[q.item + __ffs(q.twins)];
      scale = TwinScaleAt(twin, first_row, bj);
      scale_stride = twin.dst_stride[2];
    }
  }
  unsigned char* d = reinterpret_cast<unsigned char*>(q.u.d);
  const TileChunks walk(q.nc() / 8);
  uint32_t all = 0;
  if (kStraight) {
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) all = Bf16ChunkMagnitudeMax(v[i], all);
  }
  if (kStraight && __all_sync(0xFFFFFFFFu, HalvesMax(all) < 0x7F80u && walk.AllIn(q.nr()))) {
    // The usual tile: straight-line code, the stores' addresses stepped (the loop below spent
    // two thirds of its ~120 instructions a chunk on branches, the walk and addresses).
    const Divisor pow2 = {1.0f, 1.0f, true, false};
    unsigned char* out = d + static_cast<int64_t>(walk.row0) * q.u.ds + walk.col0 * 8;
    const int64_t out_step = static_cast<int64_t>(walk.rows_per_step) * q.u.ds;
    const bool writes_scale = scale != nullptr && (walk.col0 & 3) == 0;
    unsigned char* code_at =
        writes_scale ? scale + static_cast<int64_t>(walk.row0) * scale_stride + walk.col0 / 4
                     : nullptr;
    const int64_t code_step = static_cast<int64_t>(walk.rows_per_step) * scale_stride;
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      // Each chunk's max again: eight kept from the check above spilled (128 registers a thread).
      float amax = __uint_as_float(HalvesMax(Bf16ChunkMagnitudeMax(v[i], 0)) << 16);
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
      const uint8_t code = Mxfp8ScaleCode(amax);
      Divisor div = pow2;
      div.inverse = E8M0ToFloat(static_cast<uint8_t>(254 - code));  // 2^(127 - code)
      if (quantize) *reinterpret_cast<uint2*>(out) = Bf16ChunkCodesFast(v[i], div, true);
      if (writes_scale) *code_at = code;
      out += out_step;
      code_at += code_step;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) {
    int row, c;
    walk.At(i, &row, &c);
    uint8_t code;
    bool chunk_finite;
    const Divisor div = RowsBlockDivisor(v[i], &code, &chunk_finite);
    if (row >= q.nr()) continue;
    if (quantize) {
      *reinterpret_cast<uint2*>(d + static_cast<int64_t>(row) * q.u.ds + c * 8) =
          Bf16ChunkCodesFast(v[i], div, chunk_finite);
    }
    if ((c & 3) == 0 && scale != nullptr) scale[row * scale_stride + c / 4] = code;
  }
}

// Any other quantizing unit, one warp: the copy kernel's code (QuantizeBlock), then each twin's
// scales by the same code (a second read; these shapes are rare: fp16 and fp32 sources, unaligned
// rows, blocks over 128 x 128).
__device__ __noinline__ void QuantizeUnitWithTwins(const QuantUnit& q, const CopyItem* items,
                                                   int64_t local, int lane) {
  const unsigned char* s = reinterpret_cast<const unsigned char*>(q.u.s);
  QuantizeBlock(s, reinterpret_cast<unsigned char*>(q.u.d), q.nr(), q.nc(), q.u.ss, q.u.ds, q.sdt(),
                q.op(), q.format(), lane);
  if (!q.quantize() || q.twins == 0) return;
  const CopyItem& it = items[q.item];
  int64_t first_row, bj;
  BlockOf(it, local, &first_row, &bj);
  for (int k = 0; k < kTwinWindow; ++k) {
    if (!(q.twins >> k & 1)) continue;
    const CopyItem& twin = items[q.item + 1 + k];
    QuantizeBlock(s, TwinScaleAt(twin, first_row / it.block_rows, bj), q.nr(), q.nc(), q.u.ss,
                  twin.dst_stride[2], q.sdt(), static_cast<uint8_t>(CopyOp::kScale), q.format(),
                  lane);
  }
}

// A quantizing unit (op != kCopy): unit `local` of item `it`.
__device__ __forceinline__ Unit ResolveQuantizing(const CopyItem& it, int64_t local) {
  // Block (bi, bj) of the region, or (MXFP8, one-row blocks) the tile of UnitRows(it) rows and
  // `segment` columns at (bi, bj), each block scaled on its own (QuantizeBlock's rows mode).
  const bool rows = MxRows(it);
  const int64_t g = UnitRows(it);
  const int64_t bi = local / it.segments, bj = local % it.segments;
  const int64_t r0 = bi * g, c0 = bj * it.segment;
  const int64_t nr = min(g, it.count[2] - r0);
  const int64_t nc = min(it.segment, it.inner - c0);
  Unit unit;
  unit.n = nr << 32 | nc;
  unit.s = it.src + (r0 * it.src_stride[2] + c0) * Size(it.src_dtype);
  unit.d = it.op == static_cast<uint8_t>(CopyOp::kQuantize)
               ? it.dst + r0 * it.dst_stride[2] + c0
               : it.dst + (r0 / it.block_rows * it.dst_stride[2] + (rows ? c0 / 32 : bj)) *
                              Size(it.dst_dtype);
  unit.ss = it.src_stride[2];
  unit.ds = it.dst_stride[2];
  unit.dtypes = it.src_dtype | (static_cast<uint32_t>(it.dst_dtype) << 8) |
                (static_cast<uint32_t>(it.op) << 16) |
                (static_cast<uint32_t>(it.quant_format | (rows ? kRowsMode : 0)) << 24);
  return unit;
}

// The item of unit u: the last with unit_begin <= u.
__device__ __forceinline__ int ItemOf(const int64_t* unit_begin, int n_items, int64_t u) {
  int lo = 0, hi = n_items - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (unit_begin[mid] <= u)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

template <bool kTiles>
__device__ __forceinline__ Unit Resolve(const CopyItem* items, const int64_t* unit_begin,
                                        int n_items, int64_t u) {
  const int lo = ItemOf(unit_begin, n_items, u);
  const CopyItem& it = items[lo];
  const int64_t local = u - unit_begin[lo];
  if (it.op != static_cast<uint8_t>(CopyOp::kCopy)) return ResolveQuantizing(it, local);
  if (kTiles && it.tiled) {
    // Elements [first, first + n) of the flattened index space, in accesses of sg source bytes
    // (CutIntoUnits made segment, inner and the strides multiples of them): one 64-bit
    // division per unit, by this lane of the batch.
    const int ss = Size(it.src_dtype), sg = SourceGrain(it);
    const int64_t first = local * it.segment;
    const int64_t n = min(it.segment, it.count[0] * it.count[1] * it.count[2] * it.inner - first);
    const int64_t inner_v = it.inner * ss / sg, first_v = first * ss / sg;
    Unit unit;
    unit.tile = lo;
    unit.s = static_cast<uint64_t>(first_v / inner_v);
    unit.d = static_cast<uint64_t>(first_v - static_cast<int64_t>(unit.s) * inner_v);
    unit.n = n * ss / sg;
    return unit;
  }
  const int64_t seg = local % it.segments;
  int64_t run = local / it.segments;
  const int64_t c = run % it.count[2];
  run /= it.count[2];
  const int64_t b = run % it.count[1];
  const int64_t a = run / it.count[1];
  const int64_t first = seg * it.segment;
  const int ss = Size(it.src_dtype), ds = Size(it.dst_dtype);
  Unit unit;
  unit.n = min(it.segment, it.inner - first);
  unit.s =
      it.src + (a * it.src_stride[0] + b * it.src_stride[1] + c * it.src_stride[2] + first) * ss;
  unit.d =
      it.dst + (a * it.dst_stride[0] + b * it.dst_stride[1] + c * it.dst_stride[2] + first) * ds;
  unit.dtypes = it.src_dtype | (static_cast<uint32_t>(it.dst_dtype) << 8);
  return unit;
}

// A warp copies one run (or a segment of one) of n elements.
__device__ __forceinline__ void CopyUnit(const unsigned char* s, unsigned char* d, int64_t n,
                                         uint8_t sdt, uint8_t ddt, int lane) {
  const int ss = Size(sdt), ds = Size(ddt);
  if (sdt == ddt) {
    WarpCopyBytes(s, d, n * ss, lane);
    return;
  }
  const uint64_t sa = reinterpret_cast<uint64_t>(s), da = reinterpret_cast<uint64_t>(d);
  if (((sa | da) & 15) == 0 && n % 8 == 0) {
    WarpConvertVector(s, d, n, sdt, ddt, ss, ds, lane);
    return;
  }
  // The span as a tile of one row: the widest access both ends allow.
  RowsView t;
  t.s = s;
  t.d = d;
  t.sst = t.dst = 0;
  const bool pair = (ss == 2 || ss == 4) && (ds == 2 || ds == 4);
  int e = 0;
  if (pair && sa % ss == 0 && da % ds == 0) {
    e = 16 / max(ss, ds);
    while (e > 1 && ((sa / ss) % e != 0 || (da / ds) % e != 0 || n % e != 0)) e /= 2;
  }
  const int64_t nv = e == 0 ? n : n / e;
  t.inner_v =
      static_cast<uint32_t>(min(nv, static_cast<int64_t>(0x7FFFFFFF)));  // a segment: far below
  ConvertTile(t, 0, 0, nv, e, sdt, ddt, lane);
}

// A unit of the aligned kernel: both ends 16-byte aligned, n a multiple of 16 bytes (same dtype)
// or of 8 elements (converting), as AlignedOnly checked on the host.
__device__ __forceinline__ void CopyAlignedUnit(const unsigned char* s, unsigned char* d, int64_t n,
                                                uint8_t sdt, uint8_t ddt, int lane) {
  const int ss = Size(sdt), ds = Size(ddt);
  if (sdt == ddt)
    WarpCopy16Inline(reinterpret_cast<const uint4*>(s), reinterpret_cast<uint4*>(d), n * ss / 16,
                     lane);
  else
    WarpConvertVector(s, d, n, sdt, ddt, ss, ds, lane);
}

// Each warp takes batches of `batch` consecutive units in turn. Its first `batch` lanes resolve
// one unit each at once (the item searches and loads overlap instead of running one after another
// per unit), then the whole warp copies them one by one. Tens of thousands of 2-8 KB units then
// need fewer, shorter-lived blocks: beside NCCL's kernels, the 99k-tensor refit on 2 x H200 ran
// 2.2x faster (docs/BENCHMARKS.md).
// 80 registers a thread (3 blocks of 256 an SM), as before tiles. Every access loop is a
// separate __noinline__ function so that each is allocated on its own: inlined together (tiles
// of five widths, casts, shifted spans, fp8 blocks) ptxas gave the kernel 210 registers, or
// kilobytes of spills under this bound. A call per unit costs a few callee-saved registers.
// kTiles: the general kernel (tiles, unaligned spans, every access width); without, the aligned
// kernel: every copy unit 16-byte aligned at both ends (AlignedOnly), so its copies are the
// 16-byte loop and the vector conversion, inlined with the fp8 blocks into 80 registers without
// spills, as before tiles existed (the general kernel spills a few hundred bytes per thread and
// calls its loops: the 16 GB aligned refit 8.34 -> 8.77 ms, bf16 -> fp8 27.7 -> 35.3 ms through
// it). skip_quantizing: quantizing units are QuantizeItemsKernel's, launched beside it; and
// kQuantizes false: a kernel without the copy kernels' quantizing code, for launches that skip it
// (LaunchCopyItems' `quantizing`), so that its copies are allocated alone (the aligned kernel
// with the MXFP8 row tiles' code inlined spilled 120 bytes, 4 without).
template <bool kTiles, bool kQuantizes>
__global__ void __launch_bounds__(256, 3)
    CopyItemsKernel(const CopyItem* items, const int64_t* unit_begin, int n_items,
                    int64_t total_units, int batch, bool spread, bool skip_quantizing,
                    const uint32_t* gate, uint32_t go) {
  // Launched ahead and not let go (the round was called off): nothing. Every thread reads the
  // same word, written by LaunchGate's kernel before this one began.
  if (gate != nullptr && *reinterpret_cast<const volatile uint32_t*>(gate) != go) return;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  // Each round covers warps * batch units. Consecutive: warp w takes units w * batch + j; spread:
  // units w + j * warps (the warps running at any moment on neighbouring units).
  const int64_t step = spread ? warps : 1, warp_step = spread ? 1 : batch;
  for (int64_t r = 0; r + warp * warp_step < total_units; r += warps * batch) {
    const int64_t first = r + warp * warp_step;
    const int count =
        static_cast<int>(min(static_cast<int64_t>(batch), (total_units - 1 - first) / step + 1));
    Unit mine;
    if (lane < count) mine = Resolve<kTiles>(items, unit_begin, n_items, first + lane * step);
    for (int j = 0; j < count; ++j) {
      const int tile = kTiles ? __shfl_sync(0xFFFFFFFFu, mine.tile, j) : -1;
      if (kTiles && tile >= 0) {
        const uint64_t row0 = __shfl_sync(0xFFFFFFFFu, static_cast<unsigned long long>(mine.s), j);
        const uint32_t col0 = __shfl_sync(0xFFFFFFFFu, static_cast<uint32_t>(mine.d), j);
        const int64_t nv = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(mine.n), j);
        CopyTile(items[tile], row0, col0, nv, lane);
        continue;
      }
      const uint64_t s = __shfl_sync(0xFFFFFFFFu, static_cast<unsigned long long>(mine.s), j);
      const uint64_t d = __shfl_sync(0xFFFFFFFFu, static_cast<unsigned long long>(mine.d), j);
      const int64_t n = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(mine.n), j);
      const uint32_t dtypes = __shfl_sync(0xFFFFFFFFu, mine.dtypes, j);
      if (((dtypes >> 16) & 0xFF) !=
          0) {  // a quantizing unit (op != kCopy): one block, this warp alone
        // The quantizing kernel's unit (MXFP8's row tiles too).
        if (!kQuantizes || skip_quantizing) continue;
        const int64_t ss = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(mine.ss), j);
        const int64_t ds = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(mine.ds), j);
        if constexpr (kTiles) {
          QuantizeUnit(
              reinterpret_cast<const unsigned char*>(s), reinterpret_cast<unsigned char*>(d),
              static_cast<int>(n >> 32), static_cast<int>(n & 0xFFFFFFFF), ss, ds,
              static_cast<uint8_t>(dtypes & 0xFF), static_cast<uint8_t>((dtypes >> 16) & 0xFF),
              static_cast<uint8_t>(dtypes >> 24), lane);
        } else {
          QuantizeBlock(
              reinterpret_cast<const unsigned char*>(s), reinterpret_cast<unsigned char*>(d),
              static_cast<int>(n >> 32), static_cast<int>(n & 0xFFFFFFFF), ss, ds,
              static_cast<uint8_t>(dtypes & 0xFF), static_cast<uint8_t>((dtypes >> 16) & 0xFF),
              static_cast<uint8_t>(dtypes >> 24), lane);
        }
        continue;
      }
      if constexpr (kTiles) {
        CopyUnit(reinterpret_cast<const unsigned char*>(s), reinterpret_cast<unsigned char*>(d), n,
                 static_cast<uint8_t>(dtypes & 0xFF), static_cast<uint8_t>(dtypes >> 8), lane);
      } else {
        CopyAlignedUnit(reinterpret_cast<const unsigned char*>(s),
                        reinterpret_cast<unsigned char*>(d), n, static_cast<uint8_t>(dtypes & 0xFF),
                        static_cast<uint8_t>(dtypes >> 8), lane);
      }
    }
  }
}

// A task's unit as a lane resolved it: the unit (item -1: a copy unit, or past the last) and its
// index in its item.
struct TaskUnit {
  QuantUnit q;
  int64_t local = 0;
};

// Unit `lane` of the task of 32 units from `first` (nothing past total_units).
__device__ __forceinline__ TaskUnit ResolveTaskUnit(const CopyItem* items,
                                                    const int64_t* unit_begin, int n_items,
                                                    int64_t total_units, int64_t first, int lane) {
  TaskUnit r;
  const int64_t u = first + lane;
  if (u >= total_units) return r;
  const int lo = ItemOf(unit_begin, n_items, u);
  const CopyItem& it = items[lo];
  r.local = u - unit_begin[lo];
  if (it.op != static_cast<uint8_t>(CopyOp::kCopy)) {
    r.q.u = ResolveQuantizing(it, r.local);
    r.q.item = lo;
    r.q.twins = TwinMask(items, n_items, lo);
  }
  return r;
}

// The quantizing kernel: a thread block takes tasks of 32 consecutive units; each warp resolves
// the task's units (a lane each, the same in every warp). Units of rare shapes (fp16 and fp32
// sources, unaligned rows, blocks over 128 x 128) run first, one warp each in turn, the copy
// kernel's way; then the tiles, one after another, each staged while the one before it converts
// (StageTile, FinishTile; MXFP8's one-row blocks FinishRowsTile). Copy units are the copy
// kernel's; a kScale unit whose twin writes its scales does nothing. The grid is at most the blocks
// the GPU holds at once, each taking every gridDim.x-th task, so that no late wave of blocks runs
// alone. kMinBlocks: the thread blocks an SM holds that ptxas plans registers for (2: up to 128 a
// thread). kMx: built for MXFP8's one-row-block tiles (their straight-line path, FinishRowsTile's)
// rather than block fp8's (FinishTile's); either runs every unit, to the same bytes.
// Tasks are pipelined too: the next task's units are resolved (a chain of dependent item searches
// and loads) into this warp's `ahead` slots while the current task's first tile is in flight, and
// the next task's first tile is staged while the current task's last tile converts. Each task
// began with those searches and a tile load with nothing in flight.
template <int kMinBlocks, bool kMx>
__global__ void __launch_bounds__(kQuantThreads, kMinBlocks)
    QuantizeItemsKernel(const CopyItem* items, const int64_t* unit_begin, int n_items,
                        int64_t total_units, const uint32_t* gate, uint32_t go) {
  static_assert(kStages == 2, "one tile in flight: staged from the next task at a task's end");
  if (gate != nullptr && *reinterpret_cast<const volatile uint32_t*>(gate) != go) return;
  __shared__ float
      partial[2][kQuantWarps];  // by turns: a tile's reads end before the next but one writes
  __shared__ TaskUnit ahead[kQuantWarps][32];  // the next task's units, per warp, a lane each
  extern __shared__ uint4
      staged[];  // kStagedBytes: kStages tiles of kChunksPerThread * kQuantThreads
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int turn = 0, stage = 0;
  const int64_t tasks = (total_units + 31) / 32;
  if (static_cast<int64_t>(blockIdx.x) >= tasks) return;
  TaskUnit mine =
      ResolveTaskUnit(items, unit_begin, n_items, total_units, int64_t{blockIdx.x} * 32, lane);
  bool first_staged = false;  // the current task's first tile, staged at the last one's end
  for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {
    const bool runs = Runs(mine.q), tile_fits = TileFits(mine.q);
    const uint32_t others = __ballot_sync(0xFFFFFFFFu, runs && !tile_fits);
    // The task's tiles in lane order, one staged ahead of the one converting: `staging` holds the
    // lanes of the tiles not yet staged, `todo` those not yet converted.
    uint32_t todo = __ballot_sync(0xFFFFFFFFu, runs && tile_fits), staging = todo;
    if (first_staged) {
      staging &= staging - 1;
    } else if (todo != 0) {
      StageTile(ShflQuantUnit(mine.q, __ffs(staging) - 1),
                staged + stage * kChunksPerThread * kQuantThreads, items);
      staging &= staging - 1;
      CommitStaged();
    }
    // The next task's units while that tile loads (every lane reads `ahead` only after the
    // __syncwarp below, and the last reads of the previous task's slots were before this).
    const int64_t next = task + gridDim.x;
    const TaskUnit coming =
        next < tasks ? ResolveTaskUnit(items, unit_begin, n_items, total_units, next * 32, lane)
                     : TaskUnit{};
    __syncwarp();  // every lane's reads of the slots (the last task's end) before they change
    ahead[warp][lane] = coming;
    const uint32_t next_tiles =
        __ballot_sync(0xFFFFFFFFu, next < tasks && Runs(coming.q) && TileFits(coming.q));
    __syncwarp();
    for (uint32_t rest = others; rest != 0; rest &= rest - 1) {
      const int j = __ffs(rest) - 1;
      if (j % kQuantWarps != warp) continue;  // uniform across the warp
      const QuantUnit q = ShflQuantUnit(mine.q, j);
      QuantizeUnitWithTwins(q, items,
                            __shfl_sync(0xFFFFFFFFu, static_cast<long long>(mine.local), j), lane);
    }
    first_staged = false;
    while (todo != 0) {
      const int j = __ffs(todo) - 1;
      todo &= todo - 1;
      WaitStaged();
      uint4 v[kChunksPerThread];
#pragma unroll
      for (int i = 0; i < kChunksPerThread; ++i)
        v[i] = staged[(stage * kChunksPerThread + i) * kQuantThreads + threadIdx.x];
      // The other stage was read (and its values used) by the tile before: free to refill, with
      // this task's next tile or, at its last, the next task's first.
      uint4* other = staged + (stage ^ 1) * kChunksPerThread * kQuantThreads;
      if (staging != 0) {
        StageTile(ShflQuantUnit(mine.q, __ffs(staging) - 1), other, items);
        staging &= staging - 1;
      } else if (todo == 0 && next_tiles != 0) {
        StageTile(ahead[warp][__ffs(next_tiles) - 1].q, other, items);
        first_staged = true;
      }
      CommitStaged();
      const int64_t local = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(mine.local), j);
      const QuantUnit q = ShflQuantUnit(mine.q, j);
      if (RowsMode(q)) {  // the same unit in every thread: no barrier inside either branch
        FinishRowsTile<kMx>(q, items, local, v);
      } else {
        FinishTile<!kMx>(q, items, local, partial[turn], v);
        turn ^= 1;  // only tiles that use `partial` take turns: a rows tile has no barrier
      }
      stage ^= 1;
    }
    mine = ahead[warp][lane];  // from shared memory: `coming` held in registers would spill
  }
  // Groups committed past the last tile are empty.
}

}  // namespace

bool SpreadPays(const CopyWork& work) {
  int64_t bytes = 0;
  for (const CopyItem& it : work.items) {
    const int widest = std::max(DTypeSize(static_cast<DType>(it.src_dtype)),
                                DTypeSize(static_cast<DType>(it.dst_dtype)));
    bytes += it.inner * it.count[0] * it.count[1] * it.count[2] * widest;
  }
  const int64_t units = work.unit_begin.empty() ? 0 : work.unit_begin.back();
  return units > 0 && bytes / units >= 1024;
}

__global__ void NothingKernel() {}

__global__ void GateKernel(const uint32_t* host_word, uint32_t go, uint32_t* gate,
                           uint32_t* decided) {
  uint32_t word;
  // Acquire, system scope: the host's store, as the stream's wait saw it (not an older copy).
  asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(word) : "l"(host_word) : "memory");
  const uint32_t g = word == go ? go : 0u;
  *gate = g;
  if (decided != nullptr) *reinterpret_cast<volatile uint32_t*>(decided) = g;
}

// LaunchWaitingGate's kernel: GateKernel that waits for the word itself (no stream wait before
// it), reading it every `sleep_ns` (0: back to back). Reaching go or past it is
// cuStreamWaitValue32's GEQ, wrapping: the signed difference not negative.
__global__ void WaitingGateKernel(const uint32_t* host_word, uint32_t go, uint32_t* gate,
                                  uint32_t* decided, unsigned sleep_ns) {
  uint32_t word;
  while (true) {
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(word) : "l"(host_word) : "memory");
    if (static_cast<int32_t>(word - go) >= 0) break;
    if (sleep_ns > 0) __nanosleep(sleep_ns);
  }
  const uint32_t g = word == go ? go : 0u;
  *gate = g;
  if (decided != nullptr) *reinterpret_cast<volatile uint32_t*>(decided) = g;
}

cudaError_t LaunchWaitingGate(const uint32_t* host_word, uint32_t go, uint32_t* gate,
                              uint32_t* decided, unsigned sleep_ns, cudaStream_t stream) {
  WaitingGateKernel<<<1, 1, 0, stream>>>(host_word, go, gate, decided, sleep_ns);
  return cudaGetLastError();
}

cudaError_t LoadKernels() {
  cudaFuncAttributes attributes;
  for (const void* f :
       {reinterpret_cast<const void*>(NothingKernel), reinterpret_cast<const void*>(GateKernel),
        reinterpret_cast<const void*>(CopyItemsKernel<true, true>),
        reinterpret_cast<const void*>(CopyItemsKernel<false, true>),
        reinterpret_cast<const void*>(CopyItemsKernel<true, false>),
        reinterpret_cast<const void*>(CopyItemsKernel<false, false>),
        reinterpret_cast<const void*>(QuantizeItemsKernel<2, false>),
        reinterpret_cast<const void*>(QuantizeItemsKernel<3, false>),
        reinterpret_cast<const void*>(QuantizeItemsKernel<2, true>),
        reinterpret_cast<const void*>(QuantizeItemsKernel<3, true>)}) {
    if (const cudaError_t e = cudaFuncGetAttributes(&attributes, f); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// Every finite fp32 pattern through E4M3x2 (both halves) against the port of FloatToE4M3.
__global__ void E4M3CheckKernel(unsigned long long* mismatches, uint32_t* first) {
  const uint64_t threads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t b = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       b <= 0xFFFFFFFFull; b += threads) {
    const uint32_t u = static_cast<uint32_t>(b);
    if ((u & 0x7F800000u) == 0x7F800000u) continue;
    const float v = __uint_as_float(u);
    const uint32_t want = FloatToE4M3(v);
    const uint32_t got_lo = E4M3x2(v, 1.0f) & 0xFF, got_hi = E4M3x2(1.0f, v) >> 8;
    if (got_lo != want || got_hi != want) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first, u);
    }
  }
}

cudaError_t CheckE4M3Conversion(unsigned long long* mismatches, uint32_t* first,
                                cudaStream_t stream) {
  E4M3CheckKernel<<<4096, 256, 0, stream>>>(mismatches, first);
  return cudaGetLastError();
}

// Weight-like bf16 values for the benchmarks: random signs and mantissas, exponents in [-14, -5].
__global__ void FillBf16WeightsKernel(uint32_t* words, size_t n, uint64_t seed) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    auto bf16 = [](uint32_t r) {
      return (r & 0x8000u) | ((127u - 14u + (r >> 8) % 10u) << 7) | (r & 0x7Fu);
    };
    words[i] = bf16(static_cast<uint32_t>(h)) | (bf16(static_cast<uint32_t>(h >> 32)) << 16);
  }
}

cudaError_t FillBf16Weights(void* p, size_t bytes, uint64_t seed, cudaStream_t stream) {
  if (bytes / 4 == 0) return cudaSuccess;
  FillBf16WeightsKernel<<<4096, 256, 0, stream>>>(static_cast<uint32_t*>(p), bytes / 4, seed);
  return cudaGetLastError();
}

cudaError_t LaunchNothing(cudaStream_t stream) {
  NothingKernel<<<1, 1, 0, stream>>>();
  return cudaGetLastError();
}

cudaError_t LaunchCopyItems(const CopyItem* items, const int64_t* unit_begin, int n_items,
                            int64_t total_units, cudaStream_t stream, bool spread,
                            bool aligned_only, const uint32_t* gate, uint32_t go,
                            QuantizingUnits quantizing) {
  return LaunchCopyItemsShaped(items, unit_begin, n_items, total_units, stream, spread,
                               aligned_only, DefaultCopyLaunchShape(aligned_only), gate, go,
                               quantizing);
}

bool HasQuantizing(const CopyWork& work) {
  return std::any_of(work.items.begin(), work.items.end(),
                     [](const CopyItem& it) { return it.Quantizes(); });
}

QuantizingUnits QuantizingUnitsOf(const CopyWork& work) {
  // The kernel built for the tiles that carry most of the quantized elements (kQuantize items':
  // a kScale item's region is its twin's).
  bool quantizes = false;
  int64_t mx = 0, other = 0;
  for (const CopyItem& it : work.items) {
    quantizes |= it.Quantizes();
    if (it.op == static_cast<uint8_t>(CopyOp::kQuantize))
      (it.Mxfp8Rows() ? mx : other) += it.Rows() * it.inner;
  }
  if (!quantizes) return QuantizingUnits::kNone;
  return mx > other ? QuantizingUnits::kInMxQuantizingKernel : QuantizingUnits::kInQuantizingKernel;
}

bool InQuantizingKernel(QuantizingUnits quantizing) {
  return quantizing == QuantizingUnits::kInQuantizingKernel ||
         quantizing == QuantizingUnits::kInMxQuantizingKernel;
}

CopyLaunchShape DefaultCopyLaunchShape(bool aligned_only) {
  CopyLaunchShape shape;
  // The aligned kernel's units are long runs (segments up to 16 KiB): batches of 8 end the warps'
  // work evenly, where batches of 21 (a 1 GB model's 174k units) left the last wave's warps
  // copying 120 KB each. One H200, local_copy_bench, same call: 1 GB 0.5229 ->
  // 0.5098 ms, a 1 GB Qwen2.5-0.5B 0.5302 -> 0.5164, 16 GB 7.997 -> 7.968; the general kernel's
  // tiles of short runs want the lanes' resolving spread wide (many-small-moe 2.07 -> 2.09 ms at
  // 8, 2.25 at 1): 32 there.
  if (aligned_only) shape.max_batch = 8;
  return shape;
}

cudaError_t LaunchCopyItemsShaped(const CopyItem* items, const int64_t* unit_begin, int n_items,
                                  int64_t total_units, cudaStream_t stream, bool spread,
                                  bool aligned_only, const CopyLaunchShape& shape,
                                  const uint32_t* gate, uint32_t go,
                                  QuantizingUnits quantizing_units) {
  if (n_items == 0 || total_units == 0) return cudaSuccess;
  const bool quantizing = InQuantizingKernel(quantizing_units);
  // Without quantizing code: beside the quantizing kernel, or where no unit quantizes.
  const bool plain = quantizing || quantizing_units == QuantizingUnits::kNone;
  constexpr int kThreads = 256;  // 8 warps
  // Units per batch: 1 while there are fewer units than warps to fill the GPU (large runs keep
  // every warp busy), up to max_batch (32: a lane per unit) for tens of thousands of small ones.
  const int batch =
      static_cast<int>(std::clamp<int64_t>(total_units / std::max<int64_t>(shape.warps_to_fill, 1),
                                           1, std::clamp(shape.max_batch, 1, 32)));
  const int64_t batches = (total_units + batch - 1) / batch;
  const int64_t wanted = (batches + 7) / 8;
  const int blocks = static_cast<int>(std::min<int64_t>(wanted, std::max(shape.max_blocks, 1)));
  auto copy = !aligned_only
                  ? (plain ? CopyItemsKernel<true, false> : CopyItemsKernel<true, true>)
                  : (plain ? CopyItemsKernel<false, false> : CopyItemsKernel<false, true>);
  copy<<<blocks, kThreads, 0, stream>>>(items, unit_begin, n_items, total_units, batch, spread,
                                        quantizing, gate, go);
  if (quantizing) {
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    const bool three = shape.quant_min_blocks == 3;
    const bool mx = quantizing_units == QuantizingUnits::kInMxQuantizingKernel;
    auto* const quantize =
        three ? (mx ? QuantizeItemsKernel<3, true> : QuantizeItemsKernel<3, false>)
              : (mx ? QuantizeItemsKernel<2, true> : QuantizeItemsKernel<2, false>);
    const void* kernel = reinterpret_cast<const void*>(quantize);
    int device = 0, sms = 0, per_sm = 0;
    if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        e != cudaSuccess)
      return e;
    if (const cudaError_t e =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStagedBytes);
        e != cudaSuccess) {
      return e;
    }
    if (const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &per_sm, kernel, kQuantThreads, kStagedBytes);
        e != cudaSuccess) {
      return e;
    }
    const int64_t tasks = (total_units + 31) / 32;
    const int quant_blocks =
        static_cast<int>(std::min({tasks, static_cast<int64_t>(std::max(shape.max_blocks, 1)),
                                   std::max<int64_t>(int64_t{sms} * per_sm, 1)}));
    quantize<<<quant_blocks, kQuantThreads, kStagedBytes, stream>>>(items, unit_begin, n_items,
                                                                    total_units, gate, go);
  }
  return cudaGetLastError();
}

cudaError_t LaunchGate(const uint32_t* host_word, uint32_t go, uint32_t* gate, uint32_t* decided,
                       cudaStream_t stream) {
  GateKernel<<<1, 1, 0, stream>>>(host_word, go, gate, decided);
  return cudaGetLastError();
}

}  // namespace refit
