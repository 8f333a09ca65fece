#include "daemon/dataplane/cuda/node_communicator.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/dataplane/cuda/cuda_status.h"

namespace refit {

absl::StatusOr<std::unique_ptr<NodeCommunicator>> NodeCommunicator::Start(
    const std::string& id, int nranks, const std::vector<std::pair<int32_t, int>>& local) {
  if (id.size() != sizeof(ncclUniqueId)) {
    return absl::FailedPreconditionError("the plan crosses nodes but came without an NCCL id");
  }
  std::unique_ptr<NodeCommunicator> c(new NodeCommunicator());
  c->id_ = id;
  ncclUniqueId unique;
  std::memcpy(&unique, id.data(), sizeof unique);
  if (auto s = NcclError(ncclGroupStart(), "ncclGroupStart"); !s.ok()) return s;
  for (const auto& [gpu, rank] : local) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // init and abort must not hang on a dead peer
    auto comm = NcclComm::InitRank(gpu, nranks, unique, rank, config);
    if (!comm.ok()) {
      ncclGroupEnd();
      return comm.status();  // the ranks made so far are aborted with `c`
    }
    c->ranks_[gpu] = *std::move(comm);
  }
  if (auto s = NcclError(ncclGroupEnd(), "ncclGroupEnd"); !s.ok()) return s;
  return c;
}

absl::Status NodeCommunicator::WaitReady(const Interrupted& interrupted, const std::string& what) {
  if (auto s = Wait(interrupted, what); !s.ok()) return s;
  for (auto& [gpu, rank] : ranks_) rank.MarkReady();
  ready_ = true;
  return absl::OkStatus();
}

absl::Status NodeCommunicator::Register(int32_t gpu, void* buffer, size_t bytes) {
  if (registered_.contains(buffer)) return absl::OkStatus();
  auto reg = NcclRegistration::Register(ranks_.at(gpu), buffer, bytes);
  if (!reg.ok()) return reg.status();
  registered_[buffer] = *std::move(reg);
  return absl::OkStatus();
}

absl::Status NodeCommunicator::Errors(const std::string& what) const {
  for (const auto& [gpu, rank] : ranks_) {
    const ncclResult_t state = rank.AsyncError();
    if (state != ncclSuccess && state != ncclInProgress) return NcclError(state, what);
  }
  return absl::OkStatus();
}

absl::Status NodeCommunicator::Wait(const Interrupted& interrupted, const std::string& what) const {
  const absl::Time spin_until = absl::Now() + absl::Milliseconds(2);
  while (true) {
    bool pending = false;
    for (const auto& [gpu, rank] : ranks_) {
      const ncclResult_t state = rank.AsyncError();
      if (state == ncclInProgress)
        pending = true;
      else if (state != ncclSuccess)
        return NcclError(state, what);
    }
    if (!pending) return absl::OkStatus();
    if (auto s = interrupted(); !s.ok())
      return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
    // Spin at first: between the steps of a round the host must stay ahead of the GPU, and a
    // sleep costs tens of microseconds; an init that takes long is polled gently.
    if (absl::Now() > spin_until) absl::SleepFor(absl::Microseconds(50));
  }
}

void NodeCommunicator::Abort() {
  for (auto& [buffer, reg] : registered_) reg.Forget();  // released by the abort
  registered_.clear();
  for (auto& [gpu, rank] : ranks_) rank.Abort();
  ranks_.clear();
  ready_ = false;
}

}  // namespace refit
