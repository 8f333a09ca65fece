// A node's part of a plan, laid out for a pipelined GPU executor. Pure C++ (no CUDA, no NCCL):
// built and tested on the CPU, executed by the cuda backend.
//
// Messages between GPUs of this node become direct copy work, one launch per receiving GPU per
// stage. Messages between nodes become network operations, cut into steps: for each pair of ranks
// and direction, consecutive operations fill a step up to ScheduleOptions::step_bytes (fewer,
// larger steps: each costs an NCCL launch). Every rank derives the same lists from the same plan,
// so step k of one rank matches step k of its peers and one NCCL group per step cannot deadlock.
// A descriptor that is contiguous at both ends, of one dtype and large enough, travels zero-copy
// (sent from the source tensor, received into the destination tensor); the rest of a message is
// packed into a staging slot of its step and unpacked on the other side.
//
// Staging per GPU is `depth` regions, one per step in flight, each large enough for the largest
// step: step k uses region k % depth. While step k is on the wire, step k-1 is unpacked and step
// k+depth-1 packed.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/copy_items.h"
#include "plan/plan.h"

namespace refit {

struct NetworkOp {
  int32_t peer = 0;  // the other end's rank: its index in Plan::gpus
  bool send = false;
  bool zero_copy = false;  // `buffer` is the tensor's own memory, not staging
  int64_t bytes = 0;
  uint64_t buffer = 0;  // as the local GPU addresses it
};

struct NetworkStep {
  std::vector<NetworkOp> ops;
  CopyWork pack;    // fills the step's send slots (one launch), before the sends
  CopyWork unpack;  // empties its receive slots (one launch), after the receives
};

struct StageSchedule {
  std::map<int32_t, CopyWork> direct;  // local GPU -> copies it receives by NVLink or locally
  std::map<int32_t, std::vector<NetworkStep>> steps;  // local GPU -> its network steps
  int32_t num_steps = 0;                              // most steps of any local GPU
};

struct NodeSchedule {
  std::vector<StageSchedule> stages;        // kMaxStages
  std::map<int32_t, int64_t> region_bytes;  // local GPU -> one step's staging
  std::map<int32_t, int32_t> depth;  // local GPU -> steps in flight (staging = depth * region)
  bool uses_network = false;         // some message between this node and another
  int64_t bytes_sent = 0, bytes_received = 0, bytes_local = 0, bytes_peer = 0;
  int64_t bytes_zero_copy = 0;  // of sent + received, moved without staging
  int64_t network_ops = 0;      // sends and receives issued
  int64_t StagingBytes(int32_t gpu) const;
};

struct ScheduleOptions {
  int32_t node = 0;
  int64_t staging_budget = int64_t{256} << 20;  // per GPU
  int32_t max_depth = 4;
  // Smallest descriptor sent zero-copy: below it packing beats another NCCL operation (NCCL's
  // rate falls steeply under 16 MiB per operation). Every node must use the same value (it shapes
  // the steps both ends of an operation derive).
  int64_t zero_copy_min_bytes = int64_t{16} << 20;
  // Bytes of one step between two GPUs (at least the plan's largest message): each step costs
  // an NCCL group launch, tens of microseconds. Every node must use the same value.
  int64_t step_bytes = 0;
  int64_t segment_bytes = 16384;
};

// Addresses of the plan's source and destination buffers as `gpu` addresses them.
using AddressesOn =
    std::function<absl::StatusOr<std::pair<BufferAddresses, BufferAddresses>>(int32_t gpu)>;
// Staging of `bytes` on `gpu` (called once per GPU that needs any): its address.
using StagingOn = std::function<absl::StatusOr<uint64_t>(int32_t gpu, int64_t bytes)>;

// FAILED_PRECONDITION when one step of a GPU needs more staging than the budget, naming the GPU,
// the stage and what to change.
absl::StatusOr<NodeSchedule> BuildNodeSchedule(const Plan& plan, const ScheduleOptions& options,
                                               const AddressesOn& addresses_on,
                                               const StagingOn& staging_on);

// What the cuda executor takes for a schedule's network part, from rates measured on hardware
// (defaults fitted on 2 x H200, docs/BENCHMARKS.md "The executor model": the wire on the 61 GB
// refit's timeline, the per-item cost on the 99k-tensor refit, the fixed cost on the 251 MB one).
// Per stage and GPU, the slowest of its three pipelined streams: the wire (the larger direction,
// plus a cost per NCCL operation), all its packs, all its unpacks (bytes at the kernels' rate plus
// a cost per copy item: small pieces make the kernels the bottleneck); plus the pack of its first
// step and the unpack of its last, which nothing overlaps. Stages in turn, the slowest GPU of
// each; plus a fixed cost per round. Copies inside the node are not counted.
struct ExecutorModel {
  double wire_gbps = 356.0;   // NCCL point-to-point between the two GPUs, large steps
  double per_op_us = 6.3;     // each NCCL send or receive
  double pack_gbps = 1400.0;  // pack and unpack kernels, large pieces
  double per_item_ns = 9.0;   // each copy item packed or unpacked (fitted: 99k tensors of 2-8 KB)
  double fixed_us = 450.0;    // per round
};
double PredictNetworkSeconds(const NodeSchedule& schedule, const ExecutorModel& model);

// Whether `d` can travel zero-copy: one dtype, contiguous at both ends, at least `min_bytes`.
bool IsZeroCopy(const CopyDescriptor& d, int64_t min_bytes);

}  // namespace refit
