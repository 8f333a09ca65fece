#include "daemon/dataplane/cuda/device_guard.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "daemon/dataplane/cuda/cuda_driver.h"
#include "daemon/dataplane/cuda/cuda_status.h"

namespace refit {

namespace {

// The thread's current device, or -1 when it has no current context (nothing to go back to:
// cudaGetDevice answers 0 either way; without the driver's entry points nothing can be current).
int CurrentDevice() {
  auto driver = CudaDriver::Get();
  if (!driver.ok()) return -1;
  CUcontext context = nullptr;
  if ((*driver)->CtxGetCurrent(&context) != CUDA_SUCCESS || context == nullptr) return -1;
  int device = -1;
  return cudaGetDevice(&device) == cudaSuccess ? device : -1;
}

}  // namespace

DeviceGuard::DeviceGuard() = default;

DeviceGuard::DeviceGuard(int32_t gpu) { status_ = Set(gpu); }

absl::Status DeviceGuard::Set(int32_t gpu) {
  if (!remembered_) {
    remembered_ = true;
    previous_ = CurrentDevice();
  }
  REFIT_CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), absl::StrCat("cudaSetDevice(", gpu, ")"));
  return absl::OkStatus();
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace refit
