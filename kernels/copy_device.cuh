// The copy kernels' device code: element access, spans (one contiguous run) and tiles (a stretch
// of an item's [rows, inner] index space, crossing rows), and the unit a thread group resolves.
// Part of copy_kernels.cu's one translation unit, included there only: nvcc compiles the kernels
// whole, without relocatable device code, so that they inline these device functions.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/copy_kernels.h"
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

}  // namespace
}  // namespace refit
