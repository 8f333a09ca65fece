#include "daemon/dataplane/wait_pacer.h"

#include <catch2/catch.hpp>

namespace refit {
namespace {

using absl::Microseconds;
using absl::Milliseconds;

TEST_CASE("with nothing expected, only the first two milliseconds are spun", "[wait_pacer]") {
  const WaitPacer p(absl::ZeroDuration());
  CHECK(p.ShouldSpin(absl::ZeroDuration()));
  CHECK(p.ShouldSpin(Microseconds(1999)));
  CHECK_FALSE(p.ShouldSpin(Milliseconds(2)));
  CHECK_FALSE(p.ShouldSpin(Milliseconds(500)));
  CHECK_FALSE(WaitPacer(Milliseconds(-1)).ShouldSpin(Milliseconds(3)));
}

TEST_CASE("work that took 2.5 ms last time is spun through until it is well past that",
          "[wait_pacer]") {
  // The colocated refit of many small tensors: its copy ends just after the first spin, where a
  // sleeping poll would see the end up to 20 us late.
  const WaitPacer p(Microseconds(2500));
  CHECK(p.window_begin() == Microseconds(1875));
  CHECK(p.window_end() == Microseconds(3750));
  for (int us = 0; us < 3750; us += 10) CHECK(p.ShouldSpin(Microseconds(us)));
  CHECK_FALSE(p.ShouldSpin(Microseconds(3750)));
  CHECK_FALSE(p.ShouldSpin(Milliseconds(10)));
}

TEST_CASE("a long stage sleeps but for a few milliseconds around its expected end",
          "[wait_pacer]") {
  const WaitPacer p(Milliseconds(100));
  CHECK(p.window_begin() == Milliseconds(99));
  CHECK(p.window_end() == Milliseconds(102));
  CHECK_FALSE(p.ShouldSpin(Milliseconds(3)));
  CHECK_FALSE(p.ShouldSpin(Milliseconds(50)));
  CHECK_FALSE(p.ShouldSpin(Microseconds(98999)));
  CHECK(p.ShouldSpin(Milliseconds(99)));
  CHECK(p.ShouldSpin(Microseconds(101999)));
  CHECK_FALSE(p.ShouldSpin(Milliseconds(102)));
  CHECK_FALSE(p.ShouldSpin(absl::Seconds(1)));
}

TEST_CASE("the window never spins a core for more than 3 ms beyond the first two", "[wait_pacer]") {
  for (absl::Duration e : {Microseconds(10), Milliseconds(1), Milliseconds(7), absl::Seconds(5)}) {
    const WaitPacer p(e);
    CHECK(p.window_begin() <= e);
    CHECK(p.window_end() > e);
    CHECK(p.window_end() - p.window_begin() <= Milliseconds(3));
  }
}

}  // namespace
}  // namespace refit
