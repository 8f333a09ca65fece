// The data plane's CUDA kernels and their launches (copy_kernels.h): the copy kernel, the
// quantizing kernel, the gate. Their device code lives in copy_device.cuh (element access, spans,
// tiles) and quantize_device.cuh (block fp8 and MXFP8), both part of this translation unit.
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/copy_device.cuh"
#include "kernels/copy_kernels.h"
#include "kernels/e4m3_quotient.h"
#include "kernels/quantize_device.cuh"
#include "plan/dtype.h"

namespace refit {
namespace {

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
