#include "daemon/security/unix_callers.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <catch2/catch.hpp>
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
  return read(fd.get(), &byte, 1) == 0;
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
  CHECK((*listener)->closed_silent() >= 2);
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
