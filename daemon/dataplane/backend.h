// The data plane behind one interface: the daemon maps workers' buffers and runs its part of
// each round's plan through a DataBackend. `host` (shared memory, TCP between daemons) runs
// anywhere; `cuda` (CUDA IPC, NCCL, kernels) on GPU nodes.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/base/socket.h"
#include "plan/host_copy.h"
#include "plan/layout.h"
#include "plan/plan.h"
#include "proto/refit.pb.h"

namespace refit {

// A worker's buffer, reachable by the daemon until destroyed.
class MappedBuffer {
 public:
  virtual ~MappedBuffer() = default;
  virtual std::span<std::byte> bytes() const = 0;
};

// This node's part of one round: the whole plan, and the memory of the buffers on this node
// (spans indexed like the plan's layouts' buffers; empty for buffers elsewhere).
// What the coordinator installs on every node alike for a data plane that moves bytes between
// nodes through collectives (the cuda backend's NCCL path); the node agent passes it through
// unread, and the host backend ignores it.
struct CollectiveParams {
  std::string nccl_id;              // the communicator's ncclUniqueId for this epoch
  int64_t step_bytes = 0;           // one network step's bytes, the same on every node
  int64_t zero_copy_min_bytes = 0;  // smallest zero-copy descriptor (0: the backend's default)
  bool nccl_register = false;       // staging registered with NCCL, on every node alike
};

struct TransferJob {
  std::string group;
  int64_t round_id = 0;
  int32_t node = 0;
  std::shared_ptr<const Plan> plan;
  BufferMemory src;
  BufferMemory dst;  // the destination layout's buffers, then the plan's scratch (Plan::scratch)
  std::shared_ptr<const void> scratch;  // keeps the scratch behind dst alive for the transfer
  absl::flat_hash_map<int32_t, std::string> data_addresses;  // node -> its data plane address
  absl::Time deadline;
  int64_t epoch = 0;                  // membership epoch of the plan: a new one means new peers
  CollectiveParams collective;        // read only by a data plane with collectives between nodes
  std::shared_ptr<const void> holds;  // keeps src and dst mapped where the job outlives its call
                                      // (RoundPreparing): the node's workers
  absl::Time requested = absl::InfinitePast();  // when the phase request reached this node (logged:
                                                // nodes that start apart make the round longer)
};

struct TransferStats {
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;  // over the network or NVLink
  int64_t bytes_local = 0;
  int64_t bytes_nvlink = 0;  // of bytes_received: from another GPU of this node
  // Set by LogMoved (the cuda backend: LogRound): the data plane's own time, and when it began
  // after the request arrived.
  double data_plane_ms = 0;
  double started_after_request_ms = -1;  // -1: not from a phase request
};

// Logs "moved in" and when this node began against when the request arrived, to the microsecond:
// daemons of one host share the clock, so their logs show how far apart the nodes began (the
// whole round waits on the latest) and how much of that was the node's own preparation.
// Also records both times in `stats` (PhaseResponse carries them to the coordinator).
void LogMoved(const TransferJob& job, absl::Time started, TransferStats* stats);

class DataBackend {
 public:
  virtual ~DataBackend() = default;
  virtual std::string name() const = 0;
  // Where peers reach this node's data plane.
  virtual std::string data_address() const = 0;
  // Makes a worker's buffer of `bytes` reachable; errors say what is wrong with the handle.
  virtual absl::StatusOr<std::unique_ptr<MappedBuffer>> Map(const v1::BufferMemory& memory,
                                                            int64_t bytes) = 0;
  // Makes every buffer of a registration reachable at once, one MappedBuffer per buffer in
  // order: what several buffers share (a shared-memory object, a CUDA VMM range) is mapped once
  // for all of them. `buffer_bytes`: per buffer, from the layout. `fds`: the descriptors handed
  // over under the request's fd_token, in order (CheckMemoryRefs has checked every index).
  // Errors name the buffer or range at fault. Default: Map() each buffer, and refuse memory
  // handed over as descriptors.
  virtual absl::StatusOr<std::vector<std::unique_ptr<MappedBuffer>>> MapBuffers(
      const v1::RegisterWorkerRequest& request, std::span<const int64_t> buffer_bytes,
      std::span<const Fd> fds);
  // Memory for one of the plan's scratch buffers (Plan::scratch: where the block rule gathers
  // the parts of fp8 blocks no source holds whole) on the GPU of destination worker `worker`,
  // reachable like that worker's buffers. No default: a backend (or a wrapper) that forgot it
  // would hand out memory its data plane cannot reach.
  virtual absl::StatusOr<std::unique_ptr<MappedBuffer>> AllocateScratch(const Worker& worker,
                                                                        int64_t bytes) = 0;
  // This daemon's index of the GPU named `name`, a UUID or PCI bus id (daemon/dataplane/gpu_ids.h).
  virtual absl::StatusOr<int32_t> GpuIndex(const std::string& name) = 0;
  // Runs this node's messages, in stage order, until every message into this node has landed or
  // the deadline passes. Errors name the round, the stage and the peer at fault.
  virtual absl::StatusOr<TransferStats> Transfer(const TransferJob& job) = 0;
  // PREPARE has been sent to the node's workers of `job`'s group (they write their weights now).
  // A backend that ArmsRounds launches the round's work meanwhile, held back on the GPU until
  // Transfer lets it go (the cuda backend's armed rounds), on a thread of its own: the call
  // returns at once, and the job (job.holds: the node's workers, whose memory it names) is kept
  // until the round is armed or dropped. Never fails: what cannot be made ready is done by
  // Transfer as usual.
  virtual void RoundPreparing(TransferJob job) { (void)job; }
  // Whether RoundPreparing is wanted: the node then builds the whole job (its plan and buffers)
  // at PREPARE.
  virtual bool ArmsRounds() const { return false; }
  // The workers of `group` on this node have prepared round `round_id`: its TRANSFER is next, or
  // its abort. The cuda backend has the GPU switch to its context now, while the coordinator
  // gathers the other nodes' answers (an empty kernel: 0.15 ms on an H200 after another
  // process's GPU work), where it armed nothing for the round.
  virtual void WorkersPrepared(const std::string& group, int64_t round_id) {
    (void)group, (void)round_id;
  }
  // Ends a running Transfer of that round early with ABORTED(reason); work made ready for it by
  // RoundPreparing does nothing.
  virtual void Cancel(const std::string& group, int64_t round_id, const std::string& reason) = 0;
  // A fresh communicator id for the coordinator to hand out (empty: this backend needs none).
  virtual absl::StatusOr<std::string> NewCommunicatorId() { return std::string(); }
  // cuda backend: NCCL communicators brought up and aborted since start (metrics).
  struct CommunicatorCounts {
    int64_t built = 0, aborted = 0;
  };
  virtual CommunicatorCounts Communicators() const { return {}; }
  // Events of the data connections since start, by name (host backend: accepted, evicted, ...;
  // metrics read them at scrape time). Empty: this backend counts none.
  virtual std::vector<std::pair<std::string, int64_t>> ConnectionEvents() const { return {}; }
};

}  // namespace refit
