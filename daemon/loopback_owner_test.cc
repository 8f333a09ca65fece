#include "daemon/loopback_owner.h"

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <string>
#include <utility>

#include "daemon/socket.h"

namespace refit {
namespace {

struct Pair {
  Fd listener, client, server;
  std::string address;
};

Pair Connected(const std::string& listen) {
  Pair p;
  auto l = TcpListen(listen);
  REQUIRE(l.ok());
  p.listener = std::move(l->first);
  p.address = l->second;
  auto c = TcpConnect(p.address, absl::Now() + absl::Seconds(5));
  REQUIRE(c.ok());
  p.client = *std::move(c);
  auto s = TcpAccept(p.listener);
  REQUIRE(s.ok());
  p.server = *std::move(s);
  return p;
}

TEST_CASE("the owner of either end of a loopback connection is this process' uid") {
  Pair p = Connected("127.0.0.1:0");
  auto a = OwnerOfPeer(p.server.get());
  REQUIRE(a.ok());
  CHECK(*a == geteuid());
  auto b = OwnerOfPeer(p.client.get());
  REQUIRE(b.ok());
  CHECK(*b == geteuid());
  CHECK(LoopbackUsers().CheckPeer(p.server.get(), "data connection").ok());
  // A user list without this uid refuses it, naming the uid and what the port admits.
  const uint32_t other = geteuid() == 12345 ? 12346 : 12345;
  const absl::Status refused = LoopbackUsers({other}).CheckPeer(p.server.get(), "data connection");
  CHECK(absl::IsPermissionDenied(refused));
  CHECK(refused.message().find("uid " + std::to_string(geteuid())) != std::string::npos);
  CHECK(refused.message().find("admits only uid " + std::to_string(other)) != std::string::npos);
}

TEST_CASE("a gRPC peer string is looked up against the daemon's listeners") {
  Pair p = Connected("127.0.0.1:0");
  Endpoint client;
  socklen_t len = sizeof client.address;
  REQUIRE(getsockname(p.client.get(), reinterpret_cast<sockaddr*>(&client.address), &len) == 0);
  auto listener = ParseHostPort(p.address);
  REQUIRE(listener.ok());
  auto wrong = ParseHostPort("127.0.0.1:1");
  REQUIRE(wrong.ok());
  const std::string peer = "ipv4:" + client.ToString();
  LoopbackUsers mine;
  // No listener that the connection reached: the owner is unknown, and unknown is refused.
  mine.AddListener(*wrong);
  const absl::Status unknown = mine.CheckGrpcPeer(peer, "Status");
  CHECK(absl::IsPermissionDenied(unknown));
  CHECK(unknown.message().find("cannot tell which user owns") != std::string::npos);
  mine.AddListener(*listener);
  CHECK(mine.CheckGrpcPeer(peer, "Status").ok());
  const uint32_t other = geteuid() == 12345 ? 12346 : 12345;
  LoopbackUsers others({other});
  others.AddListener(*listener);
  CHECK(absl::IsPermissionDenied(others.CheckGrpcPeer(peer, "Status")));
  // Unix sockets are not TCP peers: their file mode and credentials decide elsewhere.
  CHECK(others.CheckGrpcPeer("unix:/tmp/x.sock", "Status").ok());
}

TEST_CASE("a connection made by another user is owned by that user") {
  if (geteuid() != 0) {
    // Only root can make a process of another uid; the cases above still run.
    WARN("not root: the other-user case needs setuid");
    return;
  }
  auto l = TcpListen("127.0.0.1:0");
  REQUIRE(l.ok());
  const std::string address = l->second;
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    auto c = TcpConnect(address, absl::Now() + absl::Seconds(5));
    if (!c.ok()) _exit(3);
    // Open until the parent closes (the socket is non-blocking: wait for the end first).
    pollfd p{c->get(), POLLIN, 0};
    while (poll(&p, 1, 10000) < 0 && errno == EINTR) {
    }
    _exit(0);
  }
  auto s = TcpAccept(l->first);
  REQUIRE(s.ok());
  auto owner = OwnerOfPeer(s->get());
  REQUIRE(owner.ok());
  CHECK(*owner == 65534u);
  const absl::Status refused = LoopbackUsers().CheckPeer(s->get(), "data connection");
  CHECK(absl::IsPermissionDenied(refused));
  CHECK(refused.message().find("uid 65534") != std::string::npos);
  s->Close();
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("a sender that writes and closes before the lookup is not taken for root") {
  if (geteuid() != 0) {
    WARN("not root: the other-user case needs setuid");
    return;
  }
  auto l = TcpListen("127.0.0.1:0");
  REQUIRE(l.ok());
  const std::string address = l->second;
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    auto c = TcpConnect(address, absl::Now() + absl::Seconds(5));
    if (!c.ok()) _exit(3);
    const char payload[] = "frame";
    if (write(c->get(), payload, sizeof payload) != sizeof payload) _exit(4);
    _exit(0);  // closes: its socket becomes a kernel remnant that reports uid 0
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  auto s = TcpAccept(l->first);
  REQUIRE(s.ok());
  CHECK(absl::IsAborted(OwnerOfPeer(s->get()).status()));
  const absl::Status refused = LoopbackUsers().CheckPeer(s->get(), "data connection");
  CHECK(absl::IsPermissionDenied(refused));
  CHECK(refused.message().find("no longer open") != std::string::npos);
}

TEST_CASE("addresses: loopback, parsing, non-loopback ends") {
  auto v4 = ParseHostPort("127.0.0.2:80");
  REQUIRE(v4.ok());
  CHECK(IsLoopback(*v4));
  auto v6 = ParseHostPort("[::1]:80");
  REQUIRE(v6.ok());
  CHECK(IsLoopback(*v6));
  auto mapped = ParseGrpcPeer("ipv6:[::ffff:127.0.0.1]:80");
  REQUIRE(mapped.ok());
  CHECK(IsLoopback(*mapped));
  auto routable = ParseHostPort("10.1.2.3:80");
  REQUIRE(routable.ok());
  CHECK_FALSE(IsLoopback(*routable));
  CHECK(ParseHostPort("localhost:7")->ToString() == "127.0.0.1:7");
  CHECK(absl::IsInvalidArgument(ParseHostPort("no-port").status()));
  CHECK(absl::IsInvalidArgument(ParseHostPort("127.0.0.1:99999").status()));
  CHECK(absl::IsNotFound(ParseGrpcPeer("unix:/x").status()));
  // The kernel's uid is no user of this host for another host's connection: not looked up.
  CHECK(absl::IsFailedPrecondition(OwnerOfSocket(*routable, *v4).status()));
  LoopbackUsers others({12345});
  others.AddListener(*v4);
  CHECK(others.CheckGrpcPeer("ipv4:10.1.2.3:80", "Status").ok());
}

}  // namespace
}  // namespace refit
