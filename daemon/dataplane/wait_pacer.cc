#include "daemon/dataplane/wait_pacer.h"

#include <algorithm>

namespace refit {

absl::Duration WaitPacer::window_begin() const {
  if (expected_ <= absl::ZeroDuration()) return absl::ZeroDuration();
  return expected_ - std::min(expected_ / 4, absl::Milliseconds(1));
}

absl::Duration WaitPacer::window_end() const {
  if (expected_ <= absl::ZeroDuration()) return absl::ZeroDuration();
  return expected_ + std::min(expected_ / 2, absl::Milliseconds(2));
}

bool WaitPacer::ShouldSpin(absl::Duration elapsed) const {
  if (elapsed < kSpinFirst) return true;
  return elapsed >= window_begin() && elapsed < window_end();
}

}  // namespace refit
