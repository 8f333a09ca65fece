// POSIX shared memory, owned: the host backend's way for a worker to expose its buffers to the
// daemon without copying: an anonymous object (memfd) whose descriptor the worker hands to the
// daemon over its handle socket (daemon/README.md): no name any other process could open, and the
// worker can hand it again to a restarted daemon. The daemon never opens an object by name
// (Create/Open remain for tools and tests that need a named object, e.g. to show it refused).
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
  // Creates an anonymous object (memfd, named `tag` in /proc) of `bytes` (zero-filled), sealed
  // against shrinking and growing (so that a process mapping it can never fault past its end),
  // and maps it. Its descriptor stays open: fd().
  static absl::StatusOr<SharedMemory> CreateAnonymous(const std::string& tag, size_t bytes);
  // Maps all of the object behind `fd` (a memfd or a POSIX shared-memory object, open for reading
  // and writing), as large as fstat says it is now; the descriptor is not kept. `what` names it
  // in errors.
  static absl::StatusOr<SharedMemory> MapDescriptor(int fd, const std::string& what);
  // The same, but INVALID_ARGUMENT (nothing mapped) for an object larger than `max_bytes`.
  static absl::StatusOr<SharedMemory> MapDescriptor(int fd, const std::string& what,
                                                    size_t max_bytes);
  // Makes sure the object behind `fd` can never shrink: a process mapping it would die of SIGBUS
  // touching pages a truncate took away. Adds F_SEAL_SHRINK to a memfd that allows sealing;
  // INVALID_ARGUMENT, saying why, for one that cannot be sealed (a shm_open object or other file;
  // a memfd sealed with F_SEAL_SEAL but not F_SEAL_SHRINK; one not open for writing) or is not a
  // regular file at all. `what` names it in errors. Call it before mapping.
  static absl::Status SealAgainstShrinking(int fd, const std::string& what);

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
  // CreateAnonymous: the object's descriptor, owned (closed on destruction); else -1.
  int fd() const { return fd_; }
  // The object cannot shrink (F_SEAL_SHRINK): a truncate by its creator cannot make this
  // mapping's pages vanish (a process touching a vanished page dies of SIGBUS).
  bool sealed_against_shrinking() const { return shrink_sealed_; }

 private:
  void Reset();
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;  // unlinks the name when destroyed
  int fd_ = -1;
  bool shrink_sealed_ = false;
};

// A name no other process uses: "/refit-<pid>-<random>-<counter>-<tag>" (pids are reused).
std::string UniqueShmName(const std::string& tag);

}  // namespace refit
