// TCP sockets for the host data plane: an owned file descriptor, and reads and writes that end
// by a deadline instead of hanging on a dead peer.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace refit {

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.Release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { Close(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release();
  void Close();
  // Wakes a thread blocked in poll/accept on this socket (shutdown, not close: the fd stays owned).
  void Shutdown();

 private:
  int fd_ = -1;
};

// Listens on "host:port" (port 0: any free port). Returns the socket and the bound "host:port".
absl::StatusOr<std::pair<Fd, std::string>> TcpListen(const std::string& address);
// Accepts one connection; UNAVAILABLE when the listener was shut down.
absl::StatusOr<Fd> TcpAccept(const Fd& listener);
// Waits until `fd` is ready for poll(2) `events`; DEADLINE_EXCEEDED past the deadline (the message
// begins with `what`).
absl::Status WaitReady(int fd, short events, absl::Time deadline, const std::string& what);

absl::StatusOr<Fd> TcpConnect(const std::string& address, absl::Time deadline);

// Write or read exactly the span, or fail: DEADLINE_EXCEEDED, or UNAVAILABLE when the peer
// closed the connection (the message says which peer, through `peer`).
absl::Status SendAll(const Fd& fd, std::span<const std::byte> data, absl::Time deadline,
                     const std::string& peer);
absl::Status RecvAll(const Fd& fd, std::span<std::byte> data, absl::Time deadline,
                     const std::string& peer);

}  // namespace refit
