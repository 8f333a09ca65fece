#include "daemon/security/loopback_owner.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/base/socket.h"
#include "daemon/security/unix_callers.h"

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

// include/net/tcp_states.h
constexpr uint8_t kTcpEstablished = 1, kTcpSynRecv = 3, kTcpNewSynRecv = 12;

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
      if (found->idiag_state == kTcpSynRecv || found->idiag_state == kTcpNewSynRecv) {
        // A listener's side of a connection just made: not yet a socket of its own.
        return absl::FailedPreconditionError("its socket is still being set up");
      }
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
  // gRPC writes peers as URIs: "ipv6:%5B::1%5D:5000" for [::1]:5000.
  std::string text;
  for (size_t i = 0; i < peer.size(); ++i) {
    int byte = 0;
    if (peer[i] == '%' && i + 2 < peer.size() &&
        absl::SimpleHexAtoi(peer.substr(i + 1, 2), &byte)) {
      text.push_back(static_cast<char>(byte));
      i += 2;
    } else {
      text.push_back(peer[i]);
    }
  }
  const absl::string_view t = text;
  for (absl::string_view prefix : {"ipv4:", "ipv6:"}) {
    if (t.substr(0, prefix.size()) == prefix) return ParseHostPort(t.substr(prefix.size()));
  }
  return absl::NotFoundError(absl::StrCat("\"", peer, "\" is not a TCP peer"));
}

bool IsUnixPeer(absl::string_view peer) {
  return absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:") ||
         UnixCallerOf(peer).has_value();
}

std::vector<Endpoint> ListenerAddresses(absl::string_view configured, int port) {
  std::string host(configured.substr(0, configured.rfind(':')));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  std::vector<Endpoint> out;
  auto add = [&](const std::string& ip) {
    const bool v6 = ip.find(':') != std::string::npos;
    if (auto e =
            ParseHostPort(v6 ? absl::StrCat("[", ip, "]:", port) : absl::StrCat(ip, ":", port));
        e.ok()) {
      out.push_back(*e);
    }
  };
  if (host == "localhost") {
    add("127.0.0.1");
    add("::1");
  } else if (host.empty() || host == "0.0.0.0" || host == "::") {
    // A wildcard: a connection may reach it on any address of the host.
    add("127.0.0.1");
    add("::1");
    ifaddrs* all = nullptr;
    if (getifaddrs(&all) == 0) {
      for (ifaddrs* a = all; a != nullptr; a = a->ifa_next) {
        if (a->ifa_addr == nullptr ||
            (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6))
          continue;
        char ip[INET6_ADDRSTRLEN];
        const void* raw =
            a->ifa_addr->sa_family == AF_INET
                ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr)
                : static_cast<const void*>(
                      &reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr);
        if (inet_ntop(a->ifa_addr->sa_family, raw, ip, sizeof ip) != nullptr) add(ip);
      }
      freeifaddrs(all);
    }
  } else if (ParseHostPort(
                 absl::StrCat(host.find(':') != std::string::npos ? "[" + host + "]" : host, ":0"))
                 .ok()) {
    add(host);
  } else {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(host.c_str(), nullptr, &hints, &found) == 0) {
      for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
        char ip[INET6_ADDRSTRLEN];
        const void* raw =
            a->ai_family == AF_INET
                ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
                : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
        if ((a->ai_family == AF_INET || a->ai_family == AF_INET6) &&
            inet_ntop(a->ai_family, raw, ip, sizeof ip) != nullptr) {
          add(ip);
        }
      }
      freeaddrinfo(found);
    }
  }
  return out;
}

absl::StatusOr<uint32_t> OwnerOfSocket(const Endpoint& local, const Endpoint& remote) {
  // A dual-stack socket sees an IPv4 peer as ::ffff:a.b.c.d while the peer's own socket is IPv4:
  // ask in IPv4 first, then as the addresses were given.
  const Raw l4 = RawOf(local, true), r4 = RawOf(remote, true);
  absl::StatusOr<uint32_t> owner = absl::NotFoundError("");
  if (l4.family != AF_UNSPEC && l4.family == r4.family) owner = AskKernel(l4, r4);
  const Raw l6 = RawOf(local, false), r6 = RawOf(remote, false);
  if (absl::IsNotFound(owner.status()) && l6.family == AF_INET6 && r6.family == AF_INET6)
    owner = AskKernel(l6, r6);
  if (absl::IsNotFound(owner.status())) {
    return absl::NotFoundError(absl::StrCat("no socket of this host is ", local.ToString(),
                                            " connected to ", remote.ToString(),
                                            ": another host's"));
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
  // The other end's socket has the two addresses the other way round. The listener's end of a
  // connection this side just made may still be in the handshake's last step: asked again a
  // few times, a millisecond apart.
  absl::StatusOr<uint32_t> owner = OwnerOfSocket(peer, self);
  for (int i = 0; i < 50 && absl::IsFailedPrecondition(owner.status()); ++i) {
    usleep(1000);
    owner = OwnerOfSocket(peer, self);
  }
  return owner;
}

LoopbackUsers::LoopbackUsers(bool admit_remote)
    : uids_({static_cast<uint32_t>(geteuid())}), admit_remote_(admit_remote) {
  if (geteuid() != 0) uids_.push_back(0);
  std::sort(uids_.begin(), uids_.end());
}

LoopbackUsers::LoopbackUsers(std::vector<uint32_t> uids, bool admit_remote)
    : uids_(std::move(uids)), admit_remote_(admit_remote) {}

bool LoopbackUsers::Admits(uint32_t uid) const {
  return std::find(uids_.begin(), uids_.end(), uid) != uids_.end();
}

std::string LoopbackUsers::Describe() const {
  return absl::StrCat("uid ", absl::StrJoin(uids_, " and "));
}

absl::Status LoopbackUsers::Check(const absl::StatusOr<uint32_t>& owner, const std::string& who,
                                  absl::string_view what) const {
  if (owner.ok()) {
    if (Admits(*owner)) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": ", who, " belongs to uid ", *owner, "; without TLS this daemon admits only ",
        Describe(),
        " (other users: give their uids to --worker-uids to use the worker socket, or use TLS: "
        "docs/SECURITY.md)"));
  }
  // Another host's: only a listener given a routable address (--insecure-listen) meets one, and
  // there anyone who reaches it was accepted by that flag.
  if (absl::IsNotFound(owner.status()) && admit_remote_) return absl::OkStatus();
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
  if (IsUnixPeer(peer)) return absl::OkStatus();  // its file mode and credentials decide
  absl::StatusOr<Endpoint> caller = ParseGrpcPeer(peer);
  if (!caller.ok()) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, ": cannot read the caller's address \"", peer, "\""));
  }
  std::vector<Endpoint> locals;
  {
    absl::MutexLock lock(&mu_);
    locals = listeners_;
  }
  absl::StatusOr<uint32_t> owner =
      absl::NotFoundError("this daemon knows no TCP listener of its own yet");
  bool any = false;
  for (const Endpoint& local : locals) {
    absl::StatusOr<uint32_t> found = OwnerOfSocket(*caller, local);
    if (absl::IsNotFound(found.status())) continue;
    if (!found.ok() || !Admits(*found)) return Check(found, caller->ToString(), what);
    owner = found;
    any = true;
  }
  if (!any && !locals.empty()) {
    owner = absl::NotFoundError(absl::StrCat("no socket of this host is ", caller->ToString(),
                                             " connected to this daemon: another host's"));
  }
  return Check(owner, caller->ToString(), what);
}

}  // namespace refit
