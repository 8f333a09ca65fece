// WatchRounds streams held open at once, in all and per caller (docs/SECURITY.md, "Bounded
// resources"). Each stream holds a server thread (and, on a node, one of the coordinator's,
// forwarded), so their number is bounded; and so that no one caller (a local user, a viewer
// certificate) can take every slot, each caller holds at most a share of them.
#pragma once

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/security/authority.h"

namespace refit {

// Who holds a slot, for its share.
struct WatchCaller {
  std::string key;   // one per caller: what its share is counted under
  std::string name;  // for errors: "certificate \"refit-viewer\""
  // False for a daemon forwarding its own callers' watches (each capped where it called): it
  // would otherwise take one caller's share for all of them.
  bool capped = true;
};

// The caller of a WatchRounds call:
// - TLS: its certificate (a node's daemon is not capped);
// - without TLS over loopback TCP: the daemon's own uid or root, the only users the authority
//   admits there (daemon/security/loopback_owner.h), and daemons forwarding watches; not capped;
// - without TLS from another host (--insecure-listen): that host's address;
// - the worker socket: its user, as the kernel says (the daemon accepts the socket's connections
//   itself: daemon/security/unix_callers.h); a unix caller of unknown user shares one share.
WatchCaller WatchCallerOf(const Caller& caller);

class WatchSlots {
 public:
  // Held while a stream is open; gives its slot back when destroyed.
  class Slot {
   public:
    Slot(Slot&& o) noexcept : slots_(o.slots_), key_(std::move(o.key_)) { o.slots_ = nullptr; }
    Slot& operator=(Slot&& o) noexcept;
    Slot(const Slot&) = delete;
    ~Slot();

   private:
    friend class WatchSlots;
    Slot(WatchSlots* slots, std::string key) : slots_(slots), key_(std::move(key)) {}
    WatchSlots* slots_;
    std::string key_;
  };

  WatchSlots(int total, int per_caller) : total_(total), per_caller_(per_caller) {}
  // A slot for `caller`, or RESOURCE_EXHAUSTED naming the cap it would pass (and the caller,
  // for its own share).
  absl::StatusOr<Slot> Acquire(const WatchCaller& caller) ABSL_LOCKS_EXCLUDED(mu_);
  int open() const ABSL_LOCKS_EXCLUDED(mu_);
  int held_by(const std::string& key) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Release(const std::string& key) ABSL_LOCKS_EXCLUDED(mu_);

  const int total_, per_caller_;
  mutable absl::Mutex mu_;
  int open_ ABSL_GUARDED_BY(mu_) = 0;
  struct Held {
    std::string name;
    int streams = 0;
  };
  // Every caller's, capped or not (the total's refusal names who holds most).
  absl::flat_hash_map<std::string, Held> by_caller_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
