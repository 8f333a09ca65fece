#include "daemon/security/unix_callers.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/base/logging.h"

namespace refit {
namespace {

struct Record {
  absl::Mutex mu;
  absl::flat_hash_map<int, UnixCredentials> by_fd ABSL_GUARDED_BY(mu);
};

Record& Callers() {
  static Record* record = new Record;  // never destroyed: gRPC's threads may look up late
  return *record;
}

constexpr absl::string_view kFdPeer = "fd:";

}  // namespace

std::optional<UnixCredentials> UnixCallerOf(absl::string_view peer) {
  if (!absl::StartsWith(peer, kFdPeer)) return std::nullopt;
  int fd = -1;
  if (!absl::SimpleAtoi(peer.substr(kFdPeer.size()), &fd)) return std::nullopt;
  Record& r = Callers();
  absl::MutexLock lock(&r.mu);
  auto it = r.by_fd.find(fd);
  if (it == r.by_fd.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<std::unique_ptr<UnixCallerListener>> UnixCallerListener::Start(
    const std::string& path, std::function<void(int fd)> serve) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path) {
    return absl::InvalidArgumentError(
        absl::StrCat("the unix socket path \"", path, "\" is ", path.empty() ? "empty" : "too long",
                     " (at most ", sizeof addr.sun_path - 1, " bytes)"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  std::unique_ptr<UnixCallerListener> l(new UnixCallerListener(path, std::move(serve)));
  auto failed = [&](const char* what) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on unix:", path, ": ", what, ": ", std::strerror(errno)));
  };
  unlink(path.c_str());  // a stale socket from a dead daemon
  l->listener_ = Fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!l->listener_.valid()) return failed("socket");
  if (bind(l->listener_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    return failed("bind");
  if (listen(l->listener_.get(), SOMAXCONN) != 0) return failed("listen");
  int wake[2];
  if (pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) return failed("pipe");
  l->wake_read_ = Fd(wake[0]);
  l->wake_write_ = Fd(wake[1]);
  UnixCallerListener* self = l.get();
  l->thread_ = std::thread([self] { self->Loop(); });
  return l;
}

UnixCallerListener::~UnixCallerListener() {
  if (thread_.joinable()) {
    const char byte = 0;
    (void)!write(wake_write_.get(), &byte, 1);
    thread_.join();
  }
  if (listener_.valid()) unlink(path_.c_str());
}

void UnixCallerListener::Loop() {
  absl::Time error_logged = absl::InfinitePast();
  while (true) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {wake_read_.get(), POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      Logger("rpc")->error("unix:{}: poll failed: {}; no longer accepting", path_,
                           std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents == 0) continue;
    // Non-blocking, as gRPC's endpoints expect their descriptors.
    Fd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd.valid()) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) continue;
      // Out of descriptors or memory: retry shortly rather than spin, and say so now and then.
      if (absl::Now() - error_logged >= absl::Seconds(5)) {
        Logger("rpc")->warn("unix:{}: accept failed: {}; retrying", path_, std::strerror(errno));
        error_logged = absl::Now();
      }
      poll(fds + 1, 1, 100);
      if (fds[1].revents != 0) return;
      continue;
    }
    ucred cred{};
    socklen_t len = sizeof cred;
    if (getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      Logger("rpc")->warn(
          "unix:{}: a connection's credentials (SO_PEERCRED) could not be read ({}); "
          "closed",
          path_, std::strerror(errno));
      continue;
    }
    {
      Record& r = Callers();
      absl::MutexLock lock(&r.mu);
      r.by_fd[fd.get()] = {static_cast<uint32_t>(cred.uid), static_cast<int32_t>(cred.pid)};
    }
    ++accepted_;
    serve_(fd.Release());
  }
}

}  // namespace refit
