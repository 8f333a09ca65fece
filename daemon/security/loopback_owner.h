// Which local user owns the other end of a TCP connection.
//
// Without TLS a daemon's TCP ports are loopback only, and loopback is every process of every user
// on the host (and every hostNetwork pod). The kernel knows which uid created each socket; it
// says so through NETLINK_SOCK_DIAG (the interface of `ss`), asked for the one socket with the
// connection's four addresses: a lookup in the kernel's hash, no privilege needed, tens of
// microseconds. So a daemon without TLS admits only connections whose other end its own uid (or
// root) owns: the peer's socket for a connection it accepted, the accepting socket for one it
// made (a process of another uid listening on a port a dead daemon used gets no weights). Every
// connection is asked about, whatever its addresses: a local process may connect from any of the
// host's addresses, and only another host's socket is not found.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace refit {

// An IPv4 or IPv6 address and port.
struct Endpoint {
  sockaddr_storage address{};
  std::string ToString() const;
};

// True for 127.0.0.0/8, ::1 and ::ffff:127.0.0.0/104.
bool IsLoopback(const Endpoint& e);
// gRPC's peer string, a URI ("ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:5000"); NOT_FOUND for others.
absl::StatusOr<Endpoint> ParseGrpcPeer(absl::string_view peer);
// "unix:..." or "unix-abstract:...", or a connection the daemon accepted on its worker socket
// ("fd:<n>", unix_callers.h): a unix socket's caller.
bool IsUnixPeer(absl::string_view peer);
// "127.0.0.1:5000", "[::1]:5000", "localhost:5000" (as 127.0.0.1).
absl::StatusOr<Endpoint> ParseHostPort(absl::string_view address);
// The addresses a listener configured as `configured` ("host:port", the port possibly 0) and bound
// to `port` accepts connections on: the host's IP, both loopbacks for "localhost", every address
// of this host for a wildcard ("0.0.0.0", "[::]").
std::vector<Endpoint> ListenerAddresses(absl::string_view configured, int port);

// The uid that owns the socket whose own address is `local` and whose peer is `remote` (the
// kernel's view of that socket). NOT_FOUND when this host has none (the other end is another
// host's); ABORTED when it is no longer open (its process closed it: the kernel then reports
// uid 0 for it); FAILED_PRECONDITION while it is still in the handshake (a listener's end).
absl::StatusOr<uint32_t> OwnerOfSocket(const Endpoint& local, const Endpoint& remote);
// The uid that owns the other end of the connected socket `fd` (waiting up to 50 ms for a
// listener's end still in the handshake).
absl::StatusOr<uint32_t> OwnerOfPeer(int fd);

// Who may reach a daemon's TCP ports without TLS: its own effective uid and root (which can read
// any process' memory anyway), and, with --insecure-listen, other hosts.
class LoopbackUsers {
 public:
  explicit LoopbackUsers(bool admit_remote = false);  // geteuid() and 0
  LoopbackUsers(std::vector<uint32_t> uids, bool admit_remote);
  LoopbackUsers(const LoopbackUsers&) = delete;
  LoopbackUsers& operator=(const LoopbackUsers&) = delete;
  bool Admits(uint32_t uid) const;
  // "uid 0 and 1000", for errors.
  std::string Describe() const;
  // OK when the other end of `fd` is owned by an admitted uid (or is another host's and those
  // are admitted); PERMISSION_DENIED naming the uid, or why the owner is unknown, otherwise.
  // `what` begins the message.
  absl::Status CheckPeer(int fd, absl::string_view what) const;
  // A TCP listener of this daemon's gRPC servers, as bound (a call's peer string names only the
  // caller's end; the kernel's lookup needs both).
  void AddListener(const Endpoint& local) ABSL_LOCKS_EXCLUDED(mu_);
  // The same as CheckPeer for a gRPC call, from its peer string: every socket of this host with
  // the caller's address connected to one of the listeners must be admitted (a process can bind
  // the address and port of another user's connection to another listener). OK for a unix
  // socket's caller (its file mode and credentials decide); refused when the peer cannot be read.
  absl::Status CheckGrpcPeer(absl::string_view peer, absl::string_view what) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Status Check(const absl::StatusOr<uint32_t>& owner, const std::string& who,
                     absl::string_view what) const;
  std::vector<uint32_t> uids_;
  const bool admit_remote_;
  mutable absl::Mutex mu_;
  std::vector<Endpoint> listeners_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
