// One NCCL rank's communicator owned, and what is registered with it. A communicator that came
// up and saw no error is destroyed (ncclCommDestroy) with its owner; one that failed, or whose
// init never finished, is aborted (ncclCommAbort: it never waits on a peer that may be dead), so
// that an error path releases it by just letting it go. Abort() does so at once (a deadline, a
// cancel, a dead peer). NcclRegistration: one buffer registered with one rank
// (ncclCommRegister), deregistered with its owner unless its communicator was aborted, which
// releases every registration itself. Both move-only; a registration must not outlive its rank
// (NodeCommunicator declares them in that order).
#pragma once

#include <nccl.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace refit {

class NcclComm {
 public:
  NcclComm() = default;
  // ncclCommInitRankConfig on GPU `gpu` (inside the caller's ncclGroupStart/End when several
  // local ranks come up together); nonblocking communicators return before init is done.
  static absl::StatusOr<NcclComm> InitRank(int32_t gpu, int nranks, const ncclUniqueId& id,
                                           int rank, ncclConfig_t config);
  ~NcclComm();
  NcclComm(NcclComm&& other) noexcept;
  NcclComm& operator=(NcclComm&& other) noexcept;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const { return comm_; }
  int32_t gpu() const { return gpu_; }
  // Init finished without error: from now on the owner's end destroys rather than aborts.
  void MarkReady() { ready_ = true; }
  // ncclCommAbort now (a no-op once released).
  void Abort();
  // ncclCommGetAsyncError: ncclInProgress while init or registration is under way.
  ncclResult_t AsyncError() const;

 private:
  void Release();
  ncclComm_t comm_ = nullptr;
  int32_t gpu_ = -1;
  bool ready_ = false;
};

class NcclRegistration {
 public:
  NcclRegistration() = default;
  // ncclCommRegister of `bytes` at `buffer` with `comm`; in progress until the rank's AsyncError
  // is no longer ncclInProgress.
  static absl::StatusOr<NcclRegistration> Register(const NcclComm& comm, void* buffer,
                                                   size_t bytes);
  ~NcclRegistration();
  NcclRegistration(NcclRegistration&& other) noexcept;
  NcclRegistration& operator=(NcclRegistration&& other) noexcept;
  NcclRegistration(const NcclRegistration&) = delete;
  NcclRegistration& operator=(const NcclRegistration&) = delete;

  // Forgets the registration without ncclCommDeregister: its communicator is being aborted.
  void Forget() { handle_ = nullptr; }

 private:
  void Reset();
  ncclComm_t comm_ = nullptr;  // not owned
  int32_t gpu_ = -1;
  void* handle_ = nullptr;
};

}  // namespace refit
