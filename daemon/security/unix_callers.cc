#include "daemon/security/unix_callers.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
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
    const std::string& path, std::function<void(int fd)> serve, absl::Duration first_byte_timeout,
    ServedLimits limits) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path) {
    return absl::InvalidArgumentError(
        absl::StrCat("the unix socket path \"", path, "\" is ", path.empty() ? "empty" : "too long",
                     " (at most ", sizeof addr.sun_path - 1, " bytes)"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  std::unique_ptr<UnixCallerListener> l(
      new UnixCallerListener(path, std::move(serve), first_byte_timeout, limits));
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
  std::vector<pollfd> fds;
  bool can_accept = true;
  while (true) {
    fds.assign({{listener_.get(), static_cast<short>(can_accept ? POLLIN : 0), 0},
                {wake_read_.get(), POLLIN, 0}});
    absl::Time next = absl::InfiniteFuture();
    for (const Waiting& w : waiting_) {
      fds.push_back({w.fd.get(), POLLIN, 0});
      next = std::min(next, w.deadline);
    }
    // Out of descriptors: try accepting again in 100 ms rather than spin on the ready listener.
    if (!can_accept) next = std::min(next, absl::Now() + absl::Milliseconds(100));
    int timeout_ms = -1;
    if (next != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(std::max<int64_t>(
          0, absl::ToInt64Milliseconds(next - absl::Now() + absl::Milliseconds(1))));
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      Logger("rpc")->error("unix:{}: poll failed: {}; no longer accepting", path_,
                           std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    Settle(absl::MakeConstSpan(fds).subspan(2));
    can_accept = true;
    if (fds[0].revents != 0) can_accept = AcceptPending();
  }
}

bool UnixCallerListener::AcceptPending() {
  for (size_t n = 0; n < kMaxAcceptsPerWake; ++n) {
    // Non-blocking, as gRPC's endpoints expect their descriptors.
    Fd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd.valid()) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN) return true;
      if (absl::Now() - error_logged_ >= absl::Seconds(5)) {
        Logger("rpc")->warn("unix:{}: accept failed: {}; retrying", path_, std::strerror(errno));
        error_logged_ = absl::Now();
      }
      return false;
    }
    ucred cred{};
    socklen_t len = sizeof cred;
    if (getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      Logger("rpc")->warn(
          "unix:{}: a connection's credentials (SO_PEERCRED) could not be read ({}); closed", path_,
          std::strerror(errno));
      continue;
    }
    const UnixCredentials credentials{static_cast<uint32_t>(cred.uid),
                                      static_cast<int32_t>(cred.pid)};
    // A client writes before it is accepted (gRPC its preface): served at once, never waiting
    // behind, or evicted by, connections that said nothing.
    char byte = 0;
    const ssize_t peeked = recv(fd.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (peeked == 1) {
      Serve(std::move(fd), credentials);
      continue;
    }
    if (peeked == 0) continue;  // gone before it said anything
    if (waiting_.size() >= kMaxWaiting) EvictOne();
    ++waiting_of_uid_[credentials.uid];
    waiting_.push_back({std::move(fd), credentials, absl::Now() + first_byte_timeout_});
  }
  return true;
}

void UnixCallerListener::EvictOne() {
  // The oldest connection of the user with the most waiting: a storm of one user closes its own.
  uint32_t uid = 0;
  int most = 0;
  for (const auto& [u, n] : waiting_of_uid_) {
    if (n > most) {
      uid = u;
      most = n;
    }
  }
  auto it = std::find_if(waiting_.begin(), waiting_.end(),
                         [uid](const Waiting& w) { return w.credentials.uid == uid; });
  if (it == waiting_.end()) it = waiting_.begin();
  CloseSilent(*it, "and its user held the most of the connections waiting when one more came");
  Forget(it->credentials.uid);
  waiting_.erase(it);
}

void UnixCallerListener::Forget(uint32_t uid) {
  auto it = waiting_of_uid_.find(uid);
  if (it != waiting_of_uid_.end() && --it->second <= 0) waiting_of_uid_.erase(it);
}

ServedLimits ServedLimits::ForDescriptorLimit() {
  rlimit nofile{};
  if (getrlimit(RLIMIT_NOFILE, &nofile) != 0 || nofile.rlim_cur == RLIM_INFINITY) return {};
  const auto n = static_cast<size_t>(nofile.rlim_cur);
  return {std::clamp<size_t>(n / 8, 64, 1024), std::clamp<size_t>(n / 2, 256, 8192)};
}

void UnixCallerListener::Recount() {
  recounted_ = absl::Now();
  for (auto it = served_.begin(); it != served_.end();) {
    struct stat st {};
    if (fstat(it->first, &st) == 0 && static_cast<uint64_t>(st.st_dev) == it->second.device &&
        static_cast<uint64_t>(st.st_ino) == it->second.inode) {
      ++it;
      continue;
    }
    auto n = served_of_uid_.find(it->second.uid);
    if (n != served_of_uid_.end() && --n->second == 0) served_of_uid_.erase(n);
    served_.erase(it++);
  }
}

bool UnixCallerListener::MayServe(uint32_t uid) {
  auto within = [&] {
    auto n = served_of_uid_.find(uid);
    return served_.size() < limits_.total &&
           (n == served_of_uid_.end() || n->second < limits_.per_uid);
  };
  if (within()) return true;
  if (absl::Now() - recounted_ >= kRecountEvery) Recount();
  return within();
}

void UnixCallerListener::Serve(Fd fd, const UnixCredentials& credentials) {
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return;
  // A descriptor number gRPC closed and accept reused: its old connection is gone.
  if (auto old = served_.find(fd.get()); old != served_.end()) {
    auto n = served_of_uid_.find(old->second.uid);
    if (n != served_of_uid_.end() && --n->second == 0) served_of_uid_.erase(n);
    served_.erase(old);
  }
  if (!MayServe(credentials.uid)) {
    ++closed_over_limit_;
    if (absl::Now() - limit_logged_ >= absl::Seconds(5)) {
      const auto n = served_of_uid_.find(credentials.uid);
      Logger("rpc")->warn(
          "unix:{}: a connection of uid {} (pid {}) closed: that user holds {} connections (at "
          "most "
          "{} per user), all users {} (at most {})",
          path_, credentials.uid, credentials.pid, n == served_of_uid_.end() ? 0 : n->second,
          limits_.per_uid, served_.size(), limits_.total);
      limit_logged_ = absl::Now();
    }
    return;
  }
  served_[fd.get()] = {credentials.uid, static_cast<uint64_t>(st.st_dev),
                       static_cast<uint64_t>(st.st_ino)};
  ++served_of_uid_[credentials.uid];
  {
    Record& r = Callers();
    absl::MutexLock lock(&r.mu);
    r.by_fd[fd.get()] = credentials;
  }
  ++accepted_;
  serve_(fd.Release());  // its first bytes stay in the socket for gRPC to read
}

void UnixCallerListener::Settle(absl::Span<const pollfd> polled) {
  const absl::Time now = absl::Now();
  size_t kept = 0;
  for (size_t i = 0; i < waiting_.size(); ++i) {
    Waiting& w = waiting_[i];
    const short ready = polled[i].revents;
    if ((ready & (POLLHUP | POLLERR | POLLNVAL)) != 0) {
      w.fd.Close();  // gone (its peer closed: readable too, at its end)
    } else if ((ready & POLLIN) != 0) {
      Serve(std::move(w.fd), w.credentials);
    } else if (now >= w.deadline) {
      CloseSilent(w, "within its first-byte deadline");
    } else {
      if (kept != i) waiting_[kept] = std::move(w);
      ++kept;
      continue;
    }
    Forget(w.credentials.uid);
  }
  waiting_.resize(kept);
}

void UnixCallerListener::CloseSilent(Waiting& w, const char* why) {
  ++closed_silent_;
  if (absl::Now() - error_logged_ >= absl::Seconds(5)) {
    Logger("rpc")->warn("unix:{}: a connection of uid {} (pid {}) sent nothing {}; closed", path_,
                        w.credentials.uid, w.credentials.pid, why);
    error_logged_ = absl::Now();
  }
  w.fd.Close();
}

}  // namespace refit
