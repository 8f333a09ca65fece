// One GPU's staging for a group's network steps: the bytes packed before a send and received
// before an unpack. From cudaMalloc, or, where staging is registered with NCCL
// (--nccl-register), from ncclMemAlloc, whose memory NCCL can register for zero-copy transports;
// freed the same way it was allocated. The registration itself belongs to the communicator
// (NodeCommunicator::Register): a registration dies with its communicator, while staging lives
// as long as its plan. Move-only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "daemon/dataplane/cuda/device_memory.h"

namespace refit {

class StagingBuffer {
 public:
  StagingBuffer() = default;
  // `nccl_memory`: from ncclMemAlloc (to be registered with NCCL), else cudaMalloc.
  static absl::StatusOr<StagingBuffer> Allocate(int32_t gpu, size_t bytes, bool nccl_memory);
  ~StagingBuffer();
  StagingBuffer(StagingBuffer&& other) noexcept;
  StagingBuffer& operator=(StagingBuffer&& other) noexcept;
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  void* get() const { return nccl_ptr_ != nullptr ? nccl_ptr_ : cuda_.get(); }
  size_t size() const { return bytes_; }
  bool nccl_memory() const { return nccl_ptr_ != nullptr; }

 private:
  void Reset();
  DeviceMemory cuda_;         // cudaMalloc'ed staging
  void* nccl_ptr_ = nullptr;  // or ncclMemAlloc'ed staging
  size_t bytes_ = 0;
  int32_t gpu_ = -1;
};

}  // namespace refit
