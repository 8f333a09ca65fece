#include "daemon/dataplane/cuda/staging.h"

#include "absl/strings/str_cat.h"
#include "daemon/dataplane/cuda/cuda_status.h"
#include "daemon/dataplane/cuda/device_guard.h"

namespace refit {

absl::StatusOr<StagingBuffer> StagingBuffer::Allocate(int32_t gpu, size_t bytes, bool nccl_memory) {
  StagingBuffer s;
  s.bytes_ = bytes;
  s.gpu_ = gpu;
  if (!nccl_memory) {
    auto m = DeviceMemory::Allocate(gpu, bytes);
    if (!m.ok())
      return absl::Status(m.status().code(), absl::StrCat("staging of ", bytes, " bytes on GPU ",
                                                          gpu, ": ", m.status().message()));
    s.cuda_ = *std::move(m);
    return s;
  }
  DeviceGuard guard(gpu);
  if (!guard.status().ok()) return guard.status();
  void* p = nullptr;
  if (auto e = NcclError(ncclMemAlloc(&p, bytes),
                         absl::StrCat("ncclMemAlloc of ", bytes, " bytes of staging on GPU ", gpu));
      !e.ok()) {
    return e;
  }
  s.nccl_ptr_ = p;
  return s;
}

void StagingBuffer::Reset() {
  if (nccl_ptr_ != nullptr) {
    DeviceGuard guard(gpu_);
    ncclMemFree(nccl_ptr_);
    nccl_ptr_ = nullptr;
  }
  cuda_ = DeviceMemory();
}

StagingBuffer::~StagingBuffer() { Reset(); }

StagingBuffer::StagingBuffer(StagingBuffer&& other) noexcept
    : cuda_(std::move(other.cuda_)),
      nccl_ptr_(other.nccl_ptr_),
      bytes_(other.bytes_),
      gpu_(other.gpu_) {
  other.nccl_ptr_ = nullptr;
}

StagingBuffer& StagingBuffer::operator=(StagingBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    cuda_ = std::move(other.cuda_);
    nccl_ptr_ = other.nccl_ptr_;
    bytes_ = other.bytes_;
    gpu_ = other.gpu_;
    other.nccl_ptr_ = nullptr;
  }
  return *this;
}

}  // namespace refit
