#include "daemon/dataplane/cuda/nccl_comm.h"

#include "absl/strings/str_cat.h"
#include "daemon/dataplane/cuda/cuda_status.h"
#include "daemon/dataplane/cuda/device_guard.h"

namespace refit {

absl::StatusOr<NcclComm> NcclComm::InitRank(int32_t gpu, int nranks, const ncclUniqueId& id,
                                            int rank, ncclConfig_t config) {
  DeviceGuard guard(gpu);
  if (!guard.status().ok()) return guard.status();
  NcclComm c;
  const ncclResult_t r = ncclCommInitRankConfig(&c.comm_, nranks, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    c.comm_ = nullptr;  // NCCL released what it made
    return NcclError(r, absl::StrCat("ncclCommInitRankConfig (rank ", rank, " of ", nranks,
                                     " on GPU ", gpu, ")"));
  }
  c.gpu_ = gpu;
  return c;
}

void NcclComm::Abort() {
  if (comm_ == nullptr) return;
  DeviceGuard guard(gpu_);
  ncclCommAbort(comm_);
  comm_ = nullptr;
}

void NcclComm::Release() {
  if (comm_ == nullptr) return;
  if (!ready_) return Abort();
  DeviceGuard guard(gpu_);
  ncclCommDestroy(comm_);
  comm_ = nullptr;
}

ncclResult_t NcclComm::AsyncError() const {
  ncclResult_t state = ncclSuccess;
  if (comm_ == nullptr) return ncclInvalidUsage;
  ncclCommGetAsyncError(comm_, &state);
  return state;
}

NcclComm::~NcclComm() { Release(); }

NcclComm::NcclComm(NcclComm&& other) noexcept
    : comm_(other.comm_), gpu_(other.gpu_), ready_(other.ready_) {
  other.comm_ = nullptr;
}

NcclComm& NcclComm::operator=(NcclComm&& other) noexcept {
  if (this != &other) {
    Release();
    comm_ = other.comm_;
    gpu_ = other.gpu_;
    ready_ = other.ready_;
    other.comm_ = nullptr;
  }
  return *this;
}

absl::StatusOr<NcclRegistration> NcclRegistration::Register(const NcclComm& comm, void* buffer,
                                                            size_t bytes) {
  DeviceGuard guard(comm.gpu());
  if (!guard.status().ok()) return guard.status();
  NcclRegistration reg;
  void* handle = nullptr;
  const ncclResult_t r = ncclCommRegister(comm.get(), buffer, bytes, &handle);
  if (r != ncclSuccess && r != ncclInProgress) {
    return NcclError(
        r, absl::StrCat("ncclCommRegister of ", bytes, " bytes of staging on GPU ", comm.gpu()));
  }
  reg.comm_ = comm.get();
  reg.gpu_ = comm.gpu();
  reg.handle_ = handle;
  return reg;
}

void NcclRegistration::Reset() {
  if (handle_ == nullptr) return;
  DeviceGuard guard(gpu_);
  ncclCommDeregister(comm_, handle_);
  handle_ = nullptr;
}

NcclRegistration::~NcclRegistration() { Reset(); }

NcclRegistration::NcclRegistration(NcclRegistration&& other) noexcept
    : comm_(other.comm_), gpu_(other.gpu_), handle_(other.handle_) {
  other.handle_ = nullptr;
}

NcclRegistration& NcclRegistration::operator=(NcclRegistration&& other) noexcept {
  if (this != &other) {
    Reset();
    comm_ = other.comm_;
    gpu_ = other.gpu_;
    handle_ = other.handle_;
    other.handle_ = nullptr;
  }
  return *this;
}

}  // namespace refit
