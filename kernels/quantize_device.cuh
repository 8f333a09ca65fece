// The quantizing kernels' device code: block fp8 and MXFP8 arithmetic (plan/fp8_block.cc, bit for
// bit), a warp's quantizing of one block, and the quantizing kernel's staged tiles.
// Part of copy_kernels.cu's one translation unit, included there only: nvcc compiles the kernels
// whole, without relocatable device code, so that they inline these device functions.
#pragma once

#include <cstdint>

#include "kernels/copy_device.cuh"
#include "kernels/copy_kernels.h"
#include "kernels/e4m3_quotient.h"
#include "plan/dtype.h"

namespace refit {
namespace {

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
  if (walk.AllIn(q.nr())) {  // the usual tile: the addresses stepped, no walk, every chunk in
    const unsigned char* at = s + (static_cast<int64_t>(walk.row0) * q.u.ss + walk.col0 * 8) * 2;
    const int64_t step = static_cast<int64_t>(walk.rows_per_step) * q.u.ss * 2;
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      Stage16(staged + i * kQuantThreads + threadIdx.x, at, true);
      at += step;
    }
    return;
  }
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
  if (kStraight && __all_sync(0xFFFFFFFFu, walk.AllIn(q.nr()))) {
    // The usual tile: straight-line code, the stores' addresses stepped (the loop below spent
    // two thirds of its ~120 instructions a chunk on branches, the walk and addresses).
    unsigned char* out = d + static_cast<int64_t>(walk.row0) * q.u.ds + walk.col0 * 8;
    const int64_t out_step = static_cast<int64_t>(walk.rows_per_step) * q.u.ds;
    const bool writes_scale = scale != nullptr && (walk.col0 & 3) == 0;
    unsigned char* code_at =
        writes_scale ? scale + static_cast<int64_t>(walk.row0) * scale_stride + walk.col0 / 4
                     : nullptr;
    const int64_t code_step = static_cast<int64_t>(walk.rows_per_step) * scale_stride;
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      uint8_t code;
      bool chunk_finite;
      const Divisor div = RowsBlockDivisor(v[i], &code, &chunk_finite);
      if (quantize) *reinterpret_cast<uint2*>(out) = Bf16ChunkCodesFast(v[i], div, chunk_finite);
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

}  // namespace
}  // namespace refit
