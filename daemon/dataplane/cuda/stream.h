// A CUDA stream owned: created on one GPU at a priority, destroyed with its owner (on that GPU).
// Move-only, so that a stream is destroyed exactly once and never while it is still named by
// another owner. And StreamFence: on destruction, waits until given streams are idle, so that
// memory declared before it in an owner (staging, copy items, events) is freed only once no work
// queued on those streams can still touch it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace refit {

class Stream {
 public:
  Stream() = default;
  // A non-blocking stream (no implicit ordering with the legacy default stream) on GPU `gpu`.
  static absl::StatusOr<Stream> Create(int32_t gpu, int priority);
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const { return stream_; }
  int32_t gpu() const { return gpu_; }

 private:
  void Reset();
  cudaStream_t stream_ = nullptr;
  int32_t gpu_ = -1;
};

class StreamFence {
 public:
  StreamFence() = default;
  ~StreamFence();
  StreamFence(StreamFence&&) = default;
  StreamFence& operator=(StreamFence&&) = default;
  StreamFence(const StreamFence&) = delete;
  StreamFence& operator=(const StreamFence&) = delete;

  // `stream` (not owned) must outlive the fence.
  void Add(const Stream& stream) { streams_.push_back(&stream); }
  // Waits now (the destructor waits again: nothing is queued by then, so that costs little).
  void Wait() const;

 private:
  std::vector<const Stream*> streams_;
};

}  // namespace refit
