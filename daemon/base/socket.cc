#include "daemon/base/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace refit {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

absl::StatusOr<sockaddr_in> Resolve(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("\"", address, "\" is not a host:port address"));
  }
  std::string host = address.substr(0, colon);
  if (host.empty() || host == "localhost") host = "127.0.0.1";
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("cannot resolve host \"", host, "\""));
    }
    sa.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
    freeaddrinfo(res);
  }
  return sa;
}

int MillisUntil(absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  return ms <= 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

}  // namespace

absl::Status WaitReady(int fd, short events, absl::Time deadline, const std::string& what) {
  while (true) {
    pollfd p{fd, events, 0};
    const int ms = MillisUntil(deadline);
    const int r = poll(&p, 1, ms);
    if (r > 0) return absl::OkStatus();
    if (r == 0) return absl::DeadlineExceededError(absl::StrCat(what, ": deadline exceeded"));
    if (errno != EINTR) return Errno(what);
  }
}

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    Close();
    fd_ = o.Release();
  }
  return *this;
}

int Fd::Release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void Fd::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

void Fd::Shutdown() {
  if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
}

absl::StatusOr<std::pair<Fd, std::string>> TcpListen(const std::string& address) {
  auto sa = Resolve(address);
  if (!sa.ok()) return sa.status();
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Errno("socket");
  const int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&*sa), sizeof *sa) != 0) {
    return Errno(absl::StrCat("bind ", address));
  }
  if (listen(fd.get(), 128) != 0) return Errno(absl::StrCat("listen ", address));
  sockaddr_in bound{};
  socklen_t len = sizeof bound;
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
  char host[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &bound.sin_addr, host, sizeof host);
  return std::make_pair(std::move(fd), absl::StrCat(host, ":", ntohs(bound.sin_port)));
}

absl::StatusOr<Fd> TcpAccept(const Fd& listener) {
  while (true) {
    const int fd = accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return Fd(fd);
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    return Errno("accept");
  }
}

absl::StatusOr<Fd> TcpConnect(const std::string& address, absl::Time deadline) {
  auto sa = Resolve(address);
  if (!sa.ok()) return sa.status();
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return Errno("socket");
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&*sa), sizeof *sa) != 0) {
    if (errno != EINPROGRESS) return Errno(absl::StrCat("connect to ", address));
    if (auto s = WaitReady(fd.get(), POLLOUT, deadline, absl::StrCat("connect to ", address));
        !s.ok()) {
      return s;
    }
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      errno = err;
      return Errno(absl::StrCat("connect to ", address));
    }
  }
  const int one = 1;
  setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

absl::Status SendAll(const Fd& fd, std::span<const std::byte> data, absl::Time deadline,
                     const std::string& peer) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n =
        send(fd.get(), data.data() + done, data.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (auto s = WaitReady(fd.get(), POLLOUT, deadline, absl::StrCat("sending to ", peer));
          !s.ok()) {
        return s;
      }
      continue;
    }
    return Errno(absl::StrCat("sending to ", peer));
  }
  return absl::OkStatus();
}

absl::Status RecvAll(const Fd& fd, std::span<std::byte> data, absl::Time deadline,
                     const std::string& peer) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = recv(fd.get(), data.data() + done, data.size() - done, MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) {
      return absl::UnavailableError(absl::StrCat(peer, " closed the connection"));
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (auto s = WaitReady(fd.get(), POLLIN, deadline, absl::StrCat("receiving from ", peer));
          !s.ok()) {
        return s;
      }
      continue;
    }
    return Errno(absl::StrCat("receiving from ", peer));
  }
  return absl::OkStatus();
}

}  // namespace refit
