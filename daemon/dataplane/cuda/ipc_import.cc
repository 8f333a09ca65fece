#include "daemon/dataplane/cuda/ipc_import.h"

#include <cuda_runtime.h>

#include <cstring>

#include "daemon/dataplane/cuda/cuda_status.h"
#include "daemon/dataplane/cuda/device_guard.h"

namespace refit {

absl::StatusOr<IpcImport> IpcImport::Open(int32_t gpu, const std::string& handle,
                                          const std::string& what) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a CUDA IPC handle has ", sizeof(cudaIpcMemHandle_t), " bytes, not ", handle.size()));
  }
  DeviceGuard guard(gpu);
  if (!guard.status().ok()) return guard.status();
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof h);
  IpcImport i;
  REFIT_CUDA_RETURN_IF_ERROR(cudaIpcOpenMemHandle(&i.ptr_, h, cudaIpcMemLazyEnablePeerAccess),
                             what);
  i.gpu_ = gpu;
  return i;
}

void IpcImport::Reset() {
  if (ptr_ == nullptr) return;
  DeviceGuard guard(gpu_);
  cudaIpcCloseMemHandle(ptr_);
  ptr_ = nullptr;
}

IpcImport::~IpcImport() { Reset(); }

IpcImport::IpcImport(IpcImport&& other) noexcept : ptr_(other.ptr_), gpu_(other.gpu_) {
  other.ptr_ = nullptr;
}

IpcImport& IpcImport::operator=(IpcImport&& other) noexcept {
  if (this != &other) {
    Reset();
    ptr_ = other.ptr_;
    gpu_ = other.gpu_;
    other.ptr_ = nullptr;
  }
  return *this;
}

}  // namespace refit
