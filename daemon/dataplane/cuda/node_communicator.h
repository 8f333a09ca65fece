// This node's ranks of one NCCL communicator: one rank per local GPU of a plan (rank = the plan's
// GPU index), all in this process, brought up together (nonblocking init in one NCCL group) from
// the id the coordinator handed out, with the staging registered with them. Polled, never waited
// on blindly: init, registration and every step end on an error of any rank (a dead peer on the
// socket transport) or when the caller says the round is interrupted (a cancel, the deadline).
// Owned by one group's state and used by one transfer at a time (CudaBackend leases it), so it
// has no lock. On any failure the caller aborts it (Abort) and builds a new one with a new id;
// dropped without Abort, each rank is destroyed if it came up, aborted otherwise (NcclComm).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/dataplane/cuda/nccl_comm.h"

namespace refit {

class NodeCommunicator {
 public:
  // OK to go on; else why the wait must end (ABORTED, DEADLINE_EXCEEDED).
  using Interrupted = std::function<absl::Status()>;

  // `id`: an ncclUniqueId's bytes. `local`: (GPU, rank) of each of this node's ranks. Starts
  // their init and returns: WaitReady before use.
  static absl::StatusOr<std::unique_ptr<NodeCommunicator>> Start(
      const std::string& id, int nranks, const std::vector<std::pair<int32_t, int>>& local);
  // Waits (Wait) until every rank is up; from then on the ranks are destroyed, not aborted, when
  // dropped. `what` names the communicator in errors.
  absl::Status WaitReady(const Interrupted& interrupted, const std::string& what);
  bool ready() const { return ready_; }

  const std::string& id() const { return id_; }
  // The rank of local GPU `gpu` (one of Start's).
  ncclComm_t on(int32_t gpu) const { return ranks_.at(gpu).get(); }

  // Registers `buffer` (from ncclMemAlloc) with GPU `gpu`'s rank once; in progress until Wait.
  absl::Status Register(int32_t gpu, void* buffer, size_t bytes);
  // Before the buffer is freed (its streams idle).
  void Deregister(void* buffer) { registered_.erase(buffer); }

  // An asynchronous error of any rank (a dead peer on the socket transport), or OK.
  absl::Status Errors(const std::string& what) const;
  // Polls every rank until none is in progress; errors (a dead peer) and `interrupted` fail.
  absl::Status Wait(const Interrupted& interrupted, const std::string& what) const;
  // ncclCommAbort of every rank; registrations go with them. Returns at once on a dead peer.
  void Abort();

 private:
  NodeCommunicator() = default;
  std::string id_;
  bool ready_ = false;
  std::map<int32_t, NcclComm> ranks_;  // local GPU -> its rank
  // Declared after ranks_, so deregistered before the ranks go.
  std::map<void*, NcclRegistration> registered_;  // by buffer
};

}  // namespace refit
