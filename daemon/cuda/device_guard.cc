#include "daemon/cuda/device_guard.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "daemon/cuda/cuda_status.h"
#include "daemon/cuda_driver.h"

namespace refit {

DeviceGuard::DeviceGuard() {
  // Only a thread with a current context has a device to go back to (cudaGetDevice answers 0
  // either way). Without the driver's entry points nothing can be current: nothing to restore.
  auto driver = CudaDriver::Get();
  if (!driver.ok()) return;
  CUcontext context = nullptr;
  if ((*driver)->CtxGetCurrent(&context) != CUDA_SUCCESS || context == nullptr) return;
  int device = -1;
  if (cudaGetDevice(&device) == cudaSuccess) previous_ = device;
}

DeviceGuard::DeviceGuard(int32_t gpu) : DeviceGuard() { status_ = Set(gpu); }

absl::Status DeviceGuard::Set(int32_t gpu) {
  REFIT_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), absl::StrCat("cudaSetDevice(", gpu, ")"));
  return absl::OkStatus();
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace refit
