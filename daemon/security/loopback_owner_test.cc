#include "daemon/security/loopback_owner.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "daemon/base/socket.h"

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
  const absl::Status refused =
      LoopbackUsers({other}, false).CheckPeer(p.server.get(), "data connection");
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
  LoopbackUsers others({other}, false);
  others.AddListener(*listener);
  CHECK(absl::IsPermissionDenied(others.CheckGrpcPeer(peer, "Status")));
  // Unix sockets are not TCP peers: their file mode and credentials decide elsewhere.
  CHECK(others.CheckGrpcPeer("unix:/tmp/x.sock", "Status").ok());
}

// A non-loopback address of this host, if it has one.
std::optional<std::string> RoutableAddress() {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return std::nullopt;
  std::optional<std::string> found;
  for (ifaddrs* a = all; a != nullptr && !found; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, ip, sizeof ip);
    if (std::string(ip).rfind("127.", 0) != 0) found = ip;
  }
  freeifaddrs(all);
  return found;
}

// `body` in a child process running as uid 65534 (its result the exit code); the child's pid.
// The test's assertions stay in the parent: the child only connects.
pid_t StartAsNobody(const std::function<int()>& body) {
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    _exit(body());
  }
  return child;
}

// The child's exit code (100 if it did not exit).
int ExitCodeOf(pid_t child) {
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

// A blocking connection from `from` (an IP and port; port 0: any) to `to`, bound with
// SO_REUSEADDR (as gRPC's client sockets are); -1 on failure.
int ConnectFrom(const std::string& from, const std::string& to) {
  auto dst = ParseHostPort(to);
  auto src = ParseHostPort(from);
  if (!dst.ok() || !src.ok()) return -1;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&src->address), sizeof(sockaddr_in)) != 0 ||
      connect(fd, reinterpret_cast<const sockaddr*>(&dst->address), sizeof(sockaddr_in)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Connects from `from` to `to` and keeps the connection until the parent closes its end.
int ConnectAndHold(const std::string& from, const std::string& to) {
  const int fd = ConnectFrom(from, to);
  if (fd < 0) return 3;
  pollfd p{fd, POLLIN, 0};
  while (poll(&p, 1, 10000) < 0 && errno == EINTR) {
  }
  return 0;
}

bool Root() {
  if (geteuid() == 0) return true;
  // Only root can make a process of another uid; the cases without one still run.
  WARN("not root: the other-user cases need setuid");
  return false;
}

TEST_CASE("a connection made by another user is owned by that user") {
  if (!Root()) return;
  auto l = TcpListen("127.0.0.1:0");
  REQUIRE(l.ok());
  const pid_t child = StartAsNobody([&] { return ConnectAndHold("127.0.0.1:0", l->second); });
  auto s = TcpAccept(l->first);
  REQUIRE(s.ok());
  auto owner = OwnerOfPeer(s->get());
  REQUIRE(owner.ok());
  CHECK(*owner == 65534u);
  const absl::Status refused = LoopbackUsers().CheckPeer(s->get(), "data connection");
  CHECK(absl::IsPermissionDenied(refused));
  CHECK(refused.message().find("uid 65534") != std::string::npos);
  s->Close();
  CHECK(ExitCodeOf(child) == 0);
}

TEST_CASE("a sender that writes and closes before the lookup is not taken for root") {
  if (!Root()) return;
  auto l = TcpListen("127.0.0.1:0");
  REQUIRE(l.ok());
  const pid_t child = StartAsNobody([&] {
    const int fd = ConnectFrom("127.0.0.1:0", l->second);
    const char payload[] = "frame";
    if (fd < 0 || write(fd, payload, sizeof payload) != sizeof payload) return 4;
    return 0;  // exits: its socket becomes a kernel remnant that reports uid 0
  });
  REQUIRE(ExitCodeOf(child) == 0);
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
  // gRPC's peers are URIs.
  auto escaped = ParseGrpcPeer("ipv6:%5B::1%5D:49830");
  REQUIRE(escaped.ok());
  CHECK(escaped->ToString() == "[::1]:49830");
  CHECK(IsUnixPeer("unix:/x"));
  CHECK(IsUnixPeer("unix-abstract:x"));
  CHECK_FALSE(IsUnixPeer("ipv4:127.0.0.1:1"));
  // Another host's connection: no socket of this host; admitted only where other hosts are
  // (--insecure-listen), and an unreadable caller never.
  CHECK(absl::IsNotFound(OwnerOfSocket(*routable, *v4).status()));
  LoopbackUsers local_only({12345}, false), with_remote({12345}, true);
  local_only.AddListener(*v4);
  with_remote.AddListener(*v4);
  CHECK(absl::IsPermissionDenied(local_only.CheckGrpcPeer("ipv4:10.1.2.3:80", "Status")));
  CHECK(with_remote.CheckGrpcPeer("ipv4:10.1.2.3:80", "Status").ok());
  CHECK(absl::IsPermissionDenied(with_remote.CheckGrpcPeer("ipv9:what", "Status")));
  // Listener addresses: an IP as given, both loopbacks for localhost, every address for a wildcard.
  CHECK(ListenerAddresses("127.0.0.2:0", 7).size() == 1);
  CHECK(ListenerAddresses("127.0.0.2:0", 7)[0].ToString() == "127.0.0.2:7");
  CHECK(ListenerAddresses("localhost:0", 7).size() == 2);
  CHECK(ListenerAddresses("0.0.0.0:0", 7).size() >= 2);
}

TEST_CASE("another user connecting from the host's own routable address is still that user") {
  if (!Root()) return;
  const std::optional<std::string> routable = RoutableAddress();
  if (!routable) {
    WARN("this host has no routable IPv4 address");
    return;
  }
  auto l = TcpListen("127.0.0.1:0");
  REQUIRE(l.ok());
  const pid_t child = StartAsNobody([&] { return ConnectAndHold(*routable + ":0", l->second); });
  auto s = TcpAccept(l->first);
  REQUIRE(s.ok());
  auto owner = OwnerOfPeer(s->get());
  REQUIRE(owner.ok());
  CHECK(*owner == 65534u);
  CHECK(absl::IsPermissionDenied(LoopbackUsers().CheckPeer(s->get(), "data connection")));
  CHECK(absl::IsPermissionDenied(
      LoopbackUsers(/*admit_remote=*/true).CheckPeer(s->get(), "data connection")));
  s->Close();
  CHECK(ExitCodeOf(child) == 0);
}

TEST_CASE(
    "a caller that binds another user's address and port to reach another listener is refused") {
  if (!Root()) return;
  // Root's connection 127.0.0.1:X -> listener A; nobody binds 127.0.0.1:X (SO_REUSEADDR) and
  // connects to listener B. A call on B names only "127.0.0.1:X".
  auto a = TcpListen("127.0.0.1:0");
  auto b = TcpListen("127.0.0.1:0");
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  Fd mine(ConnectFrom("127.0.0.1:0", a->second));
  REQUIRE(mine.valid());
  Endpoint source;
  socklen_t len = sizeof source.address;
  REQUIRE(getsockname(mine.get(), reinterpret_cast<sockaddr*>(&source.address), &len) == 0);
  auto accepted_a = TcpAccept(a->first);
  REQUIRE(accepted_a.ok());
  const pid_t child = StartAsNobody([&] { return ConnectAndHold(source.ToString(), b->second); });
  auto accepted_b = TcpAccept(b->first);
  REQUIRE(accepted_b.ok());
  LoopbackUsers users;
  users.AddListener(*ParseHostPort(a->second));
  users.AddListener(*ParseHostPort(b->second));
  const absl::Status s = users.CheckGrpcPeer("ipv4:" + source.ToString(), "Status");
  CHECK(absl::IsPermissionDenied(s));
  CHECK(std::string(s.message()).find("uid 65534") != std::string::npos);
  accepted_b->Close();
  CHECK(ExitCodeOf(child) == 0);
}

}  // namespace
}  // namespace refit
