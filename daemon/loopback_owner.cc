#include "daemon/loopback_owner.h"

#include <arpa/inet.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/socket.h"

namespace refit {
namespace {

// An address as the kernel's socket lookup takes it: a family and 16 bytes (IPv4 in the first 4),
// the port in network order.
struct Raw {
  int family = AF_UNSPEC;
  uint8_t bytes[16] = {};
  uint16_t port_be = 0;
};

bool IsV4Mapped(const in6_addr& a) { return IN6_IS_ADDR_V4MAPPED(&a); }

Raw RawOf(const Endpoint& e, bool unmap) {
  Raw r;
  if (e.address.ss_family == AF_INET) {
    const auto& s = reinterpret_cast<const sockaddr_in&>(e.address);
    r.family = AF_INET;
    std::memcpy(r.bytes, &s.sin_addr, 4);
    r.port_be = s.sin_port;
  } else if (e.address.ss_family == AF_INET6) {
    const auto& s = reinterpret_cast<const sockaddr_in6&>(e.address);
    r.port_be = s.sin6_port;
    if (unmap && IsV4Mapped(s.sin6_addr)) {
      r.family = AF_INET;
      std::memcpy(r.bytes, s.sin6_addr.s6_addr + 12, 4);
    } else {
      r.family = AF_INET6;
      std::memcpy(r.bytes, s.sin6_addr.s6_addr, 16);
    }
  }
  return r;
}

constexpr uint8_t kTcpEstablished = 1;  // include/net/tcp_states.h

// One exact lookup (inet_diag_find_one_icsk): the socket whose own address is `local`.
absl::StatusOr<uint32_t> AskKernel(const Raw& local, const Raw& remote) {
  Fd nl(socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG));
  if (!nl.valid()) {
    return absl::UnavailableError(
        absl::StrCat("cannot open a NETLINK_SOCK_DIAG socket: ", std::strerror(errno)));
  }
  // The kernel answers at once; the bound only guards against one that never does.
  const timeval wait{.tv_sec = 1, .tv_usec = 0};
  setsockopt(nl.get(), SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  struct {
    nlmsghdr header;
    inet_diag_req_v2 request;
  } message{};
  message.header.nlmsg_len = sizeof message;
  message.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  message.header.nlmsg_flags = NLM_F_REQUEST;
  message.header.nlmsg_seq = 1;
  message.request.sdiag_family = static_cast<uint8_t>(local.family);
  message.request.sdiag_protocol = IPPROTO_TCP;
  message.request.idiag_states = ~0u;
  message.request.id.idiag_sport = local.port_be;
  message.request.id.idiag_dport = remote.port_be;
  std::memcpy(message.request.id.idiag_src, local.bytes, sizeof local.bytes);
  std::memcpy(message.request.id.idiag_dst, remote.bytes, sizeof remote.bytes);
  message.request.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  message.request.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (sendto(nl.get(), &message, sizeof message, 0, reinterpret_cast<sockaddr*>(&kernel),
             sizeof kernel) < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot ask the kernel for a socket's owner: ", std::strerror(errno)));
  }
  alignas(nlmsghdr) char answer[8192];
  const ssize_t n = recv(nl.get(), answer, sizeof answer, 0);
  if (n < 0) {
    return absl::UnavailableError(
        absl::StrCat("no answer from the kernel about a socket's owner: ", std::strerror(errno)));
  }
  int left = static_cast<int>(n);
  for (auto* h = reinterpret_cast<nlmsghdr*>(answer); NLMSG_OK(h, left); h = NLMSG_NEXT(h, left)) {
    if (h->nlmsg_type == NLMSG_ERROR) {
      const auto* e = static_cast<const nlmsgerr*>(NLMSG_DATA(h));
      if (e->error == -ENOENT) return absl::NotFoundError("no such socket");
      return absl::UnavailableError(
          absl::StrCat("the kernel would not say who owns a socket: ", std::strerror(-e->error)));
    }
    if (h->nlmsg_type == SOCK_DIAG_BY_FAMILY &&
        h->nlmsg_len >= NLMSG_LENGTH(sizeof(inet_diag_msg))) {
      const auto* found = static_cast<const inet_diag_msg*>(NLMSG_DATA(h));
      // A socket its process closed is a kernel remnant (TIME_WAIT, or FIN_WAIT2 kept as one)
      // that reports uid 0, whoever made it: a sender that connects, writes and closes must not
      // pass for root. Only an open connection's owner counts.
      if (found->idiag_state != kTcpEstablished) {
        return absl::AbortedError(absl::StrCat("its socket is no longer open (TCP state ",
                                               static_cast<int>(found->idiag_state), ")"));
      }
      return found->idiag_uid;
    }
  }
  return absl::UnavailableError("the kernel's answer about a socket's owner could not be read");
}

}  // namespace

std::string Endpoint::ToString() const {
  char host[INET6_ADDRSTRLEN] = "?";
  if (address.ss_family == AF_INET) {
    const auto& s = reinterpret_cast<const sockaddr_in&>(address);
    inet_ntop(AF_INET, &s.sin_addr, host, sizeof host);
    return absl::StrCat(host, ":", ntohs(s.sin_port));
  }
  if (address.ss_family == AF_INET6) {
    const auto& s = reinterpret_cast<const sockaddr_in6&>(address);
    inet_ntop(AF_INET6, &s.sin6_addr, host, sizeof host);
    return absl::StrCat("[", host, "]:", ntohs(s.sin6_port));
  }
  return "(no address)";
}

bool IsLoopback(const Endpoint& e) {
  const Raw r = RawOf(e, /*unmap=*/true);
  if (r.family == AF_INET) return r.bytes[0] == 127;
  if (r.family == AF_INET6) {
    const auto& s = reinterpret_cast<const sockaddr_in6&>(e.address);
    return IN6_IS_ADDR_LOOPBACK(&s.sin6_addr);
  }
  return false;
}

absl::StatusOr<Endpoint> ParseHostPort(absl::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos)
    return absl::InvalidArgumentError(absl::StrCat("no port in \"", address, "\""));
  std::string host(address.substr(0, colon));
  int port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad port in \"", address, "\""));
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  if (host == "localhost") host = "127.0.0.1";
  Endpoint e;
  auto& v4 = reinterpret_cast<sockaddr_in&>(e.address);
  auto& v6 = reinterpret_cast<sockaddr_in6&>(e.address);
  if (inet_pton(AF_INET, host.c_str(), &v4.sin_addr) == 1) {
    v4.sin_family = AF_INET;
    v4.sin_port = htons(static_cast<uint16_t>(port));
    return e;
  }
  if (inet_pton(AF_INET6, host.c_str(), &v6.sin6_addr) == 1) {
    v6.sin6_family = AF_INET6;
    v6.sin6_port = htons(static_cast<uint16_t>(port));
    return e;
  }
  return absl::InvalidArgumentError(absl::StrCat("\"", host, "\" is not an IP address"));
}

absl::StatusOr<Endpoint> ParseGrpcPeer(absl::string_view peer) {
  for (absl::string_view prefix : {"ipv4:", "ipv6:"}) {
    if (peer.substr(0, prefix.size()) == prefix) return ParseHostPort(peer.substr(prefix.size()));
  }
  return absl::NotFoundError(absl::StrCat("\"", peer, "\" is not a TCP peer"));
}

absl::StatusOr<uint32_t> OwnerOfSocket(const Endpoint& local, const Endpoint& remote) {
  if (!IsLoopback(local) || !IsLoopback(remote)) {
    return absl::FailedPreconditionError(absl::StrCat("the connection ", local.ToString(), " - ",
                                                      remote.ToString(), " is not a loopback one"));
  }
  // A dual-stack socket sees an IPv4 peer as ::ffff:a.b.c.d while the peer's own socket is IPv4:
  // ask in IPv4 first, then as the addresses were given.
  const Raw l4 = RawOf(local, true), r4 = RawOf(remote, true);
  absl::StatusOr<uint32_t> owner = absl::NotFoundError("");
  if (l4.family == r4.family) owner = AskKernel(l4, r4);
  const Raw l6 = RawOf(local, false), r6 = RawOf(remote, false);
  if (absl::IsNotFound(owner.status()) && l6.family == AF_INET6 && r6.family == AF_INET6)
    owner = AskKernel(l6, r6);
  if (absl::IsNotFound(owner.status())) {
    return absl::NotFoundError(
        absl::StrCat("no socket ", local.ToString(), " connected to ", remote.ToString()));
  }
  return owner;
}

absl::StatusOr<uint32_t> OwnerOfPeer(int fd) {
  Endpoint self, peer;
  socklen_t a = sizeof self.address, b = sizeof peer.address;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&self.address), &a) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr*>(&peer.address), &b) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a connected socket: ", std::strerror(errno)));
  }
  // The other end's socket has the two addresses the other way round.
  return OwnerOfSocket(peer, self);
}

LoopbackUsers::LoopbackUsers() : uids_({static_cast<uint32_t>(geteuid())}) {
  if (geteuid() != 0) uids_.push_back(0);
  std::sort(uids_.begin(), uids_.end());
}

bool LoopbackUsers::Admits(uint32_t uid) const {
  return std::find(uids_.begin(), uids_.end(), uid) != uids_.end();
}

std::string LoopbackUsers::Describe() const {
  return absl::StrCat("uid ", absl::StrJoin(uids_, " and "));
}

absl::Status LoopbackUsers::Check(absl::StatusOr<uint32_t> owner, const std::string& who,
                                  absl::string_view what) const {
  if (owner.ok()) {
    if (Admits(*owner)) return absl::OkStatus();
    return absl::PermissionDeniedError(
        absl::StrCat(what, ": ", who, " belongs to uid ", *owner,
                     "; without TLS this port admits only ", Describe(),
                     " (local tools of other users: the worker socket; other hosts and users: TLS, "
                     "docs/SECURITY.md)"));
  }
  // Not on this host: only a listener given a routable address (--insecure-listen) meets one.
  if (absl::IsFailedPrecondition(owner.status())) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(what, ": cannot tell which user owns ", who, " (",
                                                  owner.status().message(), ")"));
}

absl::Status LoopbackUsers::CheckPeer(int fd, absl::string_view what) const {
  Endpoint peer;
  socklen_t len = sizeof peer.address;
  const std::string who = getpeername(fd, reinterpret_cast<sockaddr*>(&peer.address), &len) == 0
                              ? peer.ToString()
                              : "the connection";
  return Check(OwnerOfPeer(fd), who, what);
}

void LoopbackUsers::AddListener(const Endpoint& local) {
  absl::MutexLock lock(&mu_);
  listeners_.push_back(local);
}

absl::Status LoopbackUsers::CheckGrpcPeer(absl::string_view peer, absl::string_view what) const {
  absl::StatusOr<Endpoint> caller = ParseGrpcPeer(peer);
  if (!caller.ok()) return absl::OkStatus();  // a unix socket: its file mode and credentials decide
  std::vector<Endpoint> locals;
  {
    absl::MutexLock lock(&mu_);
    locals = listeners_;
  }
  absl::StatusOr<uint32_t> owner =
      absl::NotFoundError("this daemon knows no TCP listener of its own yet");
  for (const Endpoint& local : locals) {
    owner = OwnerOfSocket(*caller, local);
    if (!absl::IsNotFound(owner.status())) break;
  }
  return Check(owner, caller->ToString(), what);
}

}  // namespace refit
