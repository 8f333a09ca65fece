// A 32-bit word in pinned, mapped host memory owned: the host writes it with a plain store and the
// GPU sees it at its device address (a stream's wait, a kernel's load) without any CUDA call. The
// cuda backend lets work it launched ahead of a round go with it (armed rounds): writing it is
// what a TRANSFER, or an abort, costs the host. Move-only.
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/status/statusor.h"

namespace refit {

class HostWord {
 public:
  HostWord() = default;
  // Zero at first; mapped for every GPU (portable), `gpu` current while allocating.
  static absl::StatusOr<HostWord> Create(int32_t gpu);
  ~HostWord();
  HostWord(HostWord&& other) noexcept;
  HostWord& operator=(HostWord&& other) noexcept;
  HostWord(const HostWord&) = delete;
  HostWord& operator=(const HostWord&) = delete;

  // Released: what the GPU reads after seeing this value was written before it.
  void Store(uint32_t value) {
    std::atomic_ref<uint32_t>(*host_).store(value, std::memory_order_release);
  }
  uint32_t Load() const {
    return std::atomic_ref<uint32_t>(*host_).load(std::memory_order_acquire);
  }
  // Where the GPU reads it.
  uint32_t* device() const { return device_; }
  explicit operator bool() const { return host_ != nullptr; }

 private:
  void Reset();
  uint32_t* host_ = nullptr;
  uint32_t* device_ = nullptr;
};

}  // namespace refit
