// Notices that this process itself did not run for a while (SIGSTOP, a VM paused, a starved
// machine): two ticks, which come every `interval` while it runs, far further apart than that.
// A daemon that was not running could not receive its peers' heartbeats nor send its own; what
// it missed meanwhile is its own fault, not theirs: the coordinator's failure detector does not
// judge peers by heartbeats it could not receive, a round that failed while the coordinator was
// stopped names the coordinator, and a node's leases are not ended by its own freeze.
//
// Lock: `mu_` guards the last tick and the last pause; nothing is called while it is held.
#pragma once

#include <algorithm>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/base/clock.h"

namespace refit {

class PauseDetector {
 public:
  struct Pause {
    absl::Time began, ended;
    absl::Duration length() const { return ended - began; }
  };

  // A gap of more than `threshold` between two ticks is a pause.
  PauseDetector(const Clock* clock, absl::Duration threshold)
      : clock_(clock), threshold_(threshold) {}

  // Called by a loop at least every threshold / 2 (from any thread); returns the pause that
  // ended now, if this tick is the first after one.
  std::optional<Pause> Tick() {
    const absl::Time now = clock_->Now();
    absl::MutexLock lock(&mu_);
    std::optional<Pause> ended;
    if (last_tick_ != absl::InfinitePast() && now - last_tick_ > threshold_) {
      ended = last_pause_ = Pause{last_tick_, now};
    }
    last_tick_ = std::max(last_tick_, now);
    return ended;
  }

  // The latest pause (once a tick after it came), if any.
  std::optional<Pause> LastPause() const {
    absl::MutexLock lock(&mu_);
    return last_pause_;
  }

  // The latest pause ended less than `window` ago.
  bool PausedWithin(absl::Duration window) const {
    const absl::Time now = clock_->Now();
    absl::MutexLock lock(&mu_);
    return last_pause_.has_value() && now - last_pause_->ended < window;
  }

  absl::Duration threshold() const { return threshold_; }

 private:
  const Clock* const clock_;
  const absl::Duration threshold_;

  mutable absl::Mutex mu_;
  absl::Time last_tick_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::optional<Pause> last_pause_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
