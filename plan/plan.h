// A plan: the copy descriptors and messages that move a source layout into a destination layout,
// with the statistics and the cost model's verdict. Plain data; the data planes execute it.
#pragma once

#include <cstdint>
#include <vector>

#include "plan/box.h"
#include "plan/copy_descriptor.h"
#include "plan/descriptor_table.h"
#include "plan/dtype.h"

namespace refit {

enum class LinkClass : uint8_t { kLocal, kNvlink, kNetwork };
const char* LinkClassName(LinkClass link);

// A GPU (or, on the host backend, a device slot) of the cluster, numbered densely in the plan.
struct PlanGpu {
  int32_t node = 0;
  int32_t gpu = 0;
};

inline constexpr int kMaxStages = 8;

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
  int32_t first_scratch_buffer = 0;  // the destination layout's buffer count
  DescriptorTable descriptors;       // in the order the planner made them
  // Message m's descriptors are descriptors[message_descriptors[m.first_descriptor + k]] for
  // k < m.num_descriptors. An index rather than a sorted copy: the descriptors of a frontier
  // model's plan are hundreds of MB, and each daemon lays out only its own part. 32-bit: a plan
  // holds fewer than 2^31 descriptors (the planner refuses more, 64 GB of them).
  std::vector<int32_t> message_descriptors;
  std::vector<Message> messages;  // in execution order: stage, sending GPU, receiving GPU
  PlanStats stats;

  CopyDescriptor descriptor(const Message& m, int64_t k) const {
    return descriptors[message_descriptors[m.first_descriptor + k]];
  }
};

}  // namespace refit
