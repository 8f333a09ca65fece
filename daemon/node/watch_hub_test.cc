// A node's watchers share one stream from the coordinator: rounds reach each watcher of their
// group, the stream opens with the first watcher and closes after the last, its end (a refusal)
// ends every watch, and a watcher that stops reading is dropped rather than queued without bound.
#include "daemon/node/watch_hub.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace refit {
namespace {

// The coordinator's stream, played by the test: rounds to send, and how it ends.
struct FakeCoordinator {
  absl::Mutex mu;
  std::vector<v1::RoundStats> to_send ABSL_GUARDED_BY(mu);
  std::optional<absl::Status> end ABSL_GUARDED_BY(mu);
  std::atomic<int> streams{0}, open{0};

  WatchHub::Upstream Upstream() {
    return [this](const std::function<bool()>& stop,
                  const std::function<bool(const v1::RoundStats&)>& deliver,
                  const std::function<void()>& opened) -> absl::Status {
      ++streams;
      ++open;
      opened();
      while (true) {
        std::vector<v1::RoundStats> batch;
        std::optional<absl::Status> ended;
        {
          absl::MutexLock lock(&mu);
          batch.swap(to_send);
          ended = end;
          end.reset();
        }
        for (const auto& s : batch) deliver(s);
        if (ended.has_value()) {
          --open;
          return *ended;
        }
        if (stop()) {
          --open;
          return absl::OkStatus();
        }
        absl::SleepFor(absl::Milliseconds(5));
      }
    };
  }
  void Send(const std::string& group, int64_t round) {
    v1::RoundStats s;
    s.set_group(group);
    s.set_round_id(round);
    absl::MutexLock lock(&mu);
    to_send.push_back(s);
  }
  void End(absl::Status s) {
    absl::MutexLock lock(&mu);
    end = std::move(s);
  }
};

// One caller's watch on its own thread: what it was written, and how it ended.
struct Caller {
  std::atomic<bool> cancel{false};
  absl::Notification opened, done;
  absl::Mutex mu;
  std::vector<int64_t> rounds ABSL_GUARDED_BY(mu);
  absl::Status status;
  std::thread thread;
  int64_t stall_after = -1;  // stops reading (a write that blocks) after this many rounds

  void Start(WatchHub& hub, const std::string& group) {
    thread = std::thread([this, &hub, group] {
      status = hub.Watch(
          group, [this] { return cancel.load(); },
          [this](const v1::RoundStats& s) {
            absl::MutexLock lock(&mu);
            rounds.push_back(s.round_id());
            if (stall_after >= 0 && static_cast<int64_t>(rounds.size()) >= stall_after)
              mu.Await(absl::Condition(
                  +[](std::atomic<bool>* c) { return c->load(); }, &cancel));
            return true;
          },
          [this] { opened.Notify(); });
      done.Notify();
    });
  }
  size_t Count() {
    absl::MutexLock lock(&mu);
    return rounds.size();
  }
  ~Caller() {
    cancel = true;
    if (thread.joinable()) thread.join();
  }
};

bool Eventually(const std::function<bool()>& f) {
  for (int i = 0; i < 500; ++i) {
    if (f()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return f();
}

TEST_CASE("a node's watchers share one stream and each gets its group's rounds") {
  FakeCoordinator coordinator;
  WatchHub hub(coordinator.Upstream());
  Caller policy, all, other;
  policy.Start(hub, "policy");
  all.Start(hub, "");
  other.Start(hub, "critic");
  REQUIRE(policy.opened.WaitForNotificationWithTimeout(absl::Seconds(5)));
  REQUIRE(all.opened.WaitForNotificationWithTimeout(absl::Seconds(5)));
  REQUIRE(other.opened.WaitForNotificationWithTimeout(absl::Seconds(5)));
  REQUIRE(Eventually([&] { return hub.watchers() == 3; }));
  coordinator.Send("policy", 1);
  coordinator.Send("critic", 2);
  coordinator.Send("policy", 3);
  REQUIRE(
      Eventually([&] { return all.Count() == 3 && policy.Count() == 2 && other.Count() == 1; }));
  CHECK(coordinator.streams == 1);
  {
    absl::MutexLock lock(&policy.mu);
    CHECK(policy.rounds == std::vector<int64_t>{1, 3});
  }

  // The last watcher gone, the stream closes; the next one opens a new one.
  policy.cancel = all.cancel = other.cancel = true;
  REQUIRE(policy.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  REQUIRE(all.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  REQUIRE(other.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  CHECK(policy.status.ok());
  REQUIRE(Eventually([&] { return coordinator.open == 0; }));
  Caller later;
  later.Start(hub, "policy");
  REQUIRE(later.opened.WaitForNotificationWithTimeout(absl::Seconds(5)));
  coordinator.Send("policy", 4);
  REQUIRE(Eventually([&] { return later.Count() == 1; }));
  CHECK(coordinator.streams == 2);
  CHECK(hub.streams_opened() == 2);
}

TEST_CASE("the coordinator's end of the stream ends every watch with its status") {
  FakeCoordinator coordinator;
  WatchHub hub(coordinator.Upstream());
  Caller a, b;
  a.Start(hub, "policy");
  b.Start(hub, "");
  REQUIRE(Eventually([&] { return hub.watchers() == 2 && coordinator.open == 1; }));
  coordinator.End(absl::ResourceExhaustedError("WatchRounds: 64 streams are open"));
  REQUIRE(a.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  REQUIRE(b.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  CHECK(a.status.code() == absl::StatusCode::kResourceExhausted);
  CHECK(b.status.message() == "WatchRounds: 64 streams are open");
  CHECK(hub.watchers() == 0);
}

TEST_CASE("a watcher that stops reading is dropped, the others go on") {
  FakeCoordinator coordinator;
  WatchHub hub(coordinator.Upstream());
  Caller slow, fast;
  slow.stall_after = 1;
  slow.Start(hub, "policy");
  fast.Start(hub, "policy");
  REQUIRE(Eventually([&] { return hub.watchers() == 2 && coordinator.open == 1; }));
  const int64_t n =
      2 * WatchHub::kMaxQueued;  // its queue overflows, whatever it took before it stalled
  for (int64_t i = 1; i <= n; ++i) {
    coordinator.Send("policy", i);
    if (i % 100 == 0) REQUIRE(Eventually([&] { return fast.Count() == static_cast<size_t>(i); }));
  }
  REQUIRE(Eventually([&] { return fast.Count() == static_cast<size_t>(n); }));
  {
    absl::MutexLock lock(&slow.mu);  // Await looks again when the mutex is released
    slow.cancel = true;              // lets its blocked write return
  }
  REQUIRE(slow.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  CHECK(slow.status.code() == absl::StatusCode::kResourceExhausted);
  CHECK(fast.status.ok());
  CHECK_FALSE(fast.done.HasBeenNotified());
}

TEST_CASE("a hub going away ends its watches as unavailable") {
  FakeCoordinator coordinator;
  Caller a;
  {
    WatchHub hub(coordinator.Upstream());
    a.Start(hub, "");
    REQUIRE(a.opened.WaitForNotificationWithTimeout(absl::Seconds(5)));
  }
  REQUIRE(a.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  CHECK(a.status.code() == absl::StatusCode::kUnavailable);
  CHECK(coordinator.open == 0);
}

}  // namespace
}  // namespace refit
