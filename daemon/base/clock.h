// Time as the daemon's components read it: injected, so that tests drive failure detection and
// deadlines without sleeping.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace refit {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // The process's real clock (absl::Now); never destroyed.
  static const Clock* Real();
};

// A clock that moves only when told to (tests).
class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'000'000)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

inline const Clock* Clock::Real() {
  struct RealClock : Clock {
    absl::Time Now() const override { return absl::Now(); }
  };
  static const RealClock* clock = new RealClock;
  return clock;
}

}  // namespace refit
