#include "common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace refit {
namespace {

absl::Status Errno(const std::string& what) {
  const int e = errno;
  const std::string message = absl::StrCat(what, ": ", std::strerror(e));
  if (e == ENOENT) return absl::NotFoundError(message);
  if (e == EEXIST) return absl::AlreadyExistsError(message);
  if (e == EACCES || e == EPERM) return absl::PermissionDeniedError(message);
  return absl::InternalError(message);
}

}  // namespace

absl::StatusOr<SharedMemory> SharedMemory::Create(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return Errno(absl::StrCat("shm_open(\"", name, "\")"));
  SharedMemory m;
  m.name_ = name;
  m.owner_ = true;
  const size_t size = bytes == 0 ? 1 : bytes;  // mmap refuses 0 bytes
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    auto s = Errno(absl::StrCat("ftruncate(\"", name, "\", ", size, ")"));
    close(fd);
    shm_unlink(name.c_str());
    return s;
  }
  void* data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (data == MAP_FAILED) {
    shm_unlink(name.c_str());
    return Errno(absl::StrCat("mmap(\"", name, "\")"));
  }
  m.data_ = data;
  m.size_ = size;
  return m;
}

absl::StatusOr<SharedMemory> SharedMemory::Open(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return Errno(absl::StrCat("shm_open(\"", name, "\")"));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    auto s = Errno(absl::StrCat("fstat(\"", name, "\")"));
    close(fd);
    return s;
  }
  if (static_cast<size_t>(st.st_size) < bytes || st.st_size == 0) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shared memory \"", name, "\" has ", st.st_size,
                                                   " bytes; ", bytes, " are needed"));
  }
  void* data = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (data == MAP_FAILED) return Errno(absl::StrCat("mmap(\"", name, "\")"));
  SharedMemory m;
  m.name_ = name;
  m.data_ = data;
  m.size_ = static_cast<size_t>(st.st_size);
  return m;
}

absl::StatusOr<SharedMemory> SharedMemory::CreateAnonymous(const std::string& tag, size_t bytes) {
  const int fd = memfd_create(absl::StrCat("refit-", tag).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Errno(absl::StrCat("memfd_create(\"", tag, "\")"));
  SharedMemory m;
  m.name_ = absl::StrCat("memfd:refit-", tag);
  m.fd_ = fd;                                  // owned from here on: every failure below closes it
  const size_t size = bytes == 0 ? 1 : bytes;  // mmap refuses 0 bytes
  if (ftruncate(fd, static_cast<off_t>(size)) != 0)
    return Errno(absl::StrCat("ftruncate(", m.name_, ", ", size, ")"));
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return Errno(absl::StrCat("sealing ", m.name_));
  }
  m.shrink_sealed_ = true;
  void* data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) return Errno(absl::StrCat("mmap(", m.name_, ")"));
  m.data_ = data;
  m.size_ = size;
  return m;
}

absl::StatusOr<SharedMemory> SharedMemory::MapDescriptor(int fd, const std::string& what) {
  return MapDescriptor(fd, what, SIZE_MAX);
}

absl::StatusOr<SharedMemory> SharedMemory::MapDescriptor(int fd, const std::string& what,
                                                         size_t max_bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0) return Errno(absl::StrCat("fstat(", what, ")"));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not a shared-memory object or memfd (a socket, pipe or device?)"));
  }
  if (st.st_size <= 0) return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " has ", st.st_size, " bytes, more than the ", max_bytes, " it may have here"));
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0) return Errno(absl::StrCat("fcntl(", what, ")"));
  if ((flags & O_ACCMODE) != O_RDWR) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not open for reading and writing (O_RDWR)"));
  }
  void* data =
      mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) return Errno(absl::StrCat("mmap(", what, ")"));
  SharedMemory m;
  m.name_ = what;
  m.data_ = data;
  m.size_ = static_cast<size_t>(st.st_size);
  const int seals = fcntl(fd, F_GET_SEALS);  // EINVAL: a file that cannot be sealed (shm_open)
  m.shrink_sealed_ = seals >= 0 && (seals & F_SEAL_SHRINK) != 0;
  return m;
}

absl::Status SharedMemory::SealAgainstShrinking(int fd, const std::string& what) {
  constexpr absl::string_view kWhy =
      ": a truncate by its owner would crash the daemon (SIGBUS); hand over a memfd "
      "made with MFD_ALLOW_SEALING (or sealed with F_SEAL_SHRINK)";
  struct stat st;
  if (fstat(fd, &st) != 0) return Errno(absl::StrCat("fstat(", what, ")"));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not a shared-memory object or memfd (a socket, pipe or device?)"));
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    // EINVAL: the file system has no seals (ordinary files).
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     " cannot be sealed against shrinking (its file system "
                     "has no seals: not a memfd)",
                     kWhy));
  }
  if (seals & F_SEAL_SHRINK) return absl::OkStatus();
  if (seals & F_SEAL_SEAL) {
    // Linux gives shm_open's /dev/shm objects F_SEAL_SEAL from the start, as it does memfds made
    // without MFD_ALLOW_SEALING: the two cannot be told apart, and neither can be sealed.
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     " cannot be sealed against shrinking (F_SEAL_SEAL without "
                     "F_SEAL_SHRINK: a shm_open object, or a memfd made without "
                     "MFD_ALLOW_SEALING)",
                     kWhy));
  }
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    const int e = errno;  // EPERM: not open for writing
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": sealing it against shrinking failed (", std::strerror(e), ")", kWhy));
  }
  return absl::OkStatus();
}

SharedMemory::SharedMemory(SharedMemory&& other) noexcept { *this = std::move(other); }

SharedMemory& SharedMemory::operator=(SharedMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    data_ = other.data_;
    size_ = other.size_;
    owner_ = other.owner_;
    fd_ = other.fd_;
    shrink_sealed_ = other.shrink_sealed_;
    other.data_ = nullptr;
    other.size_ = 0;
    other.owner_ = false;
    other.fd_ = -1;
    other.shrink_sealed_ = false;
  }
  return *this;
}

SharedMemory::~SharedMemory() { Reset(); }

void SharedMemory::Reset() {
  if (data_ != nullptr) munmap(data_, size_);
  if (owner_) shm_unlink(name_.c_str());
  if (fd_ >= 0) close(fd_);
  data_ = nullptr;
  size_ = 0;
  owner_ = false;
  fd_ = -1;
  shrink_sealed_ = false;
}

void SharedMemory::Unlink() {
  if (owner_) shm_unlink(name_.c_str());
  owner_ = false;
}

std::string UniqueShmName(const std::string& tag) {
  static std::atomic<int64_t> counter{0};
  static const uint64_t salt = std::random_device()() ^ (uint64_t{std::random_device()()} << 32);
  return absl::StrCat("/refit-", getpid(), "-", absl::Hex(salt), "-", counter++, "-", tag);
}

}  // namespace refit
