#include "daemon/watch_slots.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/coordinator/round_log.h"
#include "daemon/security/unix_callers.h"
#include "daemon/services.h"
#include "proto/refit.grpc.pb.h"

namespace refit {
namespace {

Caller Certificate(std::vector<std::string> names) {
  Caller c;
  c.authenticated = true;
  c.names = std::move(names);
  c.peer = "ipv4:10.0.0.9:4000";
  return c;
}

Caller Unix() {
  Caller c;
  c.unix_socket = true;
  c.peer = "unix:";
  return c;
}

Caller Tcp(const std::string& peer) {
  Caller c;
  c.peer = peer;
  return c;
}

bool Says(const absl::Status& s, absl::StatusCode code, const std::string& part) {
  INFO(s.ToString());
  return s.code() == code && s.message().find(part) != absl::string_view::npos;
}

TEST_CASE(
    "who a watcher is: its certificate, the worker socket, the host; daemons and the own user "
    "uncapped") {
  CHECK(WatchCallerOf(Certificate({"refit-viewer"})).key ==
        WatchCallerOf(Certificate({"refit-viewer"})).key);
  CHECK(WatchCallerOf(Certificate({"refit-viewer"})).key !=
        WatchCallerOf(Certificate({"refit-operator"})).key);
  CHECK(WatchCallerOf(Certificate({"a", "b"})).key == WatchCallerOf(Certificate({"b", "a"})).key);
  CHECK(WatchCallerOf(Certificate({"refit-viewer"})).capped);
  CHECK(WatchCallerOf(Certificate({"refit-viewer"})).name == "certificate \"refit-viewer\"");
  CHECK_FALSE(WatchCallerOf(Certificate({"refit-node-3", "refitd"})).capped);
  CHECK(WatchCallerOf(Unix()).capped);
  CHECK(WatchCallerOf(Unix()).key != WatchCallerOf(Tcp("ipv4:127.0.0.1:5000")).key);
  CHECK_FALSE(WatchCallerOf(Tcp("ipv4:127.0.0.1:5000")).capped);
  CHECK_FALSE(WatchCallerOf(Tcp("ipv6:%5B::1%5D:5000")).capped);
  // Another host (--insecure-listen): every connection of it is one caller.
  const WatchCaller remote = WatchCallerOf(Tcp("ipv4:10.1.2.3:5000"));
  CHECK(remote.capped);
  CHECK(remote.key == WatchCallerOf(Tcp("ipv4:10.1.2.3:6001")).key);
  CHECK(remote.key != WatchCallerOf(Tcp("ipv4:10.1.2.4:5000")).key);
  CHECK(remote.name == "host 10.1.2.3");
}

TEST_CASE("one caller holds at most its share; others still get slots; the total bounds them all") {
  WatchSlots slots(/*total=*/10, /*per_caller=*/3);
  const WatchCaller viewer{"v", "certificate \"refit-viewer\""},
      operator_{"o", "certificate \"refit-operator\""};
  const WatchCaller node{"node 1", "node 1's daemon", /*capped=*/false};
  std::vector<WatchSlots::Slot> held;
  for (int i = 0; i < 3; ++i) {
    auto s = slots.Acquire(viewer);
    REQUIRE(s.ok());
    held.push_back(*std::move(s));
  }
  CHECK(Says(slots.Acquire(viewer).status(), absl::StatusCode::kResourceExhausted,
             "WatchRounds: certificate \"refit-viewer\" holds 3 streams on this daemon already, "
             "the most one caller "
             "may hold at once"));
  auto other = slots.Acquire(operator_);
  REQUIRE(other.ok());
  CHECK(slots.held_by("v") == 3);
  CHECK(slots.held_by("o") == 1);
  // A daemon forwarding its callers' watches is bounded by the total only.
  for (int i = 0; i < 6; ++i) {
    auto s = slots.Acquire(node);
    REQUIRE(s.ok());
    held.push_back(*std::move(s));
  }
  CHECK(slots.open() == 10);
  CHECK(Says(slots.Acquire(node).status(), absl::StatusCode::kResourceExhausted,
             "WatchRounds: 10 streams are open on this daemon already, the most it serves (held "
             "most by node 1's daemon: 6, certificate \"refit-viewer\": 3, certificate "
             "\"refit-operator\": 1); close one"));
  CHECK(Says(slots.Acquire({"x", "certificate \"x\""}).status(),
             absl::StatusCode::kResourceExhausted, "10 streams are open"));
  // Slots come back when their streams end (moved-from holders give nothing back twice).
  held.erase(held.begin());
  CHECK(slots.held_by("v") == 2);
  CHECK(slots.open() == 9);
  REQUIRE(slots.Acquire(viewer).ok());  // taken and given back at once
  CHECK(slots.open() == 9);
  held.clear();
  CHECK(slots.open() == 1);
  CHECK(slots.held_by("v") == 0);
}

// Through gRPC: a coordinator's RefitControl on a unix socket (accepted as the daemon accepts its
// worker socket) and on loopback TCP, without TLS. Each user on the worker socket has its share;
// the daemon's own user over TCP is not capped.
TEST_CASE(
    "WatchRounds: the worker socket's callers cannot take every slot; a TCP caller still gets "
    "one") {
  // In /tmp: Bazel's TEST_TMPDIR is longer than a unix socket's path may be (107 bytes).
  char dir[] = "/tmp/watch-slots-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string socket = absl::StrCat(dir, "/control.sock");
  DaemonConfig config;
  Authority authority{TlsConfig()};
  RoundLog log;
  ServiceParts parts;
  parts.config = &config;
  parts.authority = &authority;
  parts.log = &log;
  std::unique_ptr<grpc::Service> control = MakeControlService(&parts);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(control.get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  REQUIRE(server != nullptr);
  REQUIRE(port != 0);
  grpc::Server* serving = server.get();
  auto unix_socket = UnixCallerListener::Start(
      socket, [serving](int fd) { grpc::AddInsecureChannelFromFd(serving, fd); });
  REQUIRE(unix_socket.ok());

  struct Watch {
    std::unique_ptr<v1::RefitControl::Stub> stub;
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::RoundStats>> reader;
  };
  auto open = [&](const std::string& target) {
    auto w = std::make_unique<Watch>();
    w->stub =
        v1::RefitControl::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    w->context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    w->reader = w->stub->WatchRounds(&w->context, v1::WatchRoundsRequest());
    return w;
  };
  auto eventually = [](const std::function<bool()>& done) {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (!done()) {
      if (absl::Now() > until) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  };
  std::vector<std::unique_ptr<Watch>> watches;
  for (int i = 0; i < kMaxWatchesPerCaller; ++i) watches.push_back(open("unix:" + socket));
  REQUIRE(eventually([&] { return parts.watch_slots.open() == kMaxWatchesPerCaller; }));
  // One more on the worker socket is refused at once, naming the cap and the caller.
  std::unique_ptr<Watch> refused = open("unix:" + socket);
  const grpc::Status status = refused->reader->Finish();
  CHECK(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(status.error_message() ==
        absl::StrCat("WatchRounds: uid ", geteuid(), " on the worker socket holds ",
                     kMaxWatchesPerCaller,
                     " streams on this daemon already, the most one caller may hold at "
                     "once; close one"));
  // Another caller still gets a slot.
  watches.push_back(open(absl::StrCat("127.0.0.1:", port)));
  REQUIRE(eventually([&] { return parts.watch_slots.open() == kMaxWatchesPerCaller + 1; }));
  for (auto& w : watches) w->context.TryCancel();
  CHECK(eventually([&] { return parts.watch_slots.open() == 0; }));
  for (auto& w : watches) w->reader->Finish();
  log.Stop();
  unix_socket->reset();
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  rmdir(dir);
}

}  // namespace
}  // namespace refit
