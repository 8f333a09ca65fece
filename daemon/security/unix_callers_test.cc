#include "daemon/security/unix_callers.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"

namespace refit {
namespace {

// Connects, and unless `silent` sends a byte (a gRPC client sends its HTTP/2 preface at once).
Fd Connect(const std::string& path, bool silent = false) {
  Fd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return Fd();
  if (!silent && write(fd.get(), "P", 1) != 1) return Fd();
  return fd;
}

// Whether the listener closed `fd` within `seconds` (a read sees the end).
bool ClosedWithin(const Fd& fd, double seconds) {
  timeval tv{static_cast<time_t>(seconds),
             static_cast<suseconds_t>((seconds - static_cast<int>(seconds)) * 1e6)};
  setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char byte;
  // Closed with what it sent unread: a reset.
  const ssize_t n = read(fd.get(), &byte, 1);
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

struct Handed {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> fds;
  int Next() {
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, std::chrono::seconds(5), [&] { return !fds.empty(); }));
    const int fd = fds.front();
    fds.erase(fds.begin());
    return fd;
  }
  size_t Count() {
    std::lock_guard<std::mutex> lock(mu);
    return fds.size();
  }
  std::function<void(int)> Serve() {
    return [this](int fd) {
      std::lock_guard<std::mutex> lock(mu);
      fds.push_back(fd);
      cv.notify_all();
    };
  }
};

TEST_CASE("each connection is handed over with the uid and pid the kernel gives it") {
  const std::string path = absl::StrCat("/tmp/refit-unix-callers-", getpid(), ".sock");
  Handed handed;
  auto listener = UnixCallerListener::Start(path, handed.Serve());
  REQUIRE(listener.ok());
  CHECK(access(path.c_str(), F_OK) == 0);

  Fd a = Connect(path), b = Connect(path);
  REQUIRE(a.valid());
  REQUIRE(b.valid());
  for (int i = 0; i < 2; ++i) {
    Fd served(handed.Next());
    const auto who = UnixCallerOf(absl::StrCat("fd:", served.get()));
    REQUIRE(who.has_value());
    CHECK(who->uid == static_cast<uint32_t>(geteuid()));
    CHECK(who->pid == getpid());
    // Handed over non-blocking, as gRPC's endpoints expect.
    CHECK((fcntl(served.get(), F_GETFL) & O_NONBLOCK) != 0);
  }
  CHECK((*listener)->accepted() == 2);

  // Other peers are not its callers.
  CHECK_FALSE(UnixCallerOf("unix:").has_value());
  CHECK_FALSE(UnixCallerOf("ipv4:127.0.0.1:5000").has_value());
  CHECK_FALSE(UnixCallerOf("fd:notanumber").has_value());

  // Stopping removes the socket, and nothing connects any more.
  listener->reset();
  CHECK(access(path.c_str(), F_OK) != 0);
  CHECK_FALSE(Connect(path).valid());
}

TEST_CASE(
    "a connection that sends nothing is closed at its first-byte deadline, never handed over") {
  const std::string path = absl::StrCat("/tmp/refit-unix-silent-", getpid(), ".sock");
  Handed handed;
  auto listener = UnixCallerListener::Start(path, handed.Serve(), absl::Milliseconds(300));
  REQUIRE(listener.ok());
  Fd silent = Connect(path, /*silent=*/true);
  REQUIRE(silent.valid());
  Fd speaks = Connect(path);
  REQUIRE(speaks.valid());
  Fd served(handed.Next());  // the one that spoke, at once
  CHECK(UnixCallerOf(absl::StrCat("fd:", served.get())).has_value());
  char byte = 0;
  CHECK(read(served.get(), &byte, 1) == 1);  // its first byte is left for the server to read
  CHECK(byte == 'P');
  CHECK(ClosedWithin(silent, 3.0));
  CHECK((*listener)->closed_silent() == 1);
  CHECK((*listener)->accepted() == 1);
  CHECK(handed.Count() == 0);

  // A connection that speaks late, within its deadline, is still handed over.
  Fd late = Connect(path, /*silent=*/true);
  REQUIRE(late.valid());
  usleep(100 * 1000);
  REQUIRE(write(late.get(), "P", 1) == 1);
  Fd served_late(handed.Next());
  CHECK((*listener)->accepted() == 2);
}

TEST_CASE("silent connections beyond the cap close the oldest: a worker is never kept out") {
  const std::string path = absl::StrCat("/tmp/refit-unix-flood-", getpid(), ".sock");
  Handed handed;
  auto listener = UnixCallerListener::Start(path, handed.Serve(), absl::Seconds(60));
  REQUIRE(listener.ok());
  std::vector<Fd> flood;
  for (size_t i = 0; i < UnixCallerListener::kMaxWaiting + 1; ++i) {
    flood.push_back(Connect(path, /*silent=*/true));
    REQUIRE(flood.back().valid());
  }
  CHECK(ClosedWithin(flood.front(), 3.0));  // the oldest, long before its 60 s
  Fd worker = Connect(path);
  REQUIRE(worker.valid());
  Fd served(handed.Next());
  CHECK(UnixCallerOf(absl::StrCat("fd:", served.get())).has_value());
  // The worker had written when it was accepted: served without closing another.
  CHECK((*listener)->closed_silent() == 1);
}

TEST_CASE("served connections are bounded per user and in all: past a limit one is closed") {
  const std::string path = absl::StrCat("/tmp/refit-unix-served-", getpid(), ".sock");
  Handed handed;
  auto listener = UnixCallerListener::Start(path, handed.Serve(), absl::Seconds(10),
                                            ServedLimits{/*per_uid=*/8, /*total=*/12});
  REQUIRE(listener.ok());
  REQUIRE(chmod(path.c_str(), 0777) == 0);
  std::vector<Fd> clients, served;
  for (int i = 0; i < 8; ++i) {
    clients.push_back(Connect(path));
    REQUIRE(clients.back().valid());
    served.emplace_back(handed.Next());
  }
  Fd ninth = Connect(path);
  CHECK(ClosedWithin(ninth, 3.0));
  CHECK((*listener)->closed_over_limit() == 1);
  CHECK(handed.Count() == 0);

  // gRPC closes two of them (its side): two more are served, and no third.
  served.pop_back();
  served.pop_back();
  usleep(150 * 1000);  // past the recount interval
  for (int i = 0; i < 2; ++i) {
    clients.push_back(Connect(path));
    served.emplace_back(handed.Next());
  }
  Fd over = Connect(path);
  CHECK(ClosedWithin(over, 3.0));
  CHECK((*listener)->closed_over_limit() == 2);

  if (geteuid() != 0) {
    WARN("the other user's share is skipped: needs root");
    return;
  }
  // Another user, while this one holds its 8: 4 more fit the total of 12, the 5th is closed. The
  // child's exit status is how many of its 5 were closed.
  const pid_t other = fork();
  if (other == 0) {
    if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0) _exit(100);
    int fds[5];
    for (int& fd : fds) {
      fd = socket(AF_UNIX, SOCK_STREAM, 0);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::memcpy(addr.sun_path, path.data(), path.size());
      if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) _exit(101);
      if (write(fd, "P", 1) != 1) _exit(102);
      usleep(20 * 1000);
    }
    sleep(1);
    int closed = 0;
    for (int fd : fds) {
      char byte;
      const ssize_t n = recv(fd, &byte, 1, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) ++closed;
    }
    _exit(closed);
  }
  for (int i = 0; i < 4; ++i) {
    Fd in(handed.Next());
    auto caller = UnixCallerOf(absl::StrCat("fd:", in.get()));
    REQUIRE(caller.has_value());
    CHECK(caller->uid == 65534);
    served.push_back(std::move(in));
  }
  int status = 0;
  REQUIRE(waitpid(other, &status, 0) == other);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 1);
  CHECK((*listener)->closed_over_limit() == 3);
}

// Another user connecting as fast as `per_second` allows and sending nothing, keeping its last
// 2000 connections open, for `seconds`; in a child process (fork: only system calls here).
pid_t Storm(const std::string& path, uid_t uid, int per_second, double seconds) {
  const pid_t child = fork();
  if (child != 0) return child;
  if (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0) _exit(2);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  static int kept[2000];
  for (int& k : kept) k = -1;
  timespec start{};
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (int64_t n = 0;; ++n) {
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);
    const double elapsed = (now.tv_sec - start.tv_sec) + (now.tv_nsec - start.tv_nsec) * 1e-9;
    if (elapsed >= seconds) _exit(0);
    const double due = static_cast<double>(n) / per_second;
    if (due > elapsed) {
      const timespec wait{0, static_cast<long>((due - elapsed) * 1e9)};
      nanosleep(&wait, nullptr);
    }
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      close(fd);
      continue;
    }
    int& slot = kept[n % 2000];
    if (slot >= 0) close(slot);
    slot = fd;
  }
}

TEST_CASE("a connect storm of another user keeps no caller out") {
  if (geteuid() != 0) {
    WARN("skipped: needs root, to connect as another user");
    return;
  }
  const std::string path = absl::StrCat("/tmp/refit-unix-storm-", getpid(), ".sock");
  Handed handed;
  auto listener = UnixCallerListener::Start(path, handed.Serve(), absl::Seconds(10));
  REQUIRE(listener.ok());
  REQUIRE(chmod(path.c_str(), 0777) == 0);
  // Spinning: as fast as one core connects, which fills the socket's backlog (4096) in
  // milliseconds whenever the listener falls behind.
  const pid_t storm = Storm(path, 65534, 100000000, 5.0);
  REQUIRE(storm > 0);
  usleep(500 * 1000);  // the storm under way
  // A gRPC client connects without blocking: a full backlog fails the attempt (EAGAIN), and the
  // client tries again after its reconnect backoff (the worker library's: 100 ms), within its
  // call's deadline; here 20 clients, each given 2 s.
  int first_refused = 0, served = 0;
  for (int i = 0; i < 20; ++i) {
    const absl::Time give_up = absl::Now() + absl::Seconds(2);
    for (int attempt = 0; absl::Now() < give_up; ++attempt) {
      Fd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::memcpy(addr.sun_path, path.data(), path.size());
      if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        if (attempt == 0) ++first_refused;
        usleep(100 * 1000);
        continue;
      }
      REQUIRE(write(fd.get(), "P", 1) == 1);
      Fd in(handed.Next());
      auto caller = UnixCallerOf(absl::StrCat("fd:", in.get()));
      REQUIRE(caller.has_value());
      CHECK(caller->uid == 0);
      ++served;
      break;
    }
    usleep(50 * 1000);
  }
  int status = 0;
  waitpid(storm, &status, 0);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  INFO("silent connections closed: " << (*listener)->closed_silent()
                                     << "; first attempts refused: " << first_refused);
  CHECK(served == 20);
  CHECK((*listener)->closed_silent() > 1000);  // the storm's, as it went on
}

TEST_CASE("a path a unix socket cannot have is refused by name") {
  const std::string long_path = "/tmp/" + std::string(200, 'x');
  auto listener = UnixCallerListener::Start(long_path, [](int fd) { close(fd); });
  REQUIRE_FALSE(listener.ok());
  CHECK(listener.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(listener.status().message().find("too long") != absl::string_view::npos);
  auto missing = UnixCallerListener::Start("/nonexistent-dir/x.sock", [](int fd) { close(fd); });
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().message().find("/nonexistent-dir/x.sock") != absl::string_view::npos);
}

}  // namespace
}  // namespace refit
