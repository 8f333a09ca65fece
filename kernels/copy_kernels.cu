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
__device__ __forceinline__ void WarpConvertVector(const unsigned char* s, unsigned char* d, int64_t n,
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

// A warp copies `bytes` bytes from s to d.
__device__ __forceinline__ void WarpCopyBytes(const unsigned char* s, unsigned char* d, int64_t bytes, int lane) {
  const uint64_t misalign = (reinterpret_cast<uint64_t>(s) | reinterpret_cast<uint64_t>(d));
  if ((misalign & 15) == 0 && (bytes & 15) == 0) {
    // Four 16-byte loads in flight per lane before their stores: one at a time (the compiler
    // cannot move a load above the previous store, which might alias it) kept a colocated 16 GB
    // refit at 0.34 of the copy engine (issue 17).
    const uint4* s4 = reinterpret_cast<const uint4*>(s);
    uint4* d4 = reinterpret_cast<uint4*>(d);
    const int64_t n = bytes / 16;
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
  } else if ((misalign & 3) == 0 && (bytes & 3) == 0) {
    const uint32_t* s1 = reinterpret_cast<const uint32_t*>(s);
    uint32_t* d1 = reinterpret_cast<uint32_t*>(d);
    for (int64_t i = lane; i < bytes / 4; i += 32) d1[i] = s1[i];
  } else {
    for (int64_t i = lane; i < bytes; i += 32) d[i] = s[i];
  }
}

// One work unit resolved: `n` elements from s (src dtype) to d (dst dtype). A quantizing unit is
// one block: n = block rows << 32 | block cols, its first element at s (rows ss elements apart),
// its codes at d (rows ds bytes apart) or its scale at d.
struct Unit {
  uint64_t s = 0, d = 0;
  int64_t n = 0;
  uint32_t dtypes = 0;  // src dtype | dst dtype << 8 | op << 16 | quant format << 24
  int64_t ss = 0, ds = 0;
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

// A warp quantizes one block of nr x nc elements at s (rows ss elements apart): the max of |x|
// over its finite elements, reduced across the lanes (max is exact and order-free), the block's
// scale, then kQuantize: the codes e4m3(x / scale) at d (rows ds bytes apart), a NaN encoded from
// its own bits (sign kept), not divided; kScale: the scale at d (fp32 bits, or an e8m0 byte).
__device__ __forceinline__ void QuantizeUnit(const unsigned char* s, unsigned char* d, int nr, int nc, int64_t ss,
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
        if (k0 + 32 * i >= chunks) continue;
        const uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
        for (int h = 0; h < 8; ++h) {
          const float a = fabsf(__uint_as_float(h & 1 ? w[h / 2] & 0xFFFF0000u : w[h / 2] << 16));
          if (isfinite(a) && a > amax) amax = a;
        }
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
      const uint4 v = *chunk_at(k);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
      uint32_t code[2] = {0, 0};
#pragma unroll
      for (int h = 0; h < 8; ++h) {
        const uint32_t bits = h & 1 ? w[h / 2] >> 16 : w[h / 2] & 0xFFFFu;
        const uint32_t q = IsNanBits(bits, sdt) ? (SignBit(bits, 2) | 0x7F)
                                                : FloatToE4M3(__fdiv_rn(__uint_as_float(bits << 16), scale));
        code[h / 4] |= q << (8 * (h % 4));
      }
      *reinterpret_cast<uint2*>(d + static_cast<int64_t>(k / chunks_per_row) * ds + (k % chunks_per_row) * 8) =
          make_uint2(code[0], code[1]);
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

__device__ __forceinline__ Unit Resolve(const CopyItem* items, const int64_t* unit_begin, int n_items, int64_t u) {
  int lo = 0, hi = n_items - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (unit_begin[mid] <= u) lo = mid; else hi = mid - 1;
  }
  const CopyItem& it = items[lo];
  const int64_t local = u - unit_begin[lo];
  if (it.op != static_cast<uint8_t>(CopyOp::kCopy)) {
    // Block (bi, bj) of the region.
    const int64_t bi = local / it.segments, bj = local % it.segments;
    const int64_t r0 = bi * it.block_rows, c0 = bj * it.block_cols;
    const int64_t nr = min(static_cast<int64_t>(it.block_rows), it.count[2] - r0);
    const int64_t nc = min(static_cast<int64_t>(it.block_cols), it.inner - c0);
    Unit unit;
    unit.n = nr << 32 | nc;
    unit.s = it.src + (r0 * it.src_stride[2] + c0) * Size(it.src_dtype);
    unit.d = it.op == static_cast<uint8_t>(CopyOp::kQuantize) ? it.dst + r0 * it.dst_stride[2] + c0
                                                               : it.dst + (bi * it.dst_stride[2] + bj) * Size(it.dst_dtype);
    unit.ss = it.src_stride[2];
    unit.ds = it.dst_stride[2];
    unit.dtypes = it.src_dtype | (static_cast<uint32_t>(it.dst_dtype) << 8) | (static_cast<uint32_t>(it.op) << 16) |
                  (static_cast<uint32_t>(it.quant_format) << 24);
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

__device__ __forceinline__ void CopyUnit(const unsigned char* s, unsigned char* d, int64_t n, uint8_t sdt, uint8_t ddt,
                                         int lane) {
  const int ss = Size(sdt), ds = Size(ddt);
  if (sdt == ddt) {
    WarpCopyBytes(s, d, n * ss, lane);
  } else if (((reinterpret_cast<uint64_t>(s) | reinterpret_cast<uint64_t>(d)) & 15) == 0 && n % 8 == 0) {
    WarpConvertVector(s, d, n, sdt, ddt, ss, ds, lane);
  } else {
    for (int64_t i = lane; i < n; i += 32) {
      StoreBits(FloatToBits(BitsToFloat(LoadBits(s + i * ss, ss), sdt), ddt), d + i * ds, ds);
    }
  }
}

// Each warp takes batches of `batch` consecutive units in turn. Its first `batch` lanes resolve
// one unit each at once (the item searches and loads overlap instead of running one after another
// per unit), then the whole warp copies them one by one. Tens of thousands of 2-8 KB units then
// need fewer, shorter-lived blocks: beside NCCL's kernels, the 99k-tensor refit on 2 x H200 ran
// 2.2x faster (docs/BENCHMARKS.md, session 10).
__global__ void CopyItemsKernel(const CopyItem* items, const int64_t* unit_begin, int n_items,
                                int64_t total_units, int batch, bool spread) {
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
    if (lane < count) mine = Resolve(items, unit_begin, n_items, first + lane * step);
    for (int j = 0; j < count; ++j) {
      const uint64_t s = __shfl_sync(0xFFFFFFFFu, static_cast<unsigned long long>(mine.s), j);
      const uint64_t d = __shfl_sync(0xFFFFFFFFu, static_cast<unsigned long long>(mine.d), j);
      const int64_t n = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(mine.n), j);
      const uint32_t dtypes = __shfl_sync(0xFFFFFFFFu, mine.dtypes, j);
      if (((dtypes >> 16) & 0xFF) != 0) {  // a quantizing unit (op != kCopy): one block, this warp alone
        const int64_t ss = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(mine.ss), j);
        const int64_t ds = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(mine.ds), j);
        QuantizeUnit(reinterpret_cast<const unsigned char*>(s), reinterpret_cast<unsigned char*>(d),
                     static_cast<int>(n >> 32), static_cast<int>(n & 0xFFFFFFFF), ss, ds,
                     static_cast<uint8_t>(dtypes & 0xFF), static_cast<uint8_t>((dtypes >> 16) & 0xFF),
                     static_cast<uint8_t>(dtypes >> 24), lane);
        continue;
      }
      CopyUnit(reinterpret_cast<const unsigned char*>(s), reinterpret_cast<unsigned char*>(d), n,
               static_cast<uint8_t>(dtypes & 0xFF), static_cast<uint8_t>(dtypes >> 8), lane);
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

cudaError_t LaunchCopyItems(const CopyItem* items, const int64_t* unit_begin, int n_items,
                            int64_t total_units, cudaStream_t stream, bool spread) {
  if (n_items == 0 || total_units == 0) return cudaSuccess;
  constexpr int kThreads = 256;  // 8 warps
  // Units per batch: 1 while there are fewer units than warps to fill the GPU (large runs keep
  // every warp busy), up to 32 (a lane per unit) for tens of thousands of small ones.
  constexpr int64_t kWarpsToFill = 8192;
  const int batch = static_cast<int>(std::clamp<int64_t>(total_units / kWarpsToFill, 1, 32));
  const int64_t batches = (total_units + batch - 1) / batch;
  const int64_t wanted = (batches + 7) / 8;
  const int blocks = static_cast<int>(wanted < 4096 ? wanted : 4096);
  CopyItemsKernel<<<blocks, kThreads, 0, stream>>>(items, unit_begin, n_items, total_units, batch, spread);
  return cudaGetLastError();
}

}  // namespace refit
