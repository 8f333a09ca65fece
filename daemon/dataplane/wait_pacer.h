// How a data plane waits for work it launched on a device: by spinning (a core busy, the end seen
// at once) or by sleeping between polls (a core free, the end seen up to one poll late). It spins
// where the work most likely ends: at first, since short work ends within a millisecond or two,
// and around the time the same work took the last time it ran, which a refit repeats round after
// round. Elsewhere it sleeps, so a long stage costs no core.
#pragma once

#include "absl/time/time.h"

namespace refit {

class WaitPacer {
 public:
  // Spun through from the wait's start.
  static constexpr absl::Duration kSpinFirst = absl::Milliseconds(2);
  // The sleep between polls outside the spinning windows.
  static constexpr absl::Duration kPoll = absl::Microseconds(20);

  // `expected`: how long the same wait took last time (zero or less: unknown).
  explicit WaitPacer(absl::Duration expected) : expected_(expected) {}

  // Whether to poll again at once, `elapsed` into the wait.
  bool ShouldSpin(absl::Duration elapsed) const;

  // The window around `expected` spun through: from a quarter of it (at most 1 ms) before to half
  // of it (at most 2 ms) after. Empty when nothing is expected.
  absl::Duration window_begin() const;
  absl::Duration window_end() const;

 private:
  absl::Duration expected_;
};

}  // namespace refit
