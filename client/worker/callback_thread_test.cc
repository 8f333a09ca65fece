#include "client/worker/callback_thread.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace refit {
namespace {

TEST_CASE("callback thread: tasks run in order, off the posting thread; Stop runs what is queued") {
  std::vector<int> ran;
  std::atomic<bool> elsewhere{true};
  const auto poster = std::this_thread::get_id();
  {
    CallbackThread t;
    for (int i = 0; i < 100; ++i) {
      t.Post([&, i] {
        ran.push_back(i);
        if (std::this_thread::get_id() == poster) elsewhere = false;
      });
    }
    t.Stop();
    t.Post([&] { ran.push_back(-1); });  // after Stop: dropped
  }
  REQUIRE(ran.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(ran[i] == i);
  CHECK(elsewhere);
}

TEST_CASE("callback thread: Post never waits for a slow task") {
  CallbackThread t;
  absl::Notification release;
  t.Post([&] { release.WaitForNotificationWithTimeout(absl::Seconds(10)); });
  const absl::Time start = absl::Now();
  for (int i = 0; i < 10; ++i) t.Post([] {});
  CHECK(absl::Now() - start < absl::Milliseconds(100));
  release.Notify();
}

TEST_CASE("callback thread: Stop from one of its own tasks does not deadlock") {
  std::atomic<int> after{0};
  {
    CallbackThread t;
    absl::Notification go, done;
    t.Post([&] {
      go.WaitForNotificationWithTimeout(absl::Seconds(5));
      t.Stop();
      done.Notify();
    });
    t.Post([&] { after++; });  // queued before Stop: still runs
    go.Notify();
    REQUIRE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  }
  CHECK(after == 1);
}

}  // namespace
}  // namespace refit
