// The current GPU for a scope. CUDA's current device is per thread and every runtime call acts
// on it, so code that switches GPUs (the backend serves several) must not leave a caller's thread
// on another one: the guard remembers the device current when it first switches (Set) and makes
// it current again when it goes. A thread that had no CUDA context yet is left on the last GPU set
// rather than "restored" to device 0, which would create a context (and spend GPU memory) on a GPU
// this daemon may not serve. A guard that never switched costs nothing: an armed round's transfer
// makes no CUDA call before it lets the work go, and the first calls after an idle spell took
// 3-18 us each on an H200 host's VM (docs/BENCHMARKS.md). Otherwise two driver queries at the first
// Set, one cudaSetDevice when gone; the hot path makes one guard per call and switches with Set().
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace refit {

class DeviceGuard {
 public:
  DeviceGuard();                      // switches nothing (yet)
  explicit DeviceGuard(int32_t gpu);  // remembers, then Set(gpu): see status()
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  // Makes GPU `gpu` current until the next Set or the guard's end.
  absl::Status Set(int32_t gpu);
  // The constructor's Set, when given a GPU.
  const absl::Status& status() const { return status_; }

 private:
  bool remembered_ = false;  // the device before the first Set
  int previous_ = -1;        // -1: nothing to restore
  absl::Status status_;
};

}  // namespace refit
