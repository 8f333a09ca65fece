// A plan: the copy descriptors and messages that move a source layout into a destination layout,
// with the statistics and the cost model's verdict. Plain data; the data planes execute it.
#pragma once

#include <cstdint>
#include <vector>

#include "plan/box.h"
#include "plan/dtype.h"

namespace refit {

enum class LinkClass : uint8_t { kLocal, kNvlink, kNetwork };
const char* LinkClassName(LinkClass link);

// A GPU (or, on the host backend, a device slot) of the cluster, numbered densely in the plan.
struct PlanGpu {
  int32_t node = 0;
  int32_t gpu = 0;
};

inline constexpr int kMaxOuterDims = 3;
inline constexpr int kMaxStages = 8;

// What a descriptor does with the elements it reads.
//   kCopy      element by element, cast from src_dtype to dst_dtype on whichever side of the
//              wire makes the message smaller.
//   kQuantize  e4m3 codes of a [count[0], inner] region of a 2-D weight (outer_rank 1) whose
//              origin is a block corner and whose end is a block edge or the tensor's end: the
//              region is whole blocks of block_rows x block_cols, and each block's scale is
//              computed from its own elements (plan/fp8_block.h). The codes travel; unpacking
//              copies them.
//   kScale     the scales of the same kind of region: it reads the region's elements (src side
//              as for kQuantize) and writes one scale per block, a [ceil(count[0] / block_rows),
//              ceil(inner / block_cols)] grid at dst_offset with row stride dst_stride[0].
// Both quantizing ops run where the whole block is: on the sending GPU's pack step, or on a
// destination GPU from a plan scratch buffer the block's parts were gathered into.
enum class CopyOp : uint8_t { kCopy, kQuantize, kScale };

// One strided copy: `inner` contiguous elements, repeated over up to kMaxOuterDims outer loops
// (count[0] outermost). Offsets and strides are in elements of the respective buffer. A copy with
// more dimensions than that is emitted as several descriptors, and so is one with a loop whose
// count or stride passes kMaxLoopValue: the loops are 32-bit, the offsets and the run 64-bit (a
// stacked expert buffer holds billions of elements; a stride past 2^31 is a rare 4-D layout).
// Narrower loops make a descriptor 88 bytes, not 120: a frontier plan holds millions of them, most
// of the planner's peak memory and of every kept plan's (docs/BENCHMARKS.md).
inline constexpr int64_t kMaxLoopValue = INT32_MAX;
// Whether a count or stride fits a descriptor's 32-bit loop.
inline bool FitsLoop(int64_t v) { return v >= -kMaxLoopValue && v <= kMaxLoopValue; }
struct CopyDescriptor {
  int32_t src_buffer = 0;  // in the source layout, or in the destination layout when forwarding
  int32_t dst_buffer = 0;  // in the destination layout
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t inner = 0;
  std::array<int32_t, kMaxOuterDims> count{};
  std::array<int32_t, kMaxOuterDims> src_stride{};
  std::array<int32_t, kMaxOuterDims> dst_stride{};
  uint8_t outer_rank = 0;
  DType src_dtype = DType::kBF16;
  DType dst_dtype = DType::kBF16;
  bool src_is_destination = false;  // stage > 0: reads a destination buffer the round filled
  CopyOp op = CopyOp::kCopy;
  uint8_t quant_format = 0;  // QuantFormat (plan/layout.h) of kQuantize and kScale
  uint16_t block_rows = 0;   // kQuantize, kScale: the block
  uint16_t block_cols = 0;
  int32_t message = 0;  // index into Plan::messages of the message that carries it

  // Elements read: the region.
  int64_t NumElements() const;
  // Elements on the wire: the region's (kCopy, kQuantize), or its blocks' (kScale).
  int64_t WireElements() const;
  // Bytes this copy puts on a link: WireElements() at WireDType(): for kCopy the narrower of the
  // two dtypes (casts happen on whichever side makes the message smaller), else dst_dtype.
  int64_t WireBytes() const;
  DType WireDType() const;
  bool Quantizes() const { return op != CopyOp::kCopy; }
};
static_assert(sizeof(CopyDescriptor) <= 88, "descriptors are kept small: millions per plan");

// A bounded batch of descriptors from one GPU to one GPU: one pack, one send, one unpack.
// Stage 0 reads sources. A stage s > 0 message reads destination buffers that stages < s filled:
// the NVLink fan-out of topology routing, or a network relay to another destination node. It may
// start once the messages that filled its source regions are complete; executing stage by stage
// is always correct.
struct Message {
  int32_t src_gpu = 0;  // index into Plan::gpus
  int32_t dst_gpu = 0;
  uint8_t stage = 0;
  LinkClass link = LinkClass::kLocal;
  int64_t bytes = 0;
  int64_t first_descriptor = 0;  // index into Plan::message_descriptors
  int64_t num_descriptors = 0;
};

struct PlanStats {
  int64_t tensors = 0;    // logical tensors moved
  int64_t pieces = 0;     // source pieces + destination pieces
  int64_t transfers = 0;  // (region, source piece, destination piece) copies before lowering
  int64_t descriptors = 0;
  int64_t messages = 0;
  int64_t bytes_total = 0;  // bytes moved on all links
  int64_t bytes_network = 0;
  int64_t bytes_nvlink = 0;
  int64_t bytes_local = 0;
  int64_t bytes_forwarded = 0;  // bytes read from destinations (stages > 0): fan-out and relays
  // Quantization on the way (fp8 destinations): what bytes_total would be had every element
  // travelled at its source dtype (and no scale), and the part of bytes_total that carries bf16
  // (or fp16, fp32) parts of blocks no source GPU holds whole, gathered into scratch.
  int64_t bytes_before_conversion = 0;
  int64_t bytes_gathered = 0;
  int64_t scratch_bytes = 0;  // Plan::scratch, all GPUs
  int32_t stages = 0;         // number of stages with messages
  int64_t max_nic_bytes = 0;  // the busiest NIC's bytes in its busier direction
  double predicted_seconds = 0;
  double lower_bound_seconds = 0;
  double planning_seconds = 0;
};

// Memory the plan itself needs on a destination GPU: where the parts of a block that no source
// GPU holds whole are gathered (stage 0) and quantized from (stage 1) by the block rule
// (docs/PLANNING.md). Descriptors address it as destination buffer `first_scratch_buffer + k`;
// each data plane allocates the scratch of its GPUs next to the worker's memory.
struct ScratchBuffer {
  int32_t gpu = 0;     // index into Plan::gpus
  int32_t worker = 0;  // the destination worker on that GPU (its device, its node)
  DType dtype = DType::kBF16;
  int64_t elements = 0;
  int64_t NumBytes() const { return elements * DTypeSize(dtype); }
};

struct Plan {
  std::vector<PlanGpu> gpus;
  std::vector<ScratchBuffer> scratch;
  int32_t first_scratch_buffer = 0;         // the destination layout's buffer count
  std::vector<CopyDescriptor> descriptors;  // in the order the planner made them
  // Message m's descriptors are descriptors[message_descriptors[m.first_descriptor + k]] for
  // k < m.num_descriptors. An index rather than a sorted copy: the descriptors of a frontier
  // model's plan are hundreds of MB, and each daemon lays out only its own part.
  std::vector<int64_t> message_descriptors;
  std::vector<Message> messages;  // in execution order: stage, sending GPU, receiving GPU
  PlanStats stats;

  const CopyDescriptor& descriptor(const Message& m, int64_t k) const {
    return descriptors[message_descriptors[m.first_descriptor + k]];
  }
};

}  // namespace refit
