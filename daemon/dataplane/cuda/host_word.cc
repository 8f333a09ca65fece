#include "daemon/dataplane/cuda/host_word.h"

#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/dataplane/cuda/cuda_status.h"
#include "daemon/dataplane/cuda/device_guard.h"

namespace refit {

absl::StatusOr<HostWord> HostWord::Create(int32_t gpu) {
  DeviceGuard guard(gpu);
  if (!guard.status().ok()) return guard.status();
  HostWord w;
  void* host = nullptr;
  REFIT_CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(&host, sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable),
      absl::StrCat("a mapped host word for GPU ", gpu));
  w.host_ = static_cast<uint32_t*>(host);
  *w.host_ = 0;
  void* device = nullptr;
  REFIT_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device, host, 0),
                             absl::StrCat("the device address of a host word on GPU ", gpu));
  w.device_ = static_cast<uint32_t*>(device);
  return w;
}

void HostWord::Reset() {
  if (host_ != nullptr) cudaFreeHost(host_);
  host_ = nullptr;
  device_ = nullptr;
}

HostWord::~HostWord() { Reset(); }

HostWord::HostWord(HostWord&& other) noexcept
    : host_(std::exchange(other.host_, nullptr)), device_(std::exchange(other.device_, nullptr)) {}

HostWord& HostWord::operator=(HostWord&& other) noexcept {
  if (this != &other) {
    Reset();
    host_ = std::exchange(other.host_, nullptr);
    device_ = std::exchange(other.device_, nullptr);
  }
  return *this;
}

}  // namespace refit
