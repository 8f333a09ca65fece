#include "daemon/dataplane/cuda/device_memory.h"

#include "absl/strings/str_cat.h"
#include "daemon/dataplane/cuda/cuda_status.h"
#include "daemon/dataplane/cuda/device_guard.h"

namespace refit {

absl::StatusOr<DeviceMemory> DeviceMemory::Allocate(int32_t gpu, size_t bytes) {
  DeviceGuard guard(gpu);
  if (!guard.status().ok()) return guard.status();
  DeviceMemory m;
  REFIT_CUDA_RETURN_IF_ERROR(cudaMalloc(&m.ptr_, bytes),
                             absl::StrCat("cudaMalloc of ", bytes, " bytes on GPU ", gpu));
  m.bytes_ = bytes;
  m.gpu_ = gpu;
  return m;
}

void DeviceMemory::Reset() {
  if (ptr_ == nullptr) return;
  DeviceGuard guard(gpu_);
  cudaFree(ptr_);
  ptr_ = nullptr;
}

DeviceMemory::~DeviceMemory() { Reset(); }

DeviceMemory::DeviceMemory(DeviceMemory&& other) noexcept
    : ptr_(other.ptr_), bytes_(other.bytes_), gpu_(other.gpu_) {
  other.ptr_ = nullptr;
}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
    gpu_ = other.gpu_;
    other.ptr_ = nullptr;
  }
  return *this;
}

}  // namespace refit
