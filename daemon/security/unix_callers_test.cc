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

Fd Connect(const std::string& path) {
  Fd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return Fd();
  return fd;
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
};

TEST_CASE("each connection is handed over with the uid and pid the kernel gives it") {
  const std::string path = absl::StrCat("/tmp/refit-unix-callers-", getpid(), ".sock");
  Handed handed;
  auto listener = UnixCallerListener::Start(path, [&](int fd) {
    std::lock_guard<std::mutex> lock(handed.mu);
    handed.fds.push_back(fd);
    handed.cv.notify_all();
  });
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
