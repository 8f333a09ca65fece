#include "daemon/dataplane/cuda/stream.h"

#include "absl/strings/str_cat.h"
#include "daemon/dataplane/cuda/cuda_status.h"
#include "daemon/dataplane/cuda/device_guard.h"

namespace refit {

absl::StatusOr<Stream> Stream::Create(int32_t gpu, int priority) {
  DeviceGuard guard(gpu);
  if (!guard.status().ok()) return guard.status();
  Stream s;
  REFIT_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithPriority(&s.stream_, cudaStreamNonBlocking, priority),
      absl::StrCat("a stream on GPU ", gpu));
  s.gpu_ = gpu;
  return s;
}

void Stream::Reset() {
  if (stream_ == nullptr) return;
  DeviceGuard guard(gpu_);
  cudaStreamDestroy(stream_);
  stream_ = nullptr;
}

Stream::~Stream() { Reset(); }

Stream::Stream(Stream&& other) noexcept : stream_(other.stream_), gpu_(other.gpu_) {
  other.stream_ = nullptr;
}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    Reset();
    stream_ = other.stream_;
    gpu_ = other.gpu_;
    other.stream_ = nullptr;
  }
  return *this;
}

StreamFence::~StreamFence() { Wait(); }

void StreamFence::Wait() const {
  if (streams_.empty()) return;
  DeviceGuard guard;
  for (const Stream* s : streams_) {
    if (s->get() == nullptr) continue;
    guard.Set(s->gpu()).IgnoreError();  // then the sync fails harmlessly
    cudaStreamSynchronize(s->get());
  }
}

}  // namespace refit
