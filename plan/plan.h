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

// One strided copy: `inner` contiguous elements, repeated over up to kMaxOuterDims outer loops
// (count[0] outermost). Offsets and strides are in elements of the respective buffer. A copy with
// more dimensions than that is emitted as several descriptors.
struct CopyDescriptor {
  int32_t src_buffer = 0;  // in the source layout, or in the destination layout when forwarding
  int32_t dst_buffer = 0;  // in the destination layout
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t inner = 0;
  std::array<int64_t, kMaxOuterDims> count{};
  std::array<int64_t, kMaxOuterDims> src_stride{};
  std::array<int64_t, kMaxOuterDims> dst_stride{};
  uint8_t outer_rank = 0;
  DType src_dtype = DType::kBF16;
  DType dst_dtype = DType::kBF16;
  bool src_is_destination = false;  // stage-1 forward: reads a buffer the round already filled

  int64_t NumElements() const;
  // Bytes this copy puts on a link: elements at the narrower of the two dtypes (casts happen on
  // whichever side makes the message smaller).
  int64_t WireBytes() const;
  DType WireDType() const;
};
static_assert(sizeof(CopyDescriptor) <= 128, "descriptors are kept small: millions per plan");

// A bounded batch of descriptors from one GPU to one GPU: one pack, one send, one unpack.
// Stage 0 reads sources; stage 1 forwards bytes that stage 0 landed on a node to that node's other
// GPUs (the NVLink fan-out of topology routing) and may start only after the stage-0 messages
// into its source GPU are complete.
struct Message {
  int32_t src_gpu = 0;  // index into Plan::gpus
  int32_t dst_gpu = 0;
  uint8_t stage = 0;
  LinkClass link = LinkClass::kLocal;
  int64_t bytes = 0;
  int64_t first_descriptor = 0;
  int64_t num_descriptors = 0;
};

struct PlanStats {
  int64_t tensors = 0;      // logical tensors moved
  int64_t pieces = 0;       // source pieces + destination pieces
  int64_t transfers = 0;    // (region, source piece, destination piece) copies before lowering
  int64_t descriptors = 0;
  int64_t messages = 0;
  int64_t bytes_total = 0;  // bytes moved on all links
  int64_t bytes_network = 0;
  int64_t bytes_nvlink = 0;
  int64_t bytes_local = 0;
  int64_t bytes_forwarded = 0;  // part of bytes_nvlink/bytes_local that stage 1 moves
  int64_t max_nic_bytes = 0;    // the busiest NIC's bytes in its busier direction
  double predicted_seconds = 0;
  double lower_bound_seconds = 0;
  double planning_seconds = 0;
};

struct Plan {
  std::vector<PlanGpu> gpus;
  std::vector<CopyDescriptor> descriptors;  // grouped by message, messages in execution order
  std::vector<Message> messages;
  PlanStats stats;
};

}  // namespace refit
