// Membership on an injected clock: heartbeats keep a node alive, silence past
// heartbeat x heartbeats_missed declares it dead (its workers gone, the group's epoch bumped, its
// next heartbeat asked to resync); a new incarnation is a restarted node.
#include "daemon/membership.h"

#include <catch2/catch.hpp>

#include "daemon/test_registrations.h"

namespace refit {
namespace {
using testing::JoinOf;
using testing::Registration;
using testing::SyncOf;

TEST_CASE("membership: failure detection on the injected clock") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);  // dead after 2 s of silence
  m.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
  m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0));
  CHECK(m.Join(JoinOf(1, 11)));  // new: send the workers
  m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)}));
  const int64_t epoch = m.Group("policy").epoch;
  CHECK(m.Group("policy").nodes == std::vector<int32_t>{0, 1});

  // Heartbeats every second for 10 s: alive throughout.
  for (int i = 0; i < 10; ++i) {
    clock.Advance(absl::Seconds(1));
    CHECK_FALSE(m.Join(JoinOf(1, 11)));
    CHECK(m.CheckLiveness().empty());
  }
  CHECK(m.ControlAddress(1).ok());
  CHECK(m.Group("policy").epoch == epoch);

  // Silent for exactly the limit: still alive; a moment more: dead.
  clock.Advance(absl::Seconds(2));
  CHECK(m.CheckLiveness().empty());
  clock.Advance(absl::Milliseconds(1));
  const std::vector<DeadNode> dead = m.CheckLiveness();
  REQUIRE(dead.size() == 1);
  CHECK(dead[0].node == 1);
  CHECK(dead[0].why == "no heartbeat for 2s");
  CHECK(m.CheckLiveness().empty());  // declared once
  CHECK(m.ControlAddress(1).status().code() == absl::StatusCode::kUnavailable);
  CHECK(m.DeathReason(1) == std::optional<std::string>("no heartbeat for 2s"));
  CHECK(m.DeathReason(0) == std::nullopt);
  const GroupMembers after = m.Group("policy");
  CHECK(after.epoch == epoch + 1);
  CHECK(after.nodes == std::vector<int32_t>{0});
  CHECK(after.inference == 0);

  // It comes back with the same incarnation: asked to resync, alive, no longer "dead".
  CHECK(m.Join(JoinOf(1, 11)));
  CHECK(m.ControlAddress(1).ok());
  CHECK(m.DeathReason(1) == std::nullopt);
  m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)}));
  CHECK(m.Group("policy").inference == 1);
  CHECK(m.Group("policy").epoch == epoch + 2);
}

TEST_CASE("membership: the coordinator itself is never judged by heartbeats") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0));
  clock.Advance(absl::Hours(1));
  CHECK(m.CheckLiveness().empty());
  CHECK(m.ControlAddress(0).ok());
}

TEST_CASE("membership: a new incarnation is a restarted node; its old workers are gone") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  CHECK(m.Join(JoinOf(2, 100)));
  m.ApplySync(SyncOf(2, 100, {Registration("t0", v1::TRAINER, 0, 8, 2), Registration("i0", v1::INFERENCE, 0, 8, 2)}));
  const GroupMembers before = m.Group("policy");
  CHECK(before.trainers == 1);
  CHECK(before.inference == 1);

  CHECK(m.Join(JoinOf(2, 200)));  // restarted: resync
  const GroupMembers restarted = m.Group("policy");
  CHECK(restarted.trainers == 0);
  CHECK(restarted.inference == 0);
  CHECK(restarted.epoch == before.epoch + 1);
  CHECK_FALSE(m.Join(JoinOf(2, 200)));  // its heartbeats from now on
  m.ApplySync(SyncOf(2, 200, {Registration("t0", v1::TRAINER, 0, 8, 2)}));
  CHECK(m.Group("policy").trainers == 1);
  // The same workers under a new incarnation are a new membership.
  CHECK(m.Group("policy").epoch == before.epoch + 2);

  // A heartbeat of the old incarnation (a late packet) does not count as the new one's.
  clock.Advance(absl::Seconds(3));
  CHECK(m.Join(JoinOf(2, 100)));
  CHECK(m.Group("policy").trainers == 0);
}

TEST_CASE("membership: the coordinator's own workers come and go one at a time") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  CHECK_FALSE(m.Group("policy").exists);
  m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0));
  m.AddLocal(Registration("i0", v1::INFERENCE, 0, 8, 0));
  CHECK(m.Group("policy").exists);
  CHECK(m.GroupNames() == std::vector<std::string>{"policy"});
  const int64_t epoch = m.Group("policy").epoch;
  m.RemoveLocal("policy/i0");
  CHECK(m.Group("policy").inference == 0);
  CHECK(m.Group("policy").epoch == epoch + 1);
  v1::ListWorkersResponse listed;
  m.ListWorkers(v1::ListWorkersRequest(), &listed);
  REQUIRE(listed.workers_size() == 1);
  CHECK(listed.workers(0).worker_id() == "policy/t0");
}

}  // namespace
}  // namespace refit
