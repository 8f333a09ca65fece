// CUDA kernels that execute copy items (copy_items.h): one launch per message packs all of its
// descriptors into staging, or unpacks staging into all of its destinations, converting among
// bf16, fp16 and fp32 on the way. Each warp takes batches of work units in turn, its lanes
// resolving a batch's units at once. A unit of a long run (or a segment of one) streams in 16-byte
// stores aligned at the destination (single bytes before and after), from 16-byte loads, shifted
// by funnel shifts where the source's misalignment differs. A unit of an item of short runs is a
// tile of its flattened index space: consecutive lanes take consecutive accesses across run
// boundaries, each at the widest width every address of the item allows (copy_items.h), several
// loads in flight per lane before their stores.
// Quantizing items (fp8 on the way, kQuantize / kScale) share the launch: a warp takes a whole
// block as one unit (amax over its finite elements reduced across the lanes, the block's scale,
// then the e4m3 codes or the scale), with the arithmetic of plan/fp8_block.h bit for bit
// (__fdiv_rn, FloatToE4M3 ported as integer code, NaN encoded from its own bits).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/copy_items.h"

namespace refit {

// `items` and `unit_begin` (n_items + 1 entries) in device memory. A warp takes batches of up
// to 32 units (8 in the aligned kernel: DefaultCopyLaunchShape): consecutive ones, or, with
// `spread`, units a grid of warps apart, so that the warps running at any moment work on
// neighbouring units. Spread helps runs of a kilobyte and more on one GPU (a colocated 110 MB
// refit: 1.10 -> 0.72 ms on one H200) and hurts runs of a few hundred bytes (99k small tensors:
// 4.9 -> 6.0 ms); see SpreadPays.
// `aligned_only` (AlignedOnly(work)): the aligned kernel, faster where it applies; otherwise the
// general one, which runs any work.
// `gate` (device memory, optional): the kernel copies only if *gate == go when it starts, and
// does nothing otherwise (work launched ahead of its round's go-ahead: LaunchGate).
// `quantizing` (QuantizingUnitsOf(work)): kInQuantizingKernel runs the quantizing units in a
// second kernel launched after the copy kernel, which then skips them (a copy kernel built without
// quantizing code; unit_begin from QuantizingLaunchUnits): a thread block per block fp8 block, read
// once (the copy kernel's warp reads a block twice, and once more for its kScale unit) through
// shared memory while the previous block converts, the quotients by an FMA-corrected reciprocal
// (kernels/e4m3_quotient.h), the codes by the hardware's conversion, and each block's scale written
// with its codes where the work holds the kScale item of the same region (whose units then do
// nothing). MXFP8's one-row blocks the same way, a tile of them a unit (Mxfp8UnitRows x
// Mxfp8UnitCols), each block's amax over the four threads of its chunks. The same bytes either way;
// kInCopyKernel runs every unit in the copy kernel (one launch). kNone: no item quantizes, and the
// copy kernel is the one without quantizing code, whose copy loops ptxas allocates alone (the
// aligned kernel 58 registers without spills, against 80 registers and 36 bytes of spills; the
// general one 228 bytes of spills against 356). kInMxQuantizingKernel: the quantizing kernel as
// kInQuantizingKernel, built for MXFP8's one-row-block tiles (straight-line code for the usual
// tile) where the other is built for block fp8's: each path alone in its kernel, as ptxas
// allocates it (block fp8's 7.46 -> 7.13 ms on one H200 with its path alone).
// Either runs any unit, to the same bytes.
enum class QuantizingUnits : uint8_t {
  kInCopyKernel,
  kNone,
  kInQuantizingKernel,
  kInMxQuantizingKernel
};
cudaError_t LaunchCopyItems(const CopyItem* items, const int64_t* unit_begin, int n_items,
                            int64_t total_units, cudaStream_t stream, bool spread = false,
                            bool aligned_only = false, const uint32_t* gate = nullptr,
                            uint32_t go = 0,
                            QuantizingUnits quantizing = QuantizingUnits::kInCopyKernel);
// Whether any item of `work` quantizes.
bool HasQuantizing(const CopyWork& work);
// How the refit launches `work`: its quantizing units in the quantizing kernel, if it has any,
// built for the tiles that carry most of its quantized bytes.
QuantizingUnits QuantizingUnitsOf(const CopyWork& work);
// Whether `quantizing` runs the quantizing units in a quantizing kernel (either build).
bool InQuantizingKernel(QuantizingUnits quantizing);

// The launch's shape: units per warp's batch (total_units / warps_to_fill, between 1 and
// max_batch) and blocks (enough for every batch, at most max_blocks; the warps loop over what is
// left). kernels/local_copy_bench varies it; LaunchCopyItems launches DefaultCopyLaunchShape.
struct CopyLaunchShape {
  int max_batch = 32;
  int64_t warps_to_fill = 8192;
  int max_blocks = 4096;
  // The quantizing kernel's blocks resident per SM that ptxas plans registers for: 2 or 3.
  int quant_min_blocks = 2;
};
CopyLaunchShape DefaultCopyLaunchShape(bool aligned_only);
cudaError_t LaunchCopyItemsShaped(const CopyItem* items, const int64_t* unit_begin, int n_items,
                                  int64_t total_units, cudaStream_t stream, bool spread,
                                  bool aligned_only, const CopyLaunchShape& shape,
                                  const uint32_t* gate = nullptr, uint32_t go = 0,
                                  QuantizingUnits quantizing = QuantizingUnits::kInCopyKernel);

// Work launched ahead, at a round's PREPARE, and let go at its TRANSFER
// (daemon/dataplane/cuda/cuda_backend.cc): the caller makes the stream wait (cuStreamWaitValue32,
// the driver API, which this library does not link) until the host-written word `host_word` (mapped
// host memory, at its device address) reaches go, or what follows it; then LaunchGate's one thread
// reads it again (an acquire load at system scope) and sets *gate = go if it is exactly go and 0
// otherwise (go + 1: the round was called off). Copies launched after it with (gate, go) copy only
// when let go. `decided` (mapped host memory, optional) gets what the gate was set to, for the host
// to check after the stream ran: go, or the round's work did nothing.
cudaError_t LaunchGate(const uint32_t* host_word, uint32_t go, uint32_t* gate, uint32_t* decided,
                       cudaStream_t stream);

// LaunchGate without the stream's wait before it: one thread reads `host_word` until it reaches
// go (or what follows it), sleeping `sleep_ns` between reads, then sets the gate as LaunchGate
// does. For kernels/gate_bench only: it lets copies start 6-7 us sooner than the stream wait, but
// a kernel that runs while the workers prepare is one running when refitd is killed, and under
// MPS killing a client whose kernel runs is a fatal error for every client of the GPU: the
// trainers' and engines' contexts torn down, the GPU reset (tests/gpu/armed_faults.sh case 5,
// docs/BENCHMARKS.md). A stream wait is not a running kernel.
cudaError_t LaunchWaitingGate(const uint32_t* host_word, uint32_t go, uint32_t* gate,
                              uint32_t* decided, unsigned sleep_ns, cudaStream_t stream);

// A kernel that does nothing: launched only for the GPU to switch to this process's context
// (daemon/dataplane/cuda/cuda_backend.cc, WorkersPrepared).
cudaError_t LaunchNothing(cudaStream_t stream);
// Loads these kernels (the empty one, the gate, both copy kernels) into the current device's
// context: lazy loading would at their first launch, which may wait for the GPU's other work.
cudaError_t LoadKernels();

// For copy_kernels_test: runs every finite fp32 pattern through the quantizing kernel's hardware
// e4m3 conversion and through its port of FloatToE4M3; adds the number that differ to
// *mismatches and lowers *first to the smallest such pattern (both device memory, set by the
// caller to 0 and 0xFFFFFFFF).
cudaError_t CheckE4M3Conversion(unsigned long long* mismatches, uint32_t* first,
                                cudaStream_t stream);

// For the benchmarks: fills the first bytes / 4 * 4 bytes at `p` (device memory) with weight-like
// bf16 values (random signs and mantissas, magnitudes 2^-14 to 2^-4), so that quantizing runs on
// the numbers it meets in a refit rather than on whatever the allocation held.
cudaError_t FillBf16Weights(void* p, size_t bytes, uint64_t seed, cudaStream_t stream);

// Whether `work`'s units are large enough for `spread` (1 KiB or more on average). Tiles made
// units of short runs large (16 KiB by default), so spread is now the order for them too; the
// 4.9 -> 6.0 ms above was measured with one unit per 195-byte run. Runs of 512 bytes to 1 KiB are
// units of their own (kTileRunBytes) and can bring the average under 1 KiB: spread off then.
bool SpreadPays(const CopyWork& work);

}  // namespace refit
