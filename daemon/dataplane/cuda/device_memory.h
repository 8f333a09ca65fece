// GPU memory owned: cudaMalloc on one GPU, cudaFree with its owner (on that GPU). Move-only.
// The backend keeps each GPU's copy items of a plan in one of these.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"

namespace refit {

class DeviceMemory {
 public:
  DeviceMemory() = default;
  static absl::StatusOr<DeviceMemory> Allocate(int32_t gpu, size_t bytes);
  ~DeviceMemory();
  DeviceMemory(DeviceMemory&& other) noexcept;
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  void* get() const { return ptr_; }
  size_t size() const { return bytes_; }

 private:
  void Reset();
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  int32_t gpu_ = -1;
};

}  // namespace refit
