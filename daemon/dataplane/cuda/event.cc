#include "daemon/dataplane/cuda/event.h"

#include "absl/strings/str_cat.h"
#include "daemon/dataplane/cuda/cuda_status.h"
#include "daemon/dataplane/cuda/device_guard.h"

namespace refit {

absl::StatusOr<Event> Event::Create(int32_t gpu) {
  DeviceGuard guard(gpu);
  if (!guard.status().ok()) return guard.status();
  Event e;
  REFIT_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e.event_),
                             absl::StrCat("cudaEventCreate on GPU ", gpu));
  e.gpu_ = gpu;
  return e;
}

void Event::Reset() {
  if (event_ == nullptr) return;
  DeviceGuard guard(gpu_);
  cudaEventDestroy(event_);
  event_ = nullptr;
}

Event::~Event() { Reset(); }

Event::Event(Event&& other) noexcept : event_(other.event_), gpu_(other.gpu_) {
  other.event_ = nullptr;
}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    Reset();
    event_ = other.event_;
    gpu_ = other.gpu_;
    other.event_ = nullptr;
  }
  return *this;
}

}  // namespace refit
