// Keepalive between a worker and a real refitd process: an idle session stays up for many pings
// (the daemon accepts them every second), and a frozen (SIGSTOP) or killed daemon is noticed by
// the worker within about two seconds.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <fstream>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "client/worker/worker_client.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"

extern char** environ;

namespace refit {
namespace {

struct Refitd {
  pid_t pid = -1;
  std::string socket;
  std::string address;
  explicit Refitd(int n)
      : Refitd(absl::StrCat("/tmp/refitd-keepalive-", getpid(), "-", n, ".sock")) {}
  explicit Refitd(const std::string& path) {
    socket = path;
    const std::string addr_file = socket + ".addr";
    unlink(addr_file.c_str());
    std::vector<std::string> args = {
        "daemon/refitd", "--node",      "0",    "--worker-socket", socket, "--address-file",
        addr_file,       "--log-level", "warn", "--state-file="};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    REQUIRE(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) == 0);
    for (int i = 0; i < 100 && address.empty(); ++i) {
      std::ifstream(addr_file) >> address;
      if (address.empty()) usleep(100000);
    }
    unlink(addr_file.c_str());
    REQUIRE_FALSE(address.empty());
  }
  ~Refitd() {
    if (pid > 0) {
      kill(pid, SIGCONT);
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    unlink(socket.c_str());
    unlink((socket + ".handles").c_str());
  }
};

Layout Trainer() {
  Layout l;
  testing::AddSplitTensor(l, "w", Dims{8, 4}, DType::kF32, 0, {0, 8}, {{0, 0}}, "trainer");
  REQUIRE(ValidateLayout(l, "source").ok());
  return l;
}

// Connects a worker and returns how long after `stop` (applied to the daemon) it noticed.
absl::Duration TimeToNotice(int signal, int n) {
  Refitd daemon(n);
  const Layout layout = Trainer();
  std::mutex mu;
  std::string why;
  WorkerCallbacks callbacks;
  callbacks.on_disconnected = [&](const std::string& w) {
    std::lock_guard<std::mutex> lock(mu);
    why = w;
  };
  auto client =
      WorkerClient::Connect("unix:" + daemon.socket, "policy", v1::TRAINER, layout, callbacks);
  INFO(client.status().message());
  REQUIRE(client.ok());
  REQUIRE((*client)->connected());
  if (signal == SIGSTOP) {
    // Idle for several keepalive pings: a daemon that took pings this often as abuse would have
    // closed the connection ("too_many_pings") by now.
    absl::SleepFor(absl::Seconds(5));
    CHECK((*client)->connected());
  }
  REQUIRE(kill(daemon.pid, signal) == 0);
  const absl::Time t0 = absl::Now();
  while ((*client)->connected() && absl::Now() - t0 < absl::Seconds(15))
    absl::SleepFor(absl::Milliseconds(10));
  const absl::Duration took = absl::Now() - t0;
  CHECK_FALSE((*client)->connected());
  absl::SleepFor(absl::Milliseconds(50));
  std::lock_guard<std::mutex> lock(mu);
  INFO(why);
  CHECK(why.find("the session with the daemon ended") != std::string::npos);
  return took;
}

TEST_CASE("a frozen daemon is noticed within about two seconds; an idle healthy session stays up") {
  const absl::Duration took = TimeToNotice(SIGSTOP, 0);
  INFO(absl::FormatDuration(took));
  CHECK(took < absl::Milliseconds(3500));
}

TEST_CASE("a worker registers again by itself when its daemon restarts, with the same memory") {
  const std::string socket = absl::StrCat("/tmp/refitd-keepalive-", getpid(), "-restart.sock");
  auto daemon = std::make_unique<Refitd>(socket);
  const Layout layout = Trainer();
  std::mutex mu;
  std::vector<std::string> seen;
  WorkerCallbacks callbacks;
  callbacks.on_disconnected = [&](const std::string& w) {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back("disconnected");
  };
  callbacks.on_reconnected = [&](const std::string& id) {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back("reconnected " + id);
  };
  auto client = WorkerClient::Connect("unix:" + socket, "policy", v1::TRAINER, layout, callbacks);
  INFO(client.status().message());
  REQUIRE(client.ok());
  (*client)->buffer(0)[0] = std::byte{42};
  for (int restart = 0; restart < 2; ++restart) {
    daemon.reset();  // kill -9
    daemon = std::make_unique<Refitd>(socket);
    const absl::Time t0 = absl::Now();
    while (absl::Now() - t0 < absl::Seconds(10)) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (seen.size() == static_cast<size_t>(2 * (restart + 1))) break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    INFO("restart " << restart << " after " << absl::FormatDuration(absl::Now() - t0));
    {
      std::lock_guard<std::mutex> lock(mu);
      REQUIRE(seen.size() == static_cast<size_t>(2 * (restart + 1)));
      CHECK(seen.back() == "reconnected " + (*client)->worker_id());
    }
    CHECK(absl::Now() - t0 < absl::Seconds(3));
    CHECK((*client)->connected());
    // The new daemon knows the worker, with its memory (handed over again as its descriptor).
    auto stub = v1::RefitControl::NewStub(
        grpc::CreateChannel(daemon->address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ListWorkersResponse workers;
    REQUIRE(stub->ListWorkers(&ctx, v1::ListWorkersRequest(), &workers).ok());
    REQUIRE(workers.workers_size() == 1);
    CHECK(workers.workers(0).worker_id() == (*client)->worker_id());
    CHECK(workers.workers(0).bytes() == 8 * 4 * 4);
  }
  CHECK((*client)->buffer(0)[0] == std::byte{42});  // the same memory all along
}

TEST_CASE("a killed daemon is noticed at once") {
  const absl::Duration took = TimeToNotice(SIGKILL, 1);
  INFO(absl::FormatDuration(took));
  CHECK(took < absl::Seconds(1));
}

}  // namespace
}  // namespace refit
