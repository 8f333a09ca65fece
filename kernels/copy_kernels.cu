#include "kernels/copy_kernels.h"

#include <cuda_fp16.h>

#include <algorithm>

#include "plan/dtype.h"

namespace refit {
namespace {

// Element bits from any address (staging may sit at any byte offset).
__device__ __forceinline__ uint32_t LoadBits(const unsigned char* p, int size) {
  if ((reinterpret_cast<uint64_t>(p) & (size - 1)) == 0) {
    return size == 2 ? *reinterpret_cast<const uint16_t*>(p) : *reinterpret_cast<const uint32_t*>(p);
  }
  uint32_t u = 0;
  for (int i = 0; i < size; ++i) u |= static_cast<uint32_t>(p[i]) << (8 * i);
  return u;
}

__device__ __forceinline__ void StoreBits(uint32_t u, unsigned char* p, int size) {
  if ((reinterpret_cast<uint64_t>(p) & (size - 1)) == 0) {
    if (size == 2) *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(u);
    else *reinterpret_cast<uint32_t*>(p) = u;
    return;
  }
  for (int i = 0; i < size; ++i) p[i] = static_cast<unsigned char>(u >> (8 * i));
}

__device__ __forceinline__ float BitsToFloat(uint32_t u, uint8_t dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::kBF16: return __uint_as_float(u << 16);
    case DType::kF16: return __half2float(__ushort_as_half(static_cast<unsigned short>(u)));
    default: return __uint_as_float(u);
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
    case DType::kF16: return __half_as_ushort(__float2half_rn(v));
    default: return __float_as_uint(v);
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
      in[0] = a.x, in[1] = a.y, in[2] = a.z, in[3] = a.w, in[4] = b.x, in[5] = b.y, in[6] = b.z, in[7] = b.w;
    }
    for (int i = 0; i < 8; ++i) out[i] = FloatToBits(BitsToFloat(in[i], sdt), ddt);
    uint4* d4 = reinterpret_cast<uint4*>(d + chunk * 8 * ds);
    if (ds == 2) {
      d4[0] = make_uint4(out[0] | (out[1] << 16), out[2] | (out[3] << 16), out[4] | (out[5] << 16), out[6] | (out[7] << 16));
    } else {
      d4[0] = make_uint4(out[0], out[1], out[2], out[3]);
      d4[1] = make_uint4(out[4], out[5], out[6], out[7]);
    }
  }
}

__device__ __forceinline__ int Size(uint8_t dtype) {
  const DType d = static_cast<DType>(dtype);
  return d == DType::kBF16 || d == DType::kF16 ? 2 : d == DType::kF32 || d == DType::kI32 ? 4
         : d == DType::kI64 ? 8 : 1;
}

// Accesses of B bytes: the register type, and its 32-bit words (B < 4: one, zero-extended).
template <int B> struct Access;
template <> struct Access<16> { using T = uint4; };
template <> struct Access<8> { using T = uint2; };
template <> struct Access<4> { using T = uint32_t; };
template <> struct Access<2> { using T = uint16_t; };
template <> struct Access<1> { using T = uint8_t; };

template <int B>
__device__ __forceinline__ void ToWords(const typename Access<B>::T& v, uint32_t* w) {
  if constexpr (B == 16) w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  else if constexpr (B == 8) w[0] = v.x, w[1] = v.y;
  else w[0] = v;
}

template <int B>
__device__ __forceinline__ typename Access<B>::T FromWords(const uint32_t* w) {
  if constexpr (B == 16) return make_uint4(w[0], w[1], w[2], w[3]);
  else if constexpr (B == 8) return make_uint2(w[0], w[1]);
  else return static_cast<typename Access<B>::T>(w[0]);
}

// Element i (of S bytes, 2 or 4) of words w, and back.
template <int S>
__device__ __forceinline__ uint32_t Element(const uint32_t* w, int i) {
  if constexpr (S == 4) return w[i];
  else return (w[i / 2] >> (16 * (i & 1))) & 0xFFFFu;
}

template <int S>
__device__ __forceinline__ void SetElement(uint32_t* w, int i, uint32_t bits) {
  if constexpr (S == 4) w[i] = bits;
  else if (i & 1) w[i / 2] |= bits << 16;
  else w[i / 2] = bits;
}

// ---- Spans: one contiguous run (or a segment of one). ----

// Aligned 16-byte copy of n vectors: four loads in flight per lane before their stores. One at
// a time (the compiler cannot move a load above the previous store, which might alias it) kept a
// colocated 16 GB refit at 0.34 of the copy engine (issue 17).
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
__device__ __noinline__ void WarpCopyShifted(const uint4* base, uint4* d4, int64_t n, int r, int lane) {
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
__device__ __forceinline__ void WarpCopyBytes(const unsigned char* s, unsigned char* d, int64_t bytes, int lane) {
  if (((reinterpret_cast<uint64_t>(s) | reinterpret_cast<uint64_t>(d) | static_cast<uint64_t>(bytes)) & 15) == 0) {
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
      if (k == 0) WarpCopy16(base, d4, body / 16, lane);
      else WarpCopyShifted<0>(base, d4, body / 16, r, lane);
      break;
    case 1: WarpCopyShifted<1>(base, d4, body / 16, r, lane); break;
    case 2: WarpCopyShifted<2>(base, d4, body / 16, r, lane); break;
    default: WarpCopyShifted<3>(base, d4, body / 16, r, lane); break;
  }
}

// ---- Tiles: a stretch of an item's [rows, inner] index space, crossing rows. ----

// Where a tile's accesses go. Positions count accesses (of `vector` bytes or elements, see
// CopyItem::vector): a row has inner_v of them. Row r of the item is run (a, b, c) of its loops.
struct TileView {
  const unsigned char* s;
  unsigned char* d;
  int64_t sst[3], dst[3];  // bytes between runs of each loop
  int64_t c1, c2;          // count[1], count[2]
  bool flat;               // count[0] = count[1] = 1: row r at r * stride[2]
  uint32_t inner_v;
  int sg;  // bytes per access at the source

  __device__ __forceinline__ int64_t SourceOffset(uint64_t row) const {
    if (flat) return static_cast<int64_t>(row) * sst[2];
    int64_t so, dof;
    RowOffsets(row, so, dof);
    return so;
  }
  __device__ __forceinline__ int64_t DestinationOffset(uint64_t row) const {
    if (flat) return static_cast<int64_t>(row) * dst[2];
    int64_t so, dof;
    RowOffsets(row, so, dof);
    return dof;
  }

  // Byte offsets of row `row` at both ends. Several loops (3-D and 4-D tensors): divisions per
  // access, rare enough; 32-bit when they fit.
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
  __device__ __forceinline__ TileWalk(uint64_t row0, uint32_t col0, uint32_t inner, int lane) : inner_v(inner) {
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
template <int V, int K>
__device__ __noinline__ void TileCopy(const TileView t, uint64_t row0, uint32_t col0, int64_t nv, int lane) {
  using T = typename Access<V>::T;
  TileWalk w(row0, col0, t.inner_v, lane);
  for (int64_t i = lane; i < nv; i += 32 * K) {
    T r[K];
    // The stores walk the same positions again from here: recomputing an offset costs less
    // than K destination pointers held in registers (occupancy).
    const TileWalk at = w;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (i + 32 * k < nv) r[k] = *reinterpret_cast<const T*>(t.s + t.SourceOffset(w.row) + static_cast<int64_t>(w.col) * V);
      w.Next();
    }
    w = at;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (i + 32 * k < nv) *reinterpret_cast<T*>(t.d + t.DestinationOffset(w.row) + static_cast<int64_t>(w.col) * V) = r[k];
      w.Next();
    }
  }
}

// Converting: nv accesses of E elements (E * SS bytes read, E * DS written).
template <int SS, int DS, int E, int K>
__device__ __noinline__ void TileConvert(const TileView t, uint64_t row0, uint32_t col0, int64_t nv, uint8_t sdt,
                                            uint8_t ddt, int lane) {
  using TS = typename Access<E * SS>::T;
  using TD = typename Access<E * DS>::T;
  TileWalk w(row0, col0, t.inner_v, lane);
  for (int64_t i = lane; i < nv; i += 32 * K) {
    TS r[K];
    const TileWalk at = w;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (i + 32 * k < nv) {
        r[k] = *reinterpret_cast<const TS*>(t.s + t.SourceOffset(w.row) + static_cast<int64_t>(w.col) * (E * SS));
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
        for (int e = 0; e < E; ++e) SetElement<DS>(out, e, FloatToBits(BitsToFloat(Element<SS>(in, e), sdt), ddt));
        *reinterpret_cast<TD*>(t.d + t.DestinationOffset(w.row) + static_cast<int64_t>(w.col) * (E * DS)) =
            FromWords<E * DS>(out);
      }
      w.Next();
    }
  }
}

// Converting at addresses that are not multiples of the element size: element by element, bytes.
__device__ __noinline__ void TileConvertBytes(const TileView t, uint64_t row0, uint32_t col0, int64_t nv, uint8_t sdt,
                                                 uint8_t ddt, int lane) {
  const int ss = Size(sdt), ds = Size(ddt);
  TileWalk w(row0, col0, t.inner_v, lane);
  for (int64_t i = lane; i < nv; i += 32) {
    const uint32_t bits = LoadBits(t.s + t.SourceOffset(w.row) + static_cast<int64_t>(w.col) * ss, ss);
    StoreBits(FloatToBits(BitsToFloat(bits, sdt), ddt), t.d + t.DestinationOffset(w.row) + static_cast<int64_t>(w.col) * ds, ds);
    w.Next();
  }
}

template <int SS, int DS>
__device__ __forceinline__ void TileConvertE(const TileView t, uint64_t row0, uint32_t col0, int64_t nv, int e,
                                             uint8_t sdt, uint8_t ddt, int lane) {
  constexpr int kMaxE = 16 / (SS > DS ? SS : DS);
  if (e >= 8 && kMaxE >= 8) TileConvert<SS, DS, (kMaxE >= 8 ? 8 : 1), 4>(t, row0, col0, nv, sdt, ddt, lane);
  else if (e >= 4) TileConvert<SS, DS, 4, 4>(t, row0, col0, nv, sdt, ddt, lane);
  else if (e == 2) TileConvert<SS, DS, 2, 8>(t, row0, col0, nv, sdt, ddt, lane);
  else TileConvert<SS, DS, 1, 8>(t, row0, col0, nv, sdt, ddt, lane);
}

// e elements per access (0: bytes, at any address; CutIntoUnits sets 0 for pairs other than these).
__device__ __forceinline__ void ConvertTile(const TileView t, uint64_t row0, uint32_t col0, int64_t nv, int e,
                                            uint8_t sdt, uint8_t ddt, int lane) {
  const int ss = Size(sdt), ds = Size(ddt);
  if (e == 0) TileConvertBytes(t, row0, col0, nv, sdt, ddt, lane);
  else if (ss == 2 && ds == 4) TileConvertE<2, 4>(t, row0, col0, nv, e, sdt, ddt, lane);
  else if (ss == 4 && ds == 2) TileConvertE<4, 2>(t, row0, col0, nv, e, sdt, ddt, lane);
  else TileConvertE<2, 2>(t, row0, col0, nv, e, sdt, ddt, lane);
}

// Bytes per access at the source end of a tiled item, and the item's view.
__device__ __forceinline__ int SourceGrain(const CopyItem& it) {
  const int ss = Size(it.src_dtype);
  if (it.src_dtype == it.dst_dtype) return it.vector;
  return it.vector == 0 ? ss : it.vector * ss;
}

__device__ __forceinline__ TileView ViewOf(const CopyItem& it) {
  TileView t;
  const int ss = Size(it.src_dtype), ds = Size(it.dst_dtype);
  t.s = reinterpret_cast<const unsigned char*>(it.src);
  t.d = reinterpret_cast<unsigned char*>(it.dst);
  for (int k = 0; k < 3; ++k) t.sst[k] = it.src_stride[k] * ss, t.dst[k] = it.dst_stride[k] * ds;
  t.c1 = it.count[1];
  t.c2 = it.count[2];
  t.flat = it.count[0] == 1 && it.count[1] == 1;
  t.sg = SourceGrain(it);
  t.inner_v = static_cast<uint32_t>(it.inner * ss / t.sg);
  return t;
}

// A warp runs nv accesses of a tiled item from position (row0, col0).
__device__ __forceinline__ void CopyTile(const CopyItem& it, uint64_t row0, uint32_t col0, int64_t nv, int lane) {
  const TileView t = ViewOf(it);
  const uint8_t sdt = it.src_dtype, ddt = it.dst_dtype;
  if (sdt == ddt) {
    switch (t.sg) {
      case 16: TileCopy<16, 4>(t, row0, col0, nv, lane); return;
      case 8: TileCopy<8, 8>(t, row0, col0, nv, lane); return;
      case 4: TileCopy<4, 8>(t, row0, col0, nv, lane); return;
      case 2: TileCopy<2, 8>(t, row0, col0, nv, lane); return;
      default: TileCopy<1, 8>(t, row0, col0, nv, lane); return;
    }
  }
  ConvertTile(t, row0, col0, nv, it.vector, sdt, ddt, lane);
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
__device__ __forceinline__ uint8_t Mxfp8ScaleCode(float amax) {
  if (amax == 0.0f) return 127;
  const uint32_t u = __float_as_uint(amax) & 0x7FFFFFFFu;
  const int floor_log2 = (u >> 23) != 0 ? static_cast<int>(u >> 23) - 127 : (31 - __clz(u)) - 149;
  const int shared_exp = max(floor_log2 - 8, -127);
  return static_cast<uint8_t>(shared_exp + 127);
}

// E8M0ToFloat for the codes Mxfp8ScaleCode makes (0..254): 2^(code - 127), 2^-127 a subnormal.
__device__ __forceinline__ float E8M0ToFloat(uint8_t code) {
  return code == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(static_cast<uint32_t>(code) << 23);
}

// Whether element bits of a float dtype (bf16, fp16, fp32) are a NaN; SignBit: their sign as e4m3's.
__device__ __forceinline__ bool IsNanBits(uint32_t u, uint8_t dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::kBF16: return (u & 0x7FFFu) > 0x7F80u;
    case DType::kF16: return (u & 0x7FFFu) > 0x7C00u;
    default: return (u & 0x7FFFFFFFu) > 0x7F800000u;
  }
}

__device__ __forceinline__ uint8_t SignBit(uint32_t u, int size) { return (u >> (8 * size - 1)) & 1 ? 0x80 : 0; }

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

// The top bit of a quantizing unit's format byte: its nr rows are nr blocks of one row (MXFP8),
// not one block (Resolve, kMxfp8RowsPerUnit).
constexpr uint8_t kRowsMode = 0x80;

// A warp quantizes one block of nr x nc elements at s (rows ss elements apart): the max of |x|
// over its finite elements, reduced across the lanes (max is exact and order-free), the block's
// scale, then kQuantize: the codes e4m3(x / scale) at d (rows ds bytes apart), a NaN encoded from
// its own bits (sign kept), not divided; kScale: the scale at d (fp32 bits, or an e8m0 byte).
__device__ __forceinline__ void QuantizeOneBlock(const unsigned char* s, unsigned char* d, int nr, int nc, int64_t ss,
                                                 int64_t ds, uint8_t sdt, uint8_t op, uint8_t format, int lane) {
  const int size = Size(sdt);
  // bf16 blocks of whole 16-byte rows (128 x 128 blocks of row-major weights): 8 elements per
  // 16-byte load and 8 codes per 8-byte store, four loads in flight per lane. 2-byte loads one at
  // a time made a 16 GB bf16 -> fp8 refit 4x slower than the bf16 copy (issue 17).
  const bool vector = sdt == static_cast<uint8_t>(DType::kBF16) && nc % 8 == 0 &&
                      ((reinterpret_cast<uint64_t>(s) | static_cast<uint64_t>(ss * 2)) & 15) == 0 &&
                      (op != static_cast<uint8_t>(CopyOp::kQuantize) ||
                       ((reinterpret_cast<uint64_t>(d) | static_cast<uint64_t>(ds)) & 7) == 0);
  const int chunks_per_row = nc / 8, chunks = nr * chunks_per_row;
  auto chunk_at = [&](int k) {
    return reinterpret_cast<const uint4*>(s + (static_cast<int64_t>(k / chunks_per_row) * ss + (k % chunks_per_row) * 8) * 2);
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
      if (mx) *d = code;
      else StoreBits(__float_as_uint(scale), d, 4);
    }
    return;
  }
  if (vector) {
    for (int k = lane; k < chunks; k += 32) {
      *reinterpret_cast<uint2*>(d + static_cast<int64_t>(k / chunks_per_row) * ds + (k % chunks_per_row) * 8) =
          Bf16ChunkCodes(*chunk_at(k), scale);
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

// MXFP8, rows mode: nr (at most 8) blocks of one row of nc (at most 32) elements, rows ss
// elements apart, each scaled on its own. bf16 rows of whole 16-byte chunks: four lanes a block,
// a chunk each: the max over the block's lanes (xor 1, 2), its e8m0 code, then each lane's 8
// codes (kQuantize: rows ds bytes apart) or the block's code by its first lane (kScale: rows ds
// codes apart). Other rows: one block after another, as QuantizeOneBlock does them.
__device__ __forceinline__ void QuantizeRows(const unsigned char* s, unsigned char* d, int nr, int nc, int64_t ss,
                                             int64_t ds, uint8_t sdt, uint8_t op, uint8_t format, int lane) {
  const bool quantize = op == static_cast<uint8_t>(CopyOp::kQuantize);
  const bool vector = sdt == static_cast<uint8_t>(DType::kBF16) && nc % 8 == 0 && nc <= 32 && nr <= 8 &&
                      ((reinterpret_cast<uint64_t>(s) | static_cast<uint64_t>(ss * 2)) & 15) == 0 &&
                      (!quantize || ((reinterpret_cast<uint64_t>(d) | static_cast<uint64_t>(ds)) & 7) == 0);
  if (!vector) {
    const int size = Size(sdt);
    for (int r = 0; r < nr; ++r) QuantizeOneBlock(s + r * ss * size, d + r * ds, 1, nc, ss, ds, sdt, op, format, lane);
    return;
  }
  const int row = lane >> 2, chunk = lane & 3;
  const bool on = row < nr && chunk < nc / 8;
  uint4 v = make_uint4(0, 0, 0, 0);
  if (on) v = *reinterpret_cast<const uint4*>(s + (static_cast<int64_t>(row) * ss + chunk * 8) * 2);
  float amax = Bf16ChunkAmax(v, 0.0f);
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
  const uint8_t code = Mxfp8ScaleCode(amax);
  if (!quantize) {
    if (on && chunk == 0) d[row * ds] = code;
    return;
  }
  if (on) *reinterpret_cast<uint2*>(d + row * ds + chunk * 8) = Bf16ChunkCodes(v, E8M0ToFloat(code));
}

__device__ __forceinline__ void QuantizeBlock(const unsigned char* s, unsigned char* d, int nr, int nc, int64_t ss,
                                              int64_t ds, uint8_t sdt, uint8_t op, uint8_t format, int lane) {
  if (format & kRowsMode) {
    QuantizeRows(s, d, nr, nc, ss, ds, sdt, op, static_cast<uint8_t>(format & ~kRowsMode), lane);
  } else {
    QuantizeOneBlock(s, d, nr, nc, ss, ds, sdt, op, format, lane);
  }
}

// The general kernel calls it (its own registers: inlined there, with tiles, it spilled); the
// aligned kernel inlines it, as before tiles (no spills: a 16 GB bf16 -> fp8 refit 27.7 ms,
// against 35.3 through the call).
__device__ __noinline__ void QuantizeUnit(const unsigned char* s, unsigned char* d, int nr, int nc, int64_t ss,
                                          int64_t ds, uint8_t sdt, uint8_t op, uint8_t format, int lane) {
  QuantizeBlock(s, d, nr, nc, ss, ds, sdt, op, format, lane);
}

template <bool kTiles>
__device__ __forceinline__ Unit Resolve(const CopyItem* items, const int64_t* unit_begin, int n_items, int64_t u) {
  int lo = 0, hi = n_items - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (unit_begin[mid] <= u) lo = mid; else hi = mid - 1;
  }
  const CopyItem& it = items[lo];
  const int64_t local = u - unit_begin[lo];
  if (it.op != static_cast<uint8_t>(CopyOp::kCopy)) {
    // Block (bi, bj) of the region, or (MXFP8, one-row blocks) kMxfp8RowsPerUnit blocks down
    // from block (bi * kMxfp8RowsPerUnit, bj), each scaled on its own (QuantizeBlock's rows mode).
    const bool rows = it.quant_format == kCopyItemMxfp8 && it.block_rows == 1;
    const int64_t g = rows ? kMxfp8RowsPerUnit : it.block_rows;
    const int64_t bi = local / it.segments, bj = local % it.segments;
    const int64_t r0 = bi * g, c0 = bj * it.block_cols;
    const int64_t nr = min(g, it.count[2] - r0);
    const int64_t nc = min(static_cast<int64_t>(it.block_cols), it.inner - c0);
    Unit unit;
    unit.n = nr << 32 | nc;
    unit.s = it.src + (r0 * it.src_stride[2] + c0) * Size(it.src_dtype);
    unit.d = it.op == static_cast<uint8_t>(CopyOp::kQuantize)
                 ? it.dst + r0 * it.dst_stride[2] + c0
                 : it.dst + (r0 / it.block_rows * it.dst_stride[2] + bj) * Size(it.dst_dtype);
    unit.ss = it.src_stride[2];
    unit.ds = it.dst_stride[2];
    unit.dtypes = it.src_dtype | (static_cast<uint32_t>(it.dst_dtype) << 8) | (static_cast<uint32_t>(it.op) << 16) |
                  (static_cast<uint32_t>(it.quant_format | (rows ? kRowsMode : 0)) << 24);
    return unit;
  }
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
  unit.s = it.src + (a * it.src_stride[0] + b * it.src_stride[1] + c * it.src_stride[2] + first) * ss;
  unit.d = it.dst + (a * it.dst_stride[0] + b * it.dst_stride[1] + c * it.dst_stride[2] + first) * ds;
  unit.dtypes = it.src_dtype | (static_cast<uint32_t>(it.dst_dtype) << 8);
  return unit;
}

// A warp copies one run (or a segment of one) of n elements.
__device__ __forceinline__ void CopyUnit(const unsigned char* s, unsigned char* d, int64_t n, uint8_t sdt, uint8_t ddt,
                                         int lane) {
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
  TileView t;
  t.s = s;
  t.d = d;
  for (int k = 0; k < 3; ++k) t.sst[k] = t.dst[k] = 0;
  t.c1 = t.c2 = 1;
  t.flat = true;
  const bool pair = (ss == 2 || ss == 4) && (ds == 2 || ds == 4);
  int e = 0;
  if (pair && sa % ss == 0 && da % ds == 0) {
    e = 16 / max(ss, ds);
    while (e > 1 && ((sa / ss) % e != 0 || (da / ds) % e != 0 || n % e != 0)) e /= 2;
  }
  t.sg = e == 0 ? ss : e * ss;
  const int64_t nv = e == 0 ? n : n / e;
  t.inner_v = static_cast<uint32_t>(min(nv, static_cast<int64_t>(0x7FFFFFFF)));  // a segment: far below
  ConvertTile(t, 0, 0, nv, e, sdt, ddt, lane);
}

// A unit of the aligned kernel: both ends 16-byte aligned, n a multiple of 16 bytes (same dtype)
// or of 8 elements (converting), as AlignedOnly checked on the host.
__device__ __forceinline__ void CopyAlignedUnit(const unsigned char* s, unsigned char* d, int64_t n, uint8_t sdt,
                                                uint8_t ddt, int lane) {
  const int ss = Size(sdt), ds = Size(ddt);
  if (sdt == ddt) WarpCopy16Inline(reinterpret_cast<const uint4*>(s), reinterpret_cast<uint4*>(d), n * ss / 16, lane);
  else WarpConvertVector(s, d, n, sdt, ddt, ss, ds, lane);
}

// Each warp takes batches of `batch` consecutive units in turn. Its first `batch` lanes resolve
// one unit each at once (the item searches and loads overlap instead of running one after another
// per unit), then the whole warp copies them one by one. Tens of thousands of 2-8 KB units then
// need fewer, shorter-lived blocks: beside NCCL's kernels, the 99k-tensor refit on 2 x H200 ran
// 2.2x faster (docs/BENCHMARKS.md, session 10).
// 80 registers a thread (3 blocks of 256 an SM), as before tiles. Every access loop is a
// separate __noinline__ function so that each is allocated on its own: inlined together (tiles
// of five widths, casts, shifted spans, fp8 blocks) ptxas gave the kernel 210 registers, or
// kilobytes of spills under this bound. A call per unit costs a few callee-saved registers.
// kTiles: the general kernel (tiles, unaligned spans, every access width); without, the aligned
// kernel: every copy unit 16-byte aligned at both ends (AlignedOnly), so its copies are the
// 16-byte loop and the vector conversion, inlined with the fp8 blocks into 80 registers without
// spills, as before tiles existed (the general kernel spills a few hundred bytes per thread and
// calls its loops: the 16 GB aligned refit 8.34 -> 8.77 ms, bf16 -> fp8 27.7 -> 35.3 ms through it).
template <bool kTiles>
__global__ void __launch_bounds__(256, 3) CopyItemsKernel(const CopyItem* items, const int64_t* unit_begin, int n_items,
                                int64_t total_units, int batch, bool spread, const uint32_t* gate, uint32_t go) {
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
    const int count = static_cast<int>(min(static_cast<int64_t>(batch), (total_units - 1 - first) / step + 1));
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
      if (((dtypes >> 16) & 0xFF) != 0) {  // a quantizing unit (op != kCopy): one block, this warp alone
        const int64_t ss = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(mine.ss), j);
        const int64_t ds = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(mine.ds), j);
        if constexpr (kTiles) {
          QuantizeUnit(reinterpret_cast<const unsigned char*>(s), reinterpret_cast<unsigned char*>(d),
                     static_cast<int>(n >> 32), static_cast<int>(n & 0xFFFFFFFF), ss, ds,
                     static_cast<uint8_t>(dtypes & 0xFF), static_cast<uint8_t>((dtypes >> 16) & 0xFF),
                     static_cast<uint8_t>(dtypes >> 24), lane);
        } else {
          QuantizeBlock(reinterpret_cast<const unsigned char*>(s), reinterpret_cast<unsigned char*>(d),
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
        CopyAlignedUnit(reinterpret_cast<const unsigned char*>(s), reinterpret_cast<unsigned char*>(d), n,
                        static_cast<uint8_t>(dtypes & 0xFF), static_cast<uint8_t>(dtypes >> 8), lane);
      }
    }
  }
}

}  // namespace

bool SpreadPays(const CopyWork& work) {
  int64_t bytes = 0;
  for (const CopyItem& it : work.items) {
    const int widest = std::max(DTypeSize(static_cast<DType>(it.src_dtype)), DTypeSize(static_cast<DType>(it.dst_dtype)));
    bytes += it.inner * it.count[0] * it.count[1] * it.count[2] * widest;
  }
  const int64_t units = work.unit_begin.empty() ? 0 : work.unit_begin.back();
  return units > 0 && bytes / units >= 1024;
}

__global__ void NothingKernel() {}

__global__ void GateKernel(const uint32_t* host_word, uint32_t go, uint32_t* gate, uint32_t* decided) {
  uint32_t word;
  // Acquire, system scope: the host's store, as the stream's wait saw it (not an older copy).
  asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(word) : "l"(host_word) : "memory");
  const uint32_t g = word == go ? go : 0u;
  *gate = g;
  if (decided != nullptr) *reinterpret_cast<volatile uint32_t*>(decided) = g;
}

// LaunchWaitingGate's kernel: GateKernel that waits for the word itself (no stream wait before
// it), reading it every `sleep_ns` (0: back to back). Reaching go or past it is cuStreamWaitValue32's
// GEQ, wrapping: the signed difference not negative.
__global__ void WaitingGateKernel(const uint32_t* host_word, uint32_t go, uint32_t* gate, uint32_t* decided,
                                  unsigned sleep_ns) {
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

cudaError_t LaunchWaitingGate(const uint32_t* host_word, uint32_t go, uint32_t* gate, uint32_t* decided,
                              unsigned sleep_ns, cudaStream_t stream) {
  WaitingGateKernel<<<1, 1, 0, stream>>>(host_word, go, gate, decided, sleep_ns);
  return cudaGetLastError();
}

cudaError_t LoadKernels() {
  cudaFuncAttributes attributes;
  for (const void* f : {reinterpret_cast<const void*>(NothingKernel), reinterpret_cast<const void*>(GateKernel),
                        reinterpret_cast<const void*>(CopyItemsKernel<true>),
                        reinterpret_cast<const void*>(CopyItemsKernel<false>)}) {
    if (const cudaError_t e = cudaFuncGetAttributes(&attributes, f); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t LaunchNothing(cudaStream_t stream) {
  NothingKernel<<<1, 1, 0, stream>>>();
  return cudaGetLastError();
}

cudaError_t LaunchCopyItems(const CopyItem* items, const int64_t* unit_begin, int n_items,
                            int64_t total_units, cudaStream_t stream, bool spread, bool aligned_only,
                            const uint32_t* gate, uint32_t go) {
  return LaunchCopyItemsShaped(items, unit_begin, n_items, total_units, stream, spread, aligned_only,
                               DefaultCopyLaunchShape(aligned_only), gate, go);
}

CopyLaunchShape DefaultCopyLaunchShape(bool aligned_only) {
  CopyLaunchShape shape;
  // The aligned kernel's units are long runs (segments up to 16 KiB): batches of 8 end the warps'
  // work evenly, where batches of 21 (a 1 GB model's 174k units) left the last wave's warps
  // copying 120 KB each. One H200, local_copy_bench, same call (session 19): 1 GB 0.5229 ->
  // 0.5098 ms, a 1 GB Qwen2.5-0.5B 0.5302 -> 0.5164, 16 GB 7.997 -> 7.968; the general kernel's
  // tiles of short runs want the lanes' resolving spread wide (many-small-moe 2.07 -> 2.09 ms at
  // 8, 2.25 at 1): 32 there.
  if (aligned_only) shape.max_batch = 8;
  return shape;
}

cudaError_t LaunchCopyItemsShaped(const CopyItem* items, const int64_t* unit_begin, int n_items, int64_t total_units,
                                  cudaStream_t stream, bool spread, bool aligned_only, const CopyLaunchShape& shape,
                                  const uint32_t* gate, uint32_t go) {
  if (n_items == 0 || total_units == 0) return cudaSuccess;
  constexpr int kThreads = 256;  // 8 warps
  // Units per batch: 1 while there are fewer units than warps to fill the GPU (large runs keep
  // every warp busy), up to max_batch (32: a lane per unit) for tens of thousands of small ones.
  const int batch = static_cast<int>(
      std::clamp<int64_t>(total_units / std::max<int64_t>(shape.warps_to_fill, 1), 1, std::clamp(shape.max_batch, 1, 32)));
  const int64_t batches = (total_units + batch - 1) / batch;
  const int64_t wanted = (batches + 7) / 8;
  const int blocks = static_cast<int>(std::min<int64_t>(wanted, std::max(shape.max_blocks, 1)));
  if (!aligned_only) {
    CopyItemsKernel<true><<<blocks, kThreads, 0, stream>>>(items, unit_begin, n_items, total_units, batch, spread, gate, go);
  } else {
    CopyItemsKernel<false><<<blocks, kThreads, 0, stream>>>(items, unit_begin, n_items, total_units, batch, spread, gate, go);
  }
  return cudaGetLastError();
}

cudaError_t LaunchGate(const uint32_t* host_word, uint32_t go, uint32_t* gate, uint32_t* decided, cudaStream_t stream) {
  GateKernel<<<1, 1, 0, stream>>>(host_word, go, gate, decided);
  return cudaGetLastError();
}

}  // namespace refit
