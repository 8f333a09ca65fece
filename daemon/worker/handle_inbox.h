// The handle socket, `<worker socket>.handles`: where a worker hands the daemon file descriptors
// (its shared memory, its CUDA VMM allocations) before it registers, under a token of its own
// choosing; Register claims them by that token. Memory is handed over as descriptors, never
// named: a name in /dev/shm can be opened by any local process, and outlives the worker that made
// it. daemon/README.md has the wire protocol and why each bound is what it is.
//
// Wire protocol (SOCK_SEQPACKET, so a packet arrives whole or not at all). Worker -> daemon, one
// or more packets of exactly 44 bytes each:
//   "RFH1" | token: 32 lowercase hex chars | u32 LE: descriptors attached (SCM_RIGHTS, <= 250) |
//   u32 LE flags: bit 0 = the last packet of the delivery, other bits 0
// The descriptors of a connection's packets are appended in order. After the last packet the
// daemon answers with one packet and closes: "OK\0\0" | u32 LE total descriptors, or
// "ER\0\0" | u32 LE length | UTF-8 message. One delivery per connection.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/base/socket.h"

namespace refit {

inline constexpr char kHandleMagic[4] = {'R', 'F', 'H', '1'};
inline constexpr size_t kHandleTokenChars = 32;
inline constexpr size_t kHandlePacketBytes = 4 + kHandleTokenChars + 4 + 4;
inline constexpr uint32_t kHandleLastPacket = 1;
inline constexpr int kMaxHandlesPerPacket = 250;  // Linux takes at most 253 (SCM_MAX_FD)

struct HandleInboxOptions {
  std::string path;  // the socket; a stale one is replaced
  // Permission bits given to the socket (0: as the umask leaves them). The daemon passes its
  // worker socket's own bits: whoever may register may hand over memory, and nobody else.
  uint32_t mode = 0;
  absl::Duration idle_timeout = absl::Seconds(5);       // a connection silent this long is closed
  absl::Duration delivery_timeout = absl::Seconds(60);  // a connection open this long is closed
  absl::Duration ttl = absl::Seconds(60);               // unclaimed deliveries expire, closed
  int max_pending = 64;                                 // unclaimed deliveries
  // Unclaimed deliveries of one uid: one uid cannot fill the queue for the others.
  int max_pending_per_uid = 32;
  int64_t max_fds = 65536;   // per delivery, and held by the inbox in all (pending and arriving)
  int max_connections = 64;  // delivering at once; more are refused at once ("busy")
  std::function<absl::Time()> clock;  // for tests; absl::Now when empty
  // Whose connections are served, by their SO_PEERCRED uid (empty: everyone's). A connection of
  // another uid, or whose credentials cannot be read, is answered "ER" naming its uid and closed
  // at once, before any descriptor of it is kept. The daemon passes WorkerAdmission's rule
  // (--worker-uids): only a process that may register may hand memory over.
  std::function<bool(uid_t)> admit_uid;
};

// The descriptors of one delivery, in the order sent, and who sent them.
struct HandleDelivery {
  std::vector<Fd> fds;
  pid_t pid = 0;  // SO_PEERCRED of the delivering connection (for the security work to come)
  uid_t uid = 0;
  gid_t gid = 0;
  absl::Time arrived;
};

class HandleInbox {
 public:
  static absl::StatusOr<std::unique_ptr<HandleInbox>> Start(HandleInboxOptions options);
  ~HandleInbox();  // closes every descriptor it holds and removes the socket
  HandleInbox(const HandleInbox&) = delete;
  HandleInbox& operator=(const HandleInbox&) = delete;

  // The delivery made under `token`, exactly once: afterwards the inbox no longer has it.
  // NOT_FOUND when nothing arrived under it, or when it expired unclaimed.
  absl::StatusOr<HandleDelivery> Take(const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string& path() const { return options_.path; }

  struct Counts {
    int deliveries = 0;   // pending, unclaimed
    int64_t fds = 0;      // held in all: pending deliveries and connections still delivering
    int connections = 0;  // delivering now
  };
  Counts counts() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Connection;
  struct Packet;
  struct PacketHeader;
  explicit HandleInbox(HandleInboxOptions options);
  absl::Time Now() const { return options_.clock ? options_.clock() : absl::Now(); }
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  void AcceptSome(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // Reads one packet; false when the connection is finished (answered or dropped).
  bool ReadPacket(Connection& c, absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // The steps of ReadPacket; an error's message is why the connection is refused.
  // recvmsg of one packet, its descriptors owned before anything else is looked at.
  static Packet Receive(int fd);
  // The packet's header, where the packet is well formed and fits the connection's delivery.
  absl::StatusOr<PacketHeader> CheckPacket(const Packet& p, const Connection& c) const;
  // The connection's token, from its first packet: not one arriving on another connection too.
  absl::Status AdoptToken(Connection& c, const std::string& token) const;
  // Counts `n` more descriptors as held, where the inbox's bounds allow them.
  absl::Status HoldDescriptors(const std::string& token, size_t n) ABSL_LOCKS_EXCLUDED(mu_);
  // After the last packet: the delivery made pending under its token, where the bounds allow it,
  // and the connection answered and closed.
  absl::Status Deliver(Connection& c, const std::string& token, absl::Time now)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Refuse(Connection& c, const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  void Expire(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const HandleInboxOptions options_;
  Fd listener_;
  Fd wake_;          // eventfd: Shutdown wakes the loop
  ino_t inode_ = 0;  // of the socket this inbox bound: only that one is removed at the end
  std::thread loop_;
  // The loop thread's own (no lock): the connections delivering, and accept()'s back-off.
  std::vector<std::unique_ptr<Connection>> connections_;
  absl::Time accept_resume_ = absl::InfinitePast();  // backing off after EMFILE and the like
  absl::Time accept_error_logged_ = absl::InfinitePast();
  int accept_errors_unlogged_ = 0;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, HandleDelivery> pending_ ABSL_GUARDED_BY(mu_);  // by token
  int64_t held_fds_ ABSL_GUARDED_BY(mu_) = 0;  // in pending_ and in connections_
  int connections_open_ ABSL_GUARDED_BY(mu_) = 0;
  // Tokens of recently expired deliveries (bounded): Take tells "expired" from "never sent".
  std::deque<std::string> expired_order_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> expired_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
