// The worker socket's callers, each known by the user the kernel says it runs as.
//
// gRPC names every caller of a unix socket it listens on alike ("unix:"), and its auth context
// carries no uid, so nothing shared per caller (WatchRounds slots) could be kept per user. So the
// daemon listens on that socket itself: each connection it accepts is read for its credentials
// (SO_PEERCRED), recorded under its descriptor, and handed to gRPC (AddInsecureChannelFromFd),
// whose peer for it is then "fd:<descriptor>". UnixCallerOf reads the credentials back from that
// peer. The record is process-wide, keyed by descriptor number: a number is reused only after
// gRPC closed its connection, and the accept that reuses it records the new caller before gRPC
// sees it; so the record holds at most one entry per descriptor the process may open.
#pragma once

#include <poll.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "daemon/base/socket.h"

namespace refit {

struct UnixCredentials {
  uint32_t uid = 0;
  int32_t pid = 0;
};

// The credentials of the connection behind gRPC peer `peer` ("fd:<n>"), if it came through a
// UnixCallerListener; nullopt for any other peer.
std::optional<UnixCredentials> UnixCallerOf(absl::string_view peer);

// How many served connections (handed to gRPC and not yet closed by it) one user, and all users,
// may hold: each holds a descriptor of the daemon until gRPC closes it (by its keepalive, within a
// minute of a caller going quiet), and descriptors, once out, are out for everyone (rounds open
// sockets, workers hand memory over). A connection past either is closed at once.
struct ServedLimits {
  size_t per_uid = 1024;
  size_t total = 8192;
  // From the process's descriptor limit: an eighth of it per user (64 to 1024), half in all (256
  // to 8192).
  static ServedLimits ForDescriptorLimit();
};

// Listens on a unix socket path and hands each connection, its credentials recorded, to `serve`
// (which owns the descriptor from then on: gRPC's AddInsecureChannelFromFd) once it has sent its
// first byte. gRPC gives a connection it is handed no handshake deadline (its own listeners close
// one that sends no HTTP/2 settings in time), so the deadline is kept here: a connection that
// sends nothing within `first_byte_timeout` is closed, and of more than kMaxWaiting silent ones
// the oldest of the user holding the most is closed, so that idle connections never hold
// descriptors for good nor keep a worker out. A connection that wrote before it was accepted (a
// gRPC client's preface) is handed over at once. Served connections are bounded per user and in
// all (ServedLimits).
class UnixCallerListener {
 public:
  static constexpr size_t kMaxWaiting = 256;
  // Accepted in one go before the waiting connections are polled again: the backlog is drained
  // faster than a storm of connections fills it (it is shared by every user of the socket).
  static constexpr size_t kMaxAcceptsPerWake = 1024;

  // Binds and listens at `path` (a stale socket there is removed first); INVALID_ARGUMENT for a
  // path too long for a unix socket, UNAVAILABLE naming the path and errno otherwise. `serve` is
  // called on the listener's thread, one connection at a time.
  static absl::StatusOr<std::unique_ptr<UnixCallerListener>> Start(
      const std::string& path, std::function<void(int fd)> serve,
      absl::Duration first_byte_timeout = absl::Seconds(10),
      ServedLimits limits = ServedLimits::ForDescriptorLimit());
  ~UnixCallerListener();  // stops accepting and removes the socket file
  UnixCallerListener(const UnixCallerListener&) = delete;
  UnixCallerListener& operator=(const UnixCallerListener&) = delete;

  const std::string& path() const { return path_; }
  int64_t accepted() const { return accepted_.load(); }  // handed to `serve`
  int64_t closed_silent() const { return closed_silent_.load(); }
  int64_t closed_over_limit() const { return closed_over_limit_.load(); }  // ServedLimits

 private:
  // Accepted, not yet handed over: waiting for its first byte (only the listener's thread).
  struct Waiting {
    Fd fd;
    UnixCredentials credentials;
    absl::Time deadline;
  };

  // Handed over: its socket's device and inode tell whether the descriptor still holds it.
  struct Served {
    uint32_t uid = 0;
    uint64_t device = 0, inode = 0;
  };

  UnixCallerListener(std::string path, std::function<void(int)> serve, absl::Duration timeout,
                     ServedLimits limits)
      : path_(std::move(path)),
        serve_(std::move(serve)),
        first_byte_timeout_(timeout),
        limits_(limits) {}
  void Loop();
  // Accepts what is pending, up to kMaxAcceptsPerWake: a connection that has written is served
  // at once, the others wait. False once accept fails for want of descriptors or memory.
  bool AcceptPending();
  // Closes the oldest waiting connection of the user that has the most waiting.
  void EvictOne();
  void Forget(uint32_t uid);  // one of its waiting connections is gone
  // Hands `fd` to `serve`, or closes it when its user or all are at their ServedLimits.
  void Serve(Fd fd, const UnixCredentials& credentials);
  // Whether `uid` may have one more connection served; counts again what gRPC has closed first
  // when at a limit (at most every kRecountEvery: a user at its limit is not recounted per try).
  bool MayServe(uint32_t uid);
  void Recount();  // drops the served connections whose descriptors gRPC has closed
  // Hands over the waiting connections that sent a byte; closes those that ended, or whose
  // deadline passed. `polled[i]` is waiting_[i]'s poll entry.
  void Settle(absl::Span<const pollfd> polled);
  void CloseSilent(Waiting& w, const char* why);

  const std::string path_;
  const std::function<void(int)> serve_;
  const absl::Duration first_byte_timeout_;
  const ServedLimits limits_;
  static constexpr absl::Duration kRecountEvery = absl::Milliseconds(100);
  std::vector<Waiting> waiting_;  // oldest first
  absl::flat_hash_map<uint32_t, int> waiting_of_uid_;
  absl::flat_hash_map<int, Served> served_;  // by descriptor
  absl::flat_hash_map<uint32_t, size_t> served_of_uid_;
  absl::Time recounted_ = absl::InfinitePast();
  absl::Time limit_logged_ = absl::InfinitePast();
  absl::Time error_logged_ = absl::InfinitePast();
  Fd listener_;
  Fd wake_read_, wake_write_;  // a byte written here ends Loop
  std::atomic<int64_t> accepted_{0};
  std::atomic<int64_t> closed_silent_{0};
  std::atomic<int64_t> closed_over_limit_{0};
  std::thread thread_;
};

}  // namespace refit
