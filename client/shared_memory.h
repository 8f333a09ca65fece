// POSIX shared memory, owned: the host backend's way for a worker to expose its buffers to the
// daemon without copying. The worker creates (and on destruction unlinks) the object; the daemon
// opens and maps it by name.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "absl/status/statusor.h"

namespace refit {

class SharedMemory {
 public:
  // Creates a new object of `bytes` (zero-filled) and maps it; fails if the name exists.
  static absl::StatusOr<SharedMemory> Create(const std::string& name, size_t bytes);
  // Maps an existing object; its size must be at least `bytes`.
  static absl::StatusOr<SharedMemory> Open(const std::string& name, size_t bytes);

  SharedMemory() = default;
  SharedMemory(SharedMemory&& other) noexcept;
  SharedMemory& operator=(SharedMemory&& other) noexcept;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;
  ~SharedMemory();

  std::span<std::byte> bytes() const { return {static_cast<std::byte*>(data_), size_}; }
  // Removes the name; the memory lives on while mapped. Once the daemon has mapped a buffer, the
  // worker unlinks it, so a killed worker leaves nothing behind in /dev/shm.
  void Unlink();
  const std::string& name() const { return name_; }

 private:
  void Reset();
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;  // unlinks the name when destroyed
};

// A name no other process uses: "/refit-<pid>-<random>-<counter>-<tag>" (pids are reused).
std::string UniqueShmName(const std::string& tag);

}  // namespace refit
