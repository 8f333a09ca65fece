// A CUDA event owned: created on one GPU (with timing: the backend reads where a round's time
// went from its events), destroyed with its owner. Move-only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/statusor.h"

namespace refit {

class Event {
 public:
  Event() = default;
  static absl::StatusOr<Event> Create(int32_t gpu);
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t get() const { return event_; }
  explicit operator bool() const { return event_ != nullptr; }

 private:
  void Reset();
  cudaEvent_t event_ = nullptr;
  int32_t gpu_ = -1;
};

}  // namespace refit
