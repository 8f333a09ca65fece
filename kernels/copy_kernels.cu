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
    const uint4* s4 = reinterpret_cast<const uint4*>(s);
    uint4* d4 = reinterpret_cast<uint4*>(d);
    for (int64_t i = lane; i < bytes / 16; i += 32) d4[i] = s4[i];
  } else if ((misalign & 3) == 0 && (bytes & 3) == 0) {
    const uint32_t* s1 = reinterpret_cast<const uint32_t*>(s);
    uint32_t* d1 = reinterpret_cast<uint32_t*>(d);
    for (int64_t i = lane; i < bytes / 4; i += 32) d1[i] = s1[i];
  } else {
    for (int64_t i = lane; i < bytes; i += 32) d[i] = s[i];
  }
}

// One work unit resolved: `n` elements from s (src dtype) to d (dst dtype).
struct Unit {
  uint64_t s = 0, d = 0;
  int64_t n = 0;
  uint32_t dtypes = 0;  // src dtype | dst dtype << 8
};

__device__ __forceinline__ Unit Resolve(const CopyItem* items, const int64_t* unit_begin, int n_items, int64_t u) {
  int lo = 0, hi = n_items - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (unit_begin[mid] <= u) lo = mid; else hi = mid - 1;
  }
  const CopyItem& it = items[lo];
  const int64_t local = u - unit_begin[lo];
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
                                int64_t total_units, int batch) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t batches = (total_units + batch - 1) / batch;
  for (int64_t bi = warp; bi < batches; bi += warps) {
    const int64_t u0 = bi * batch;
    const int count = static_cast<int>(min(static_cast<int64_t>(batch), total_units - u0));
    Unit mine;
    if (lane < count) mine = Resolve(items, unit_begin, n_items, u0 + lane);
    for (int j = 0; j < count; ++j) {
      const uint64_t s = __shfl_sync(0xFFFFFFFFu, static_cast<unsigned long long>(mine.s), j);
      const uint64_t d = __shfl_sync(0xFFFFFFFFu, static_cast<unsigned long long>(mine.d), j);
      const int64_t n = __shfl_sync(0xFFFFFFFFu, static_cast<long long>(mine.n), j);
      const uint32_t dtypes = __shfl_sync(0xFFFFFFFFu, mine.dtypes, j);
      CopyUnit(reinterpret_cast<const unsigned char*>(s), reinterpret_cast<unsigned char*>(d), n,
               static_cast<uint8_t>(dtypes & 0xFF), static_cast<uint8_t>(dtypes >> 8), lane);
    }
  }
}

}  // namespace

cudaError_t LaunchCopyItems(const CopyItem* items, const int64_t* unit_begin, int n_items,
                            int64_t total_units, cudaStream_t stream) {
  if (n_items == 0 || total_units == 0) return cudaSuccess;
  constexpr int kThreads = 256;  // 8 warps
  // Units per batch: 1 while there are fewer units than warps to fill the GPU (large runs keep
  // every warp busy), up to 32 (a lane per unit) for tens of thousands of small ones.
  constexpr int64_t kWarpsToFill = 8192;
  const int batch = static_cast<int>(std::clamp<int64_t>(total_units / kWarpsToFill, 1, 32));
  const int64_t batches = (total_units + batch - 1) / batch;
  const int64_t wanted = (batches + 7) / 8;
  const int blocks = static_cast<int>(wanted < 4096 ? wanted : 4096);
  CopyItemsKernel<<<blocks, kThreads, 0, stream>>>(items, unit_begin, n_items, total_units, batch);
  return cudaGetLastError();
}

}  // namespace refit
