// Membership on an injected clock: heartbeats keep a node alive, silence past
// heartbeat x heartbeats_missed declares it dead (its workers gone, the group's epoch bumped, its
// next heartbeat asked to resync); a new incarnation is a restarted node.
#include "daemon/coordinator/membership.h"

#include <catch2/catch.hpp>

#include "daemon/testing/test_registrations.h"

namespace refit {
namespace {
using testing::JoinOf;
using testing::Registration;
using testing::SyncOf;
using testing::WholeTensor;

TEST_CASE("membership: failure detection on the injected clock") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);  // dead after 2 s of silence
  m.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  CHECK(m.Join(JoinOf(1, 11)));  // new: send the workers
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)})).ok());
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
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)})).ok());
  CHECK(m.Group("policy").inference == 1);
  CHECK(m.Group("policy").epoch == epoch + 2);
}

// A node frozen past the verdict whose workers re-register (a SyncWorkers) before its
// next heartbeat was revived by the sync; its heartbeat then took the fast path and the node
// never learned it had been declared dead, so it never aborted its open round.
TEST_CASE("membership: Epoch answers what Group's epoch is, without the registrations") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  CHECK(m.Epoch("policy") == m.Group("policy").epoch);  // no such group yet
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  const int64_t first = m.Epoch("policy");
  CHECK(first == m.Group("policy").epoch);
  REQUIRE(m.AddLocal(Registration("i0", v1::INFERENCE, 0, 8, 0)).ok());
  CHECK(m.Epoch("policy") > first);
  CHECK(m.Epoch("policy") == m.Group("policy").epoch);
}

TEST_CASE("membership: a node declared dead is not revived by a sync; its heartbeat says resync") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
  CHECK(m.Join(JoinOf(1, 11)));
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)})).ok());
  clock.Advance(absl::Seconds(3));
  REQUIRE(m.CheckLiveness().size() == 1);

  const absl::Status revived =
      m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)}));
  CHECK(revived.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(revived.message()),
             Catch::Contains("declared dead (no heartbeat for 2s)"));
  CHECK(m.Group("policy").inference == 0);  // nothing of the refused sync was taken
  CHECK(m.DeathReason(1).has_value());
  CHECK(m.Join(JoinOf(1, 11)));  // the heartbeat's answer: resync (the node aborts its rounds)
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)})).ok());
  CHECK(m.Group("policy").inference == 1);

  // Never joined, or joined at another incarnation: refused likewise.
  CHECK(m.ApplySync(SyncOf(2, 5, {})).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(m.ApplySync(SyncOf(1, 12, {})).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(m.Group("policy").inference == 1);
}

// A node revived by a heartbeat whose answer it never got (late, or lost) did not know it had to
// send its workers: its later heartbeats took the fast path and it stayed alive with none for good.
TEST_CASE("membership: every heartbeat asks for the worker list until a sync brings it") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
  CHECK(m.Join(JoinOf(1, 11)));
  CHECK(m.Join(JoinOf(1, 11)));  // the first answer was lost: asked again
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)})).ok());
  CHECK_FALSE(m.Join(JoinOf(1, 11)));  // acknowledged: plain heartbeats from now on

  // Declared dead; the heartbeat that revives it is answered, and that answer never arrives.
  clock.Advance(absl::Seconds(3));
  REQUIRE(m.CheckLiveness().size() == 1);
  CHECK(m.Join(JoinOf(1, 11)));
  CHECK(m.ControlAddress(1).ok());
  CHECK(m.Group("policy").inference == 0);
  for (int i = 0; i < 3; ++i) {
    clock.Advance(absl::Milliseconds(500));
    CHECK(m.Join(JoinOf(1, 11)));  // alive, but without its workers: every answer says resync
    CHECK(m.CheckLiveness().empty());
  }
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)})).ok());
  CHECK(m.Group("policy").inference == 1);
  CHECK_FALSE(m.Join(JoinOf(1, 11)));

  // An empty list is a list: a node with no workers is asked once it sent it, not forever.
  CHECK(m.Join(JoinOf(2, 22)));
  REQUIRE(m.ApplySync(SyncOf(2, 22, {})).ok());
  CHECK_FALSE(m.Join(JoinOf(2, 22)));
  // A restart (a new incarnation) asks again, whatever the old incarnation had sent.
  CHECK(m.Join(JoinOf(2, 23)));
  CHECK(m.Join(JoinOf(2, 23)));
}

TEST_CASE("membership: the coordinator itself is never judged by heartbeats") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  clock.Advance(absl::Hours(1));
  CHECK(m.CheckLiveness().empty());
  CHECK(m.ControlAddress(0).ok());
}

TEST_CASE("membership: a new incarnation is a restarted node; its old workers are gone") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  CHECK(m.Join(JoinOf(2, 100)));
  REQUIRE(m.ApplySync(SyncOf(2, 100,
                             {Registration("t0", v1::TRAINER, 0, 8, 2),
                              Registration("i0", v1::INFERENCE, 0, 8, 2)}))
              .ok());
  const GroupMembers before = m.Group("policy");
  CHECK(before.trainers == 1);
  CHECK(before.inference == 1);

  CHECK(m.Join(JoinOf(2, 200)));  // restarted: resync
  const GroupMembers restarted = m.Group("policy");
  CHECK(restarted.trainers == 0);
  CHECK(restarted.inference == 0);
  CHECK_FALSE(restarted.exists);  // its last workers are gone: the group is forgotten
  REQUIRE(m.ApplySync(SyncOf(2, 200, {Registration("t0", v1::TRAINER, 0, 8, 2)})).ok());
  CHECK_FALSE(m.Join(JoinOf(2, 200)));  // its heartbeats from now on
  CHECK(m.Group("policy").trainers == 1);
  // The same workers under a new incarnation are a new membership, at an epoch never used.
  CHECK(m.Group("policy").epoch > before.epoch);

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
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  REQUIRE(m.AddLocal(Registration("i0", v1::INFERENCE, 0, 8, 0)).ok());
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

TEST_CASE("membership: a worker re-registered before its old registration's removal keeps it") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  auto listed = [&] {
    v1::ListWorkersResponse out;
    m.ListWorkers(v1::ListWorkersRequest(), &out);
    std::vector<std::string> ids;
    for (const auto& w : out.workers()) ids.push_back(w.worker_id());
    return ids;
  };
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0), "first").ok());
  // Its session ended and it registered again at once; the old removal comes last.
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0), "second").ok());
  CHECK(listed() == std::vector<std::string>{"policy/t0"});  // replaced, not listed twice
  m.RemoveLocal("policy/t0", "first");
  CHECK(listed() == std::vector<std::string>{"policy/t0"});
  CHECK(m.Group("policy").trainers == 1);
  m.RemoveLocal("policy/t0", "second");
  CHECK(listed().empty());
  CHECK_FALSE(m.Group("policy").exists);
}

// An engine rank: rows [r0, r1) of "w", rank `rank` of replica `replica` of `size` ranks.
v1::RegisterWorkerRequest Rank(const std::string& name, const std::string& replica, int32_t rank,
                               int32_t size, int64_t r0, int64_t r1, int32_t node) {
  v1::RegisterWorkerRequest r = Registration(name, v1::INFERENCE, r0, r1, node);
  r.mutable_worker()->set_replica(replica);
  r.mutable_worker()->set_replica_rank(rank);
  r.mutable_worker()->set_replica_size(size);
  return r;
}

const ReplicaView* Find(const GroupMembers& g, const std::string& name) {
  for (const ReplicaView& r : g.replicas) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

TEST_CASE("membership: replicas count only when complete; the missing ranks are named") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  REQUIRE(m.AddLocal(Rank("vllm-dp0-tp0", "dp0", 0, 2, 0, 4, 0)).ok());
  REQUIRE(m.AddLocal(Rank("vllm-dp0-tp1", "dp0", 1, 2, 4, 8, 0)).ok());
  REQUIRE(m.AddLocal(Rank("vllm-dp1-tp1", "dp1", 1, 2, 4, 8, 0)).ok());
  REQUIRE(m.AddLocal(Registration("solo", v1::INFERENCE, 0, 8, 0))
              .ok());  // no declaration: a replica of its own
  GroupMembers g = m.Group("policy");
  REQUIRE(g.replicas.size() == 3);
  REQUIRE(Find(g, "dp0") != nullptr);
  CHECK(Find(g, "dp0")->complete);
  CHECK(Find(g, "dp0")->workers == std::vector<std::string>{"vllm-dp0-tp0", "vllm-dp0-tp1"});
  REQUIRE(Find(g, "solo") != nullptr);
  CHECK(Find(g, "solo")->complete);
  CHECK(Find(g, "solo")->size == 1);
  const ReplicaView* dp1 = Find(g, "dp1");
  REQUIRE(dp1 != nullptr);
  CHECK_FALSE(dp1->complete);
  CHECK(dp1->missing == std::vector<int32_t>{0});
  CHECK(dp1->problem ==
        "replica \"dp1\": 1 of 2 ranks registered; missing rank 0 (present: 1 \"vllm-dp1-tp1\")");
  // The trainer, dp0's ranks and solo count; dp1's rank does not.
  CHECK(g.counts == std::vector<bool>{true, true, true, false, true});

  // Its missing rank comes: complete.
  REQUIRE(m.AddLocal(Rank("vllm-dp1-tp0", "dp1", 0, 2, 0, 4, 0)).ok());
  CHECK(Find(m.Group("policy"), "dp1")->complete);

  // Ranks that disagree: two claims of one rank, or another size.
  REQUIRE(m.AddLocal(Rank("x0", "dp2", 0, 2, 0, 4, 0)).ok());
  REQUIRE(m.AddLocal(Rank("x1", "dp2", 0, 2, 4, 8, 0)).ok());
  REQUIRE(m.AddLocal(Rank("y0", "dp3", 0, 2, 0, 4, 0)).ok());
  REQUIRE(m.AddLocal(Rank("y1", "dp3", 1, 4, 4, 8, 0)).ok());
  g = m.Group("policy");
  CHECK(Find(g, "dp2")->problem ==
        "replica \"dp2\": 1 of 2 ranks registered; missing rank 1 (present: 0 \"x0\"); workers "
        "\"x0\" and \"x1\" both "
        "claim rank 0");
  CHECK(Find(g, "dp3")->problem ==
        "replica \"dp3\": workers \"y0\" and \"y1\" disagree on its size (2 and 4)");
  CHECK_FALSE(Find(g, "dp3")->complete);
}

// A trainer holding rows [r0, r1) that declares itself rank `rank` of `world_size`.
v1::RegisterWorkerRequest TrainerRank(const std::string& name, int32_t rank, int32_t world_size,
                                      int64_t r0, int64_t r1, int32_t node) {
  v1::RegisterWorkerRequest r = Registration(name, v1::TRAINER, r0, r1, node);
  r.set_trainer_rank(rank);
  r.set_trainer_world_size(world_size);
  return r;
}

TEST_CASE("membership: the trainer side's declared ranks; the last one missing is named") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  REQUIRE(m.AddLocal(Registration("i0", v1::INFERENCE, 0, 8, 0)).ok());
  // Ranks 0..2 of 4 hold rows 0..6 of 8 between them; rank 3 (rows 6..8) never registers.
  for (int32_t rank = 0; rank < 3; ++rank) {
    REQUIRE(
        m.AddLocal(TrainerRank("rank" + std::to_string(rank), rank, 4, 2 * rank, 2 * rank + 2, 0))
            .ok());
  }
  const int64_t epoch = m.Epoch("policy");
  TrainerRanksView t = m.Group("policy").trainer_ranks;
  CHECK(t.world_size == 4);
  CHECK(t.workers == std::vector<std::string>{"rank0", "rank1", "rank2", ""});
  CHECK(t.missing == std::vector<int32_t>{3});
  CHECK_FALSE(t.complete());
  CHECK(t.problem == "trainer rank 3 of 4 is not registered");
  // The cheap form Status reads says the same.
  CHECK(m.TrainerRanks("policy").problem == t.problem);
  CHECK(m.TrainerRanks("policy").missing == t.missing);

  // It comes: the side is whole, and the group's membership changed.
  REQUIRE(m.AddLocal(TrainerRank("rank3", 3, 4, 6, 8, 0)).ok());
  t = m.Group("policy").trainer_ranks;
  CHECK(t.complete());
  CHECK(t.missing.empty());
  CHECK(m.Epoch("policy") > epoch);

  // Two gone: both named, in order.
  m.RemoveLocal("policy/rank1");
  m.RemoveLocal("policy/rank3");
  CHECK(m.TrainerRanks("policy").problem == "trainer ranks 1, 3 of 4 are not registered");
}

TEST_CASE("membership: trainers that declare no rank are judged by coverage alone, as before") {
  std::vector<std::pair<int32_t, v1::RegisterWorkerRequest>> workers = {
      {0, Registration("t0", v1::TRAINER, 0, 4, 0)},
      {0, Registration("i0", v1::INFERENCE, 0, 8, 0)},
  };
  const TrainerRanksView t = TrainerRanksOf(workers);
  CHECK(t.world_size == 0);
  CHECK(t.complete());
  CHECK(t.missing.empty());
}

TEST_CASE("membership: trainers that disagree on their ranks or world size are named") {
  using Workers = std::vector<std::pair<int32_t, v1::RegisterWorkerRequest>>;
  // Another world size: rank 1 says 4, so ranks 2 and 3 of the first one's 2 cannot exist.
  TrainerRanksView t = TrainerRanksOf(
      Workers{{0, TrainerRank("a", 0, 2, 0, 4, 0)}, {1, TrainerRank("b", 1, 4, 4, 8, 1)}});
  CHECK(t.world_size == 2);
  CHECK(t.missing == std::vector<int32_t>{1});
  CHECK(t.problem ==
        "trainer rank 1 of 2 is not registered; trainers \"a\" and \"b\" disagree on the trainer "
        "world size (2 and 4)");

  // One rank claimed twice, a rank out of range, a trainer declaring nothing.
  t = TrainerRanksOf(Workers{{0, TrainerRank("a", 0, 2, 0, 4, 0)},
                             {0, TrainerRank("b", 0, 2, 4, 8, 0)},
                             {0, TrainerRank("c", 2, 2, 4, 8, 0)},
                             {0, Registration("d", v1::TRAINER, 4, 8, 0)}});
  CHECK(t.workers == std::vector<std::string>{"a", ""});
  CHECK(t.problem ==
        "trainer rank 1 of 2 is not registered; trainers \"a\" and \"b\" both claim trainer rank "
        "0; trainer \"c\" declares rank 2 of 2; trainer \"d\" declares no rank, while \"a\" "
        "declares world size 2 (declare a rank and world size on every trainer, or on none)");

  // A size no world has; many missing ranks are counted, a few named, the list bounded.
  CHECK(TrainerRanksOf(Workers{{0, TrainerRank("a", 0, -1, 0, 8, 0)}}).problem ==
        "trainer \"a\" declares world size -1, not between 1 and 1048576");
  t = TrainerRanksOf(Workers{{0, TrainerRank("a", 0, 4096, 0, 8, 0)}});
  CHECK(t.missing.size() == static_cast<size_t>(kMaxListedRanks));
  CHECK(t.missing.front() == 1);
  CHECK(t.problem ==
        "trainer ranks 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 and 4079 more of 4096 "
        "are not registered");
}

TEST_CASE("membership: a replica's version: recorded when committed whole, reset when it changes") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  CHECK(m.Join(JoinOf(1, 7)));
  REQUIRE(m.ApplySync(SyncOf(1, 7,
                             {Rank("vllm-dp0-tp0", "dp0", 0, 2, 0, 4, 1),
                              Rank("vllm-dp0-tp1", "dp0", 1, 2, 4, 8, 1),
                              Rank("vllm-dp1-tp0", "dp1", 0, 2, 0, 4, 1),
                              Rank("vllm-dp1-tp1", "dp1", 1, 2, 4, 8, 1)}))
              .ok());
  const int64_t epoch = m.Group("policy").epoch;
  m.RecordCommit("policy", epoch, {"dp0", "dp1"}, 5);
  CHECK(m.ReplicaVersions("policy") == std::map<std::string, int64_t>{{"dp0", 5}, {"dp1", 5}});
  // dp1 loses a rank (its node syncs without it): it no longer holds a version it can vouch for,
  // and a round planned before the change does not give it one.
  REQUIRE(m.ApplySync(SyncOf(1, 7,
                             {Rank("vllm-dp0-tp0", "dp0", 0, 2, 0, 4, 1),
                              Rank("vllm-dp0-tp1", "dp0", 1, 2, 4, 8, 1),
                              Rank("vllm-dp1-tp1", "dp1", 1, 2, 4, 8, 1)}))
              .ok());
  CHECK(m.ReplicaVersions("policy") == std::map<std::string, int64_t>{{"dp0", 5}, {"dp1", 0}});
  m.RecordCommit("policy", epoch, {"dp0", "dp1"}, 6);
  CHECK(m.ReplicaVersions("policy") == std::map<std::string, int64_t>{{"dp0", 6}, {"dp1", 0}});
  // It comes back whole: still 0 (it missed versions) until a round refits it.
  REQUIRE(m.ApplySync(SyncOf(1, 7,
                             {Rank("vllm-dp0-tp0", "dp0", 0, 2, 0, 4, 1),
                              Rank("vllm-dp0-tp1", "dp0", 1, 2, 4, 8, 1),
                              Rank("vllm-dp1-tp0", "dp1", 0, 2, 0, 4, 1),
                              Rank("vllm-dp1-tp1", "dp1", 1, 2, 4, 8, 1)}))
              .ok());
  const GroupMembers back = m.Group("policy");
  CHECK(Find(back, "dp1")->complete);
  CHECK(Find(back, "dp1")->version == 0);
  CHECK(Find(back, "dp0")->version == 6);
  m.RecordCommit("policy", back.epoch, {"dp0", "dp1"}, 7);
  CHECK(m.ReplicaVersions("policy") == std::map<std::string, int64_t>{{"dp0", 7}, {"dp1", 7}});
}

TEST_CASE(
    "membership: a worker name is held by one node; another node's registration of it is refused") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("10.0.0.0:7070", "b", 1);
  CHECK(m.Join(JoinOf(1, 11)));
  CHECK(m.Join(JoinOf(2, 22)));
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)})).ok());
  // Node 2 syncs a worker of the same name (and one of its own): i0 is refused, naming node 1.
  v1::SyncWorkersResponse answer;
  REQUIRE(m.ApplySync(SyncOf(2, 22,
                             {Registration("i0", v1::INFERENCE, 0, 8, 2),
                              Registration("i1", v1::INFERENCE, 0, 8, 2)}),
                      &answer)
              .ok());
  REQUIRE(answer.refused_size() == 1);
  CHECK(answer.refused(0).worker_id() == "policy/i0");
  CHECK(answer.refused(0).holder_node() == 1);
  CHECK(answer.refused(0).reason() ==
        "worker \"policy/i0\" is already registered on node 1 (10.0.0.1:7070); unregister it there "
        "first, or "
        "choose another name");
  v1::ListWorkersResponse listed;
  m.ListWorkers(v1::ListWorkersRequest(), &listed);
  std::map<std::string, int32_t> where;
  for (const auto& w : listed.workers()) where[w.worker_id()] = w.node();
  CHECK(where == std::map<std::string, int32_t>{{"policy/i0", 1}, {"policy/i1", 2}});
  // The coordinator's own registration of the name: ALREADY_EXISTS naming the holder.
  const absl::Status mine = m.AddLocal(Registration("i0", v1::INFERENCE, 0, 8, 0));
  CHECK(mine.code() == absl::StatusCode::kAlreadyExists);
  CHECK(std::string(mine.message()).find("node 1 (10.0.0.1:7070)") != std::string::npos);
  // A node re-syncing its own workers is not refused by itself.
  v1::SyncWorkersResponse again;
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)}), &again).ok());
  CHECK(again.refused_size() == 0);
  // The holder's node dies: the name is free.
  clock.Advance(absl::Seconds(3));
  CHECK_FALSE(m.Join(JoinOf(2, 22)));
  REQUIRE(m.CheckLiveness().size() == 1);  // node 1
  CHECK(m.AddLocal(Registration("i0", v1::INFERENCE, 0, 8, 0)).ok());
}

TEST_CASE(
    "membership: a group is forgotten when its last worker leaves; its epochs are never reused") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  std::vector<std::string> told;
  m.OnGroupForgotten([&](const std::string& g) {
    told.push_back(g);
    CHECK_FALSE(m.Group(g).exists);  // called with no lock held: it may call back in
  });
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0, "other")).ok());
  CHECK(m.Join(JoinOf(1, 5)));
  REQUIRE(m.ApplySync(SyncOf(1, 5, {Registration("i0", v1::INFERENCE, 0, 8, 1)})).ok());
  const int64_t epoch = m.Group("policy").epoch;
  m.RemoveLocal("policy/t0");
  CHECK(told.empty());  // i0 remains
  REQUIRE(m.ApplySync(SyncOf(1, 5, {})).ok());
  CHECK(told == std::vector<std::string>{"policy"});
  CHECK(m.GroupNames() == std::vector<std::string>{"other"});
  CHECK_FALSE(m.Group("policy").exists);
  // Registered again: a new group, at an epoch above every one it had.
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  CHECK(m.Group("policy").epoch > epoch);
  // A node declared dead takes its groups with it when it held their last workers.
  REQUIRE(m.ApplySync(SyncOf(1, 5, {Registration("i9", v1::INFERENCE, 0, 8, 1, "remote")})).ok());
  clock.Advance(absl::Seconds(3));
  REQUIRE(m.CheckLiveness().size() == 1);
  CHECK(told == std::vector<std::string>{"policy", "remote"});
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST_CASE("membership: a group's limits (--max-group-*) refuse the worker that would pass them") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("10.0.0.0:7070", "b", 1);
  GroupLimits limits;
  limits.max_workers = 3;
  m.SetLimits(limits);
  CHECK(m.Join(JoinOf(1, 11)));
  CHECK(m.Join(JoinOf(2, 22)));
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 4, 1)})).ok());
  // Node 2 brings two more: the third worker of the group fits, the fourth is refused.
  v1::SyncWorkersResponse answer;
  REQUIRE(m.ApplySync(SyncOf(2, 22,
                             {Registration("i1", v1::INFERENCE, 4, 8, 2),
                              Registration("i2", v1::INFERENCE, 4, 8, 2)}),
                      &answer)
              .ok());
  REQUIRE(answer.refused_size() == 1);
  CHECK(answer.refused(0).worker_id() == "policy/i2");
  CHECK(answer.refused(0).code() == static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
  CHECK(answer.refused(0).reason() ==
        "group \"policy\" would hold 4 workers with worker \"i2\", more than 3 "
        "(--max-group-workers)");
  CHECK(m.Group("policy").inference == 2);
  // A node re-syncing the same list is not counted twice against itself.
  v1::SyncWorkersResponse again;
  REQUIRE(m.ApplySync(SyncOf(2, 22, {Registration("i1", v1::INFERENCE, 4, 8, 2)}), &again).ok());
  CHECK(again.refused_size() == 0);
  // The coordinator's own: RESOURCE_EXHAUSTED, naming the flag; another group is not affected.
  const absl::Status mine = m.AddLocal(Registration("t1", v1::TRAINER, 0, 8, 0));
  CHECK(mine.code() == absl::StatusCode::kResourceExhausted);
  CHECK(std::string(mine.message()).find("--max-group-workers") != std::string::npos);
  v1::RegisterWorkerRequest other = Registration("t1", v1::TRAINER, 0, 8, 0);
  other.set_group("critic");
  CHECK(m.AddLocal(other).ok());

  // Pieces and encoded bytes, summed over the group's workers on every node.
  Membership p(0, absl::Milliseconds(500), 4, &clock);
  p.SetSelf("10.0.0.0:7070", "b", 1);
  GroupLimits pieces;
  pieces.max_pieces = 1;
  p.SetLimits(pieces);
  REQUIRE(p.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  const absl::Status more = p.AddLocal(Registration("t1", v1::TRAINER, 0, 8, 0));
  CHECK(more.code() == absl::StatusCode::kResourceExhausted);
  CHECK(std::string(more.message()).find("--max-group-pieces") != std::string::npos);
  for (auto [field, flag] : {std::pair<int64_t GroupLimits::*, const char*>{
                                 &GroupLimits::max_buffers, "--max-group-buffers"},
                             {&GroupLimits::max_tensors, "--max-group-tensors"}}) {
    Membership g(0, absl::Milliseconds(500), 4, &clock);
    g.SetSelf("10.0.0.0:7070", "b", 1);
    GroupLimits one;
    one.*field = 1;  // each registration holds one buffer and one tensor
    g.SetLimits(one);
    REQUIRE(g.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
    const absl::Status second = g.AddLocal(Registration("t1", v1::TRAINER, 0, 8, 0));
    CHECK(second.code() == absl::StatusCode::kResourceExhausted);
    CHECK(std::string(second.message()).find(flag) != std::string::npos);
  }
  Membership b(0, absl::Milliseconds(500), 4, &clock);
  b.SetSelf("10.0.0.0:7070", "b", 1);
  GroupLimits bytes;
  bytes.max_bytes = 10;
  b.SetLimits(bytes);
  const absl::Status big = b.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0));
  CHECK(big.code() == absl::StatusCode::kResourceExhausted);
  CHECK(std::string(big.message()).find("--max-group-bytes") != std::string::npos);
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

// A heartbeat from a node that has received `resyncs_seen` answers saying resync.
v1::JoinRequest Beat(int32_t node, int64_t incarnation, int64_t resyncs_seen) {
  v1::JoinRequest j = JoinOf(node, incarnation);
  j.set_resyncs_seen(resyncs_seen);
  return j;
}

// The node's `sequence`-th list, taken once it had received `resyncs_seen` resync answers.
v1::SyncWorkersRequest Numbered(v1::SyncWorkersRequest sync, int64_t sequence,
                                int64_t resyncs_seen) {
  sync.set_sequence(sequence);
  sync.set_resyncs_seen(resyncs_seen);
  return sync;
}

std::vector<int32_t> Listed(const Membership& m) {
  v1::StatusResponse status;
  m.NodeStatuses(&status);
  std::vector<int32_t> out;
  for (const v1::NodeStatus& n : status.nodes()) out.push_back(n.node());
  return out;
}

TEST_CASE("membership: a node's worker lists apply in the order it sent them, not as they arrive") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
  REQUIRE(m.Join(Beat(1, 11, 0)));  // its first resync answer
  const v1::SyncWorkersRequest first =
      Numbered(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)}), 1, 1);
  const v1::SyncWorkersRequest second =
      Numbered(SyncOf(1, 11,
                      {Registration("i0", v1::INFERENCE, 0, 8, 1),
                       Registration("i1", v1::INFERENCE, 0, 8, 1, "other")}),
               2, 1);
  REQUIRE(m.ApplySync(second).ok());
  // The first list, late (its sender timed out and sent the second): ignored, counted.
  CHECK(m.ApplySync(first).ok());
  CHECK(m.Group("other").inference == 1);
  CHECK(m.Counts().stale_syncs == 1);
  CHECK(m.ApplySync(second).ok());  // the same list twice changes nothing either
  CHECK(m.Counts().stale_syncs == 2);
  CHECK_FALSE(m.Join(Beat(1, 11, 1)));  // the coordinator holds the node's list: no resync
  REQUIRE(m.ApplySync(Numbered(SyncOf(1, 11, {}), 3, 1)).ok());
  CHECK_FALSE(m.Group("other").exists);
  CHECK(m.Group("policy").inference == 0);

  // A restarted node numbers its lists from 1 again.
  REQUIRE(m.Join(Beat(1, 12, 0)));
  REQUIRE(m.ApplySync(Numbered(SyncOf(1, 12, {Registration("i0", v1::INFERENCE, 0, 8, 1)}), 1, 1))
              .ok());
  CHECK(m.Group("policy").inference == 1);
  CHECK(m.Counts().stale_syncs == 2);
}

TEST_CASE("membership: a list taken before the node heard of its readmission is refused") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);  // dead after 2 s of silence
  m.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
  REQUIRE(m.Join(Beat(1, 11, 0)));
  REQUIRE(m.ApplySync(Numbered(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)}), 1, 1))
              .ok());
  clock.Advance(absl::Seconds(3));
  REQUIRE(m.CheckLiveness().size() == 1);
  // Its next heartbeat admits it again; the answer (resync) is lost. A list it took before
  // hearing of it (a registration's, or one sent before the verdict that arrives now) is refused:
  // applied, it would end the resyncs, and the node would never learn it had been declared dead.
  REQUIRE(m.Join(Beat(1, 11, 1)));
  const absl::Status early =
      m.ApplySync(Numbered(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)}), 2, 1));
  CHECK(early.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(early.message()), Catch::Contains("declared dead: no heartbeat for 2s"));
  CHECK(m.Counts().stale_syncs == 1);
  CHECK(m.Group("policy").inference == 0);
  CHECK(m.Join(Beat(1, 11, 1)));  // so every answer still asks for the list
  // Once it heard (a second resync answer), its list is applied.
  REQUIRE(m.ApplySync(Numbered(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)}), 3, 2))
              .ok());
  CHECK(m.Group("policy").inference == 1);
  CHECK_FALSE(m.Join(Beat(1, 11, 2)));
  // Lists that are not numbered (daemons from before the check) apply as they arrive.
  REQUIRE(m.ApplySync(SyncOf(1, 11, {})).ok());
  CHECK(m.Group("policy").inference == 0);
  CHECK(m.Counts().stale_syncs == 1);
}

// A change to the node's list of sync `base`.
v1::SyncWorkersRequest Change(int32_t node, int64_t incarnation, int64_t sequence, int64_t base,
                              int64_t resyncs_seen, std::vector<v1::RegisterWorkerRequest> added,
                              std::vector<std::string> removed = {}) {
  v1::SyncWorkersRequest sync = Numbered(SyncOf(node, incarnation, {}), sequence, resyncs_seen);
  for (v1::RegisterWorkerRequest& w : added) *sync.add_workers() = std::move(w);
  sync.set_delta(true);
  sync.set_base_sequence(base);
  for (std::string& id : removed) sync.add_removed(std::move(id));
  return sync;
}

TEST_CASE("membership: a change applies onto the list it names, and only onto that one") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  REQUIRE(m.Join(Beat(1, 11, 0)));
  // Before any whole list of this incarnation: refused, the node sends its whole list.
  absl::Status s =
      m.ApplySync(Change(1, 11, 1, 1, 1, {Registration("i0", v1::INFERENCE, 0, 8, 1)}));
  CHECK(s.code() == absl::StatusCode::kAborted);
  CHECK_THAT(std::string(s.message()), Catch::Contains("no list of this incarnation"));
  REQUIRE(m.ApplySync(Numbered(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 4, 1)}), 2, 1))
              .ok());
  const int64_t epoch = m.Group("policy").epoch;
  // Added, onto list 2.
  REQUIRE(m.ApplySync(Change(1, 11, 3, 2, 1, {Registration("i1", v1::INFERENCE, 4, 8, 1)})).ok());
  CHECK(m.Group("policy").inference == 2);
  CHECK(m.Group("policy").epoch > epoch);
  // Onto list 2 again (the coordinator holds 3): refused, nothing changes, counted.
  s = m.ApplySync(Change(1, 11, 4, 2, 1, {}, {"policy/i0"}));
  CHECK(s.code() == absl::StatusCode::kAborted);
  CHECK_THAT(std::string(s.message()), Catch::Contains("holds that of sync 3"));
  CHECK(m.Group("policy").inference == 2);
  CHECK(m.Counts().rebased_syncs == 2);
  // Removed, and the same name registered again (replacing the one held), onto list 3.
  REQUIRE(m.ApplySync(
               Change(1, 11, 5, 3, 1, {Registration("i1", v1::INFERENCE, 0, 8, 1)}, {"policy/i0"}))
              .ok());
  GroupMembers g = m.Group("policy");
  REQUIRE(g.inference == 1);
  CHECK(g.workers.size() == 2);  // t0 and the new i1
  // A name another node holds: refused, listed, and the node's old entry of it is gone too.
  REQUIRE(m.Join(Beat(2, 21, 0)));
  REQUIRE(
      m.ApplySync(Numbered(SyncOf(2, 21, {Registration("i1", v1::INFERENCE, 0, 8, 2, "b")}), 1, 1))
          .ok());
  REQUIRE(m.ApplySync(Change(1, 11, 6, 5, 1, {Registration("i1", v1::INFERENCE, 0, 8, 1, "b")}))
              .ok());  // group b's i1 is node 2's
  v1::SyncWorkersResponse refused;
  REQUIRE(m.ApplySync(Change(1, 11, 7, 6, 1, {}, {"b/i1"}), &refused).ok());
  CHECK(refused.refused_size() == 0);
  CHECK(m.Group("b").inference == 1);  // node 2's, untouched by node 1's removal of its own
  // Received: each registration once.
  CHECK(m.Counts().synced_bytes > 0);
}

// The coordinator (node 0, trainer t0) joined by node 1 (incarnation 11), whose first list
// (sync 1) holds engines i0 and i1.
void JoinNodeOneWithTwoEngines(Membership& m) {
  m.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  REQUIRE(m.Join(Beat(1, 11, 0)));
  REQUIRE(m.ApplySync(Numbered(SyncOf(1, 11,
                                      {Registration("i0", v1::INFERENCE, 0, 4, 1),
                                       Registration("i1", v1::INFERENCE, 4, 8, 1)}),
                               1, 1))
              .ok());
}

TEST_CASE(
    "membership: a node revived at the same incarnation names the list kept while it was dead") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);  // dead after 2 s of silence
  JoinNodeOneWithTwoEngines(m);
  clock.Advance(absl::Seconds(3));
  REQUIRE(m.CheckLiveness().size() == 1);
  CHECK(m.Group("policy").inference == 0);  // out of the group while dead
  // Meanwhile node 2 takes i1's name.
  REQUIRE(m.Join(Beat(2, 21, 0)));
  REQUIRE(m.ApplySync(Numbered(SyncOf(2, 21, {Registration("i1", v1::INFERENCE, 4, 8, 2)}), 1, 1))
              .ok());
  // Back: asked to resync; a change onto list 1 brings the kept list back, checked as a whole
  // list is: i1's name is node 2's now.
  REQUIRE(m.Join(Beat(1, 11, 1)));
  const int64_t received = m.Counts().synced_bytes;
  v1::SyncWorkersResponse out;
  REQUIRE(m.ApplySync(Change(1, 11, 2, 1, 2, {}), &out).ok());
  CHECK(m.Counts().synced_bytes == received);  // nothing sent again
  REQUIRE(out.refused_size() == 1);
  CHECK(out.refused(0).worker_id() == "policy/i1");
  CHECK(out.refused(0).holder_node() == 2);
  CHECK(m.Group("policy").inference == 2);  // node 1's i0, node 2's i1
  CHECK_FALSE(m.Join(Beat(1, 11, 2)));      // resynced
  // Kept only once: dead again, then a change onto an older list is refused.
  clock.Advance(absl::Seconds(3));
  CHECK_FALSE(m.Join(Beat(2, 21, 1)));  // node 2 stays alive
  REQUIRE(m.CheckLiveness().size() == 1);
  REQUIRE(m.Join(Beat(1, 11, 2)));
  CHECK(m.ApplySync(Change(1, 11, 3, 1, 3, {})).code() == absl::StatusCode::kAborted);
  // Restarted (a new incarnation): nothing kept.
  clock.Advance(absl::Seconds(3));
  CHECK_FALSE(m.Join(Beat(2, 21, 1)));  // node 2 stays alive
  REQUIRE(m.CheckLiveness().size() == 1);
  REQUIRE(m.Join(Beat(1, 12, 0)));
  const absl::Status restarted = m.ApplySync(Change(1, 12, 1, 2, 1, {}));
  CHECK(restarted.code() == absl::StatusCode::kAborted);
  CHECK_THAT(std::string(restarted.message()), Catch::Contains("no list of this incarnation"));
}

// A node whose heartbeats arrive but whose answers do not (a one-way partition) is declared dead,
// admitted again by its next heartbeat, and declared dead again before its list (or any answer)
// reaches it, over and over. When it hears at last, it names the list of its last sync.
TEST_CASE(
    "membership: a node declared dead again before any list reached it keeps the list kept at its "
    "first verdict") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);  // dead after 2 s of silence
  JoinNodeOneWithTwoEngines(m);
  for (int verdict = 0; verdict < 3; ++verdict) {
    clock.Advance(absl::Seconds(3));
    REQUIRE(m.CheckLiveness().size() == 1);
    CHECK(m.Group("policy").inference == 0);
    REQUIRE(m.Join(Beat(1, 11, 0)));  // admitted again; its answer (resync) is held
    CHECK(m.Group("policy").inference == 0);
  }
  // The held answers arrive: the node names its last list, and has its workers back.
  REQUIRE(m.Join(Beat(1, 11, 1)));
  const int64_t received = m.Counts().synced_bytes;
  v1::SyncWorkersResponse out;
  REQUIRE(m.ApplySync(Change(1, 11, 2, 1, 1, {}), &out).ok());
  CHECK(out.refused_size() == 0);
  CHECK(m.Counts().synced_bytes == received);
  CHECK(m.Group("policy").inference == 2);
  CHECK_FALSE(m.Join(Beat(1, 11, 1)));  // resynced
  // Dead once more after that list was applied: the list kept now is that one (sync 2).
  clock.Advance(absl::Seconds(3));
  REQUIRE(m.CheckLiveness().size() == 1);
  REQUIRE(m.Join(Beat(1, 11, 1)));
  CHECK(m.ApplySync(Change(1, 11, 3, 1, 2, {})).code() == absl::StatusCode::kAborted);
  REQUIRE(m.ApplySync(Change(1, 11, 4, 2, 2, {})).ok());
  CHECK(m.Group("policy").inference == 2);
}

TEST_CASE("membership: a node dead for --forget-dead-after is forgotten once, and may join again") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);  // dead after 2 s of silence
  m.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
  m.SetNodeLimits({.max_nodes = 4096, .forget_dead_after = absl::Seconds(10)});
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  REQUIRE(m.Join(JoinOf(1, 11)));
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)})).ok());
  clock.Advance(absl::Seconds(3));
  REQUIRE(m.CheckLiveness().size() == 1);
  // A round planned now, after the verdict (the node's workers are gone from the group).
  const GroupMembers planned = m.Group("policy");
  CHECK(planned.nodes == std::vector<int32_t>{0});
  CHECK(Listed(m) == std::vector<int32_t>{0, 1});  // listed dead for a while

  clock.Advance(absl::Seconds(10) - absl::Milliseconds(1));
  CHECK(m.CheckLiveness().empty());
  CHECK(Listed(m) == std::vector<int32_t>{0, 1});
  clock.Advance(absl::Milliseconds(1));
  CHECK(m.CheckLiveness().empty());  // forgetting is not a death verdict
  CHECK(Listed(m) == std::vector<int32_t>{0});
  CHECK(m.Counts().forgotten_nodes == 1);
  m.CheckLiveness();
  CHECK(m.Counts().forgotten_nodes == 1);  // once
  // The round in flight sees nothing change: same epoch, same members; a call to the node that
  // fails is still blamed on its death.
  CHECK(m.Epoch("policy") == planned.epoch);
  CHECK(m.Group("policy").nodes == planned.nodes);
  CHECK(m.ControlAddress(1).status().code() == absl::StatusCode::kUnavailable);
  REQUIRE(m.DeathReason(1).has_value());
  CHECK_THAT(*m.DeathReason(1), Catch::Contains("not a member of the cluster"));

  // It comes back: a new node to the coordinator, asked for its list, its workers in the group.
  CHECK(m.Join(JoinOf(1, 11)));
  CHECK(m.DeathReason(1) == std::nullopt);
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("i0", v1::INFERENCE, 0, 8, 1)})).ok());
  CHECK(m.Group("policy").nodes == std::vector<int32_t>{0, 1});
  CHECK(m.Group("policy").epoch > planned.epoch);
  CHECK_FALSE(m.Join(JoinOf(1, 11)));
}

TEST_CASE(
    "membership: --max-nodes caps the nodes listed; a dead node makes room, a flood is refused") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);  // dead after 2 s of silence
  m.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
  m.SetNodeLimits({.max_nodes = 3, .forget_dead_after = absl::Hours(1)});
  REQUIRE(m.Admit(JoinOf(1, 11)).ok());
  REQUIRE(m.Admit(JoinOf(2, 22)).ok());
  const absl::StatusOr<bool> third = m.Admit(JoinOf(3, 33));
  CHECK(third.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(third.status().message() ==
        "node 3 cannot join: the coordinator lists 3 nodes, every one alive, and --max-nodes is 3");
  // Through Join (a caller that cannot answer an error) the node is told to resync, and its sync
  // is refused naming the cap.
  CHECK(m.Join(JoinOf(3, 33)));
  const absl::Status sync = m.ApplySync(SyncOf(3, 33, {}));
  CHECK(sync.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(sync.message()), Catch::Contains("--max-nodes 3"));
  CHECK(m.Counts().refused_joins == 2);
  // The nodes listed keep their heartbeats.
  CHECK(m.Admit(JoinOf(1, 11)).ok());
  CHECK(m.Admit(JoinOf(2, 22)).ok());

  // 20,000 forged joins, all refused: the table stays as it was.
  for (int32_t node = 100; node < 20100; ++node) {
    CHECK_FALSE(m.Admit(JoinOf(node, 1)).ok());
  }
  CHECK(m.Counts().refused_joins == 20002);
  CHECK(Listed(m) == std::vector<int32_t>{0, 1, 2});

  // Node 2 goes silent and is declared dead: the next new node takes its place.
  clock.Advance(absl::Seconds(1));
  REQUIRE(m.Admit(JoinOf(1, 11)).ok());
  clock.Advance(absl::Milliseconds(1500));
  REQUIRE(m.CheckLiveness().size() == 1);
  CHECK(Listed(m) == std::vector<int32_t>{0, 1, 2});
  REQUIRE(m.Admit(JoinOf(3, 33)).ok());
  CHECK(Listed(m) == std::vector<int32_t>{0, 1, 3});
  CHECK(m.Counts().forgotten_nodes == 1);
  // Node 2 comes back to a full table of live nodes: refused until one dies.
  CHECK(m.Admit(JoinOf(2, 22)).status().code() == absl::StatusCode::kResourceExhausted);
}

bool Contains(absl::string_view text, absl::string_view part) {
  return text.find(part) != absl::string_view::npos;
}

// A trainer on node 0 declares "w" [8, 4] fp32; one on node 1 that believes it [8, 8] would make
// every plan of the group fail for as long as it lived: it is refused at its node's sync, naming
// the tensor, both declarations and the worker holding the group's, and the rest stays ready.
TEST_CASE("membership: a tensor declared otherwise on another node is refused, naming both") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("10.0.0.0:7070", "b", 1);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 4, 0)).ok());
  CHECK(m.Join(JoinOf(1, 11)));
  v1::SyncWorkersResponse answer;
  REQUIRE(m.ApplySync(SyncOf(1, 11,
                             {WholeTensor("wide", v1::TRAINER, "w", Dims{8, 8}, DType::kF32, 1),
                              Registration("t1", v1::TRAINER, 4, 8, 1),
                              // The other side may declare it otherwise (cast on the way).
                              WholeTensor("i0", v1::INFERENCE, "w", Dims{8, 4}, DType::kBF16, 1)}),
                      &answer)
              .ok());
  REQUIRE(answer.refused_size() == 1);
  const v1::WorkerRefusal& r = answer.refused(0);
  CHECK(r.worker_id() == "policy/wide");
  CHECK(r.code() == static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
  CHECK(r.holder_node() == 0);
  CHECK(
      Contains(r.reason(), "worker \"policy/wide\" (node 1) declares tensor \"w\" as [8, 8] fp32"));
  CHECK(Contains(r.reason(),
                 "trainer \"policy/t0\" on node 0 (10.0.0.0:7070), registered earlier, "
                 "declares it as [8, 4] fp32"));
  const GroupMembers g = m.Group("policy");
  CHECK(g.trainers == 2);
  CHECK(g.inference == 1);
  for (const auto& [node, w] : g.workers) CHECK(w.worker().name() != "wide");

  // The coordinator's own worker, against a node's: FAILED_PRECONDITION naming that one.
  const absl::Status mine =
      m.AddLocal(WholeTensor("i9", v1::INFERENCE, "w", Dims{8, 4}, DType::kF32, 0));
  CHECK(mine.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(Contains(mine.message(), "declares tensor \"w\" as [8, 4] fp32"));
  CHECK(Contains(mine.message(), "inference worker \"policy/i0\" on node 1"));
  CHECK(Contains(mine.message(), "declares it as [8, 4] bf16"));
  // Another group's "w" is its own.
  CHECK(m.AddLocal(WholeTensor("t0", v1::TRAINER, "w", Dims{8, 8}, DType::kF32, 0, "critic")).ok());
  // Two declarers: the refusal says so.
  CHECK(m.Join(JoinOf(2, 22)));
  v1::SyncWorkersResponse both;
  REQUIRE(m.ApplySync(SyncOf(2, 22, {WholeTensor("t2", v1::TRAINER, "w", Dims{4}, DType::kF32, 2)}),
                      &both)
              .ok());
  REQUIRE(both.refused_size() == 1);
  CHECK(Contains(both.refused(0).reason(), "declares it as [8, 4] fp32 (as do 1 more)"));
  CHECK(Contains(both.refused(0).reason(), "unregister the 2 trainers declaring it first"));
}

TEST_CASE("membership: a declaration follows its remaining declarers; the last takes it along") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("10.0.0.0:7070", "b", 1);
  const auto wide = [](int32_t node) {
    return WholeTensor("wide", v1::TRAINER, "w", Dims{8, 8}, DType::kF32, node);
  };
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 4, 0)).ok());
  CHECK(m.Join(JoinOf(1, 11)));
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("t1", v1::TRAINER, 4, 8, 1)})).ok());
  CHECK(m.IndexedDeclarations() == 1);

  // The first declarer leaves: node 1's still declares "w" [8, 4], and is named.
  m.RemoveLocal("policy/t0");
  CHECK(m.IndexedDeclarations() == 1);
  CHECK(m.Join(JoinOf(2, 22)));
  v1::SyncWorkersResponse answer;
  REQUIRE(m.ApplySync(SyncOf(2, 22, {wide(2)}), &answer).ok());
  REQUIRE(answer.refused_size() == 1);
  CHECK(answer.refused(0).holder_node() == 1);
  CHECK(Contains(answer.refused(0).reason(), "trainer \"policy/t1\" on node 1"));

  // The last declarer leaves (its node's list is empty now): any declaration may come.
  REQUIRE(m.ApplySync(SyncOf(1, 11, {})).ok());
  CHECK(m.IndexedDeclarations() == 0);
  v1::SyncWorkersResponse now;
  REQUIRE(m.ApplySync(SyncOf(2, 22, {wide(2)}), &now).ok());
  CHECK(now.refused_size() == 0);
  CHECK(m.Group("policy").trainers == 1);

  // A node declared dead takes its declarations along; back, its old worker is refused against
  // the one that declared "w" since.
  clock.Advance(absl::Seconds(3));
  CHECK_FALSE(m.Join(JoinOf(1, 11)));  // node 1 keeps beating; node 2 goes silent
  REQUIRE(m.CheckLiveness().size() == 1);
  CHECK(m.IndexedDeclarations() == 0);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 4, 0)).ok());
  CHECK(m.Join(JoinOf(2, 22)));
  v1::SyncWorkersResponse back;
  REQUIRE(m.ApplySync(SyncOf(2, 22, {wide(2)}), &back).ok());
  REQUIRE(back.refused_size() == 1);
  CHECK(Contains(back.refused(0).reason(), "trainer \"policy/t0\" on node 0"));
  // A node re-sending the list it holds is not refused against itself.
  v1::SyncWorkersResponse same;
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("t1", v1::TRAINER, 4, 8, 1)}), &same).ok());
  REQUIRE(m.ApplySync(SyncOf(1, 11, {Registration("t1", v1::TRAINER, 4, 8, 1)}), &same).ok());
  CHECK(same.refused_size() == 0);
  CHECK(m.Group("policy").trainers == 2);
}

TEST_CASE("membership: the declaration index does not grow over many joins and leaves") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("10.0.0.0:7070", "b", 1);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  for (int i = 0; i < 1000; ++i) {
    const int32_t node = 1 + i % 5;
    const int64_t incarnation = 100 + i;  // a restart: its old workers leave
    const std::string group = "g" + std::to_string(i % 7);
    const std::string tensor = "t" + std::to_string(i);  // a name never declared before
    CHECK(m.Join(JoinOf(node, incarnation)));
    REQUIRE(
        m.ApplySync(
             SyncOf(node, incarnation,
                    {WholeTensor("a", v1::TRAINER, tensor, Dims{4}, DType::kF32, node, group),
                     WholeTensor("b", v1::INFERENCE, tensor, Dims{4}, DType::kF32, node, group)}))
            .ok());
    // Each of the five nodes holds its last two declarations, plus node 0's one.
    REQUIRE(m.IndexedDeclarations() <= 1 + 5 * 2);
    if (i % 3 == 0) m.MarkDead(node, "test");
  }
  for (int32_t node = 1; node <= 5; ++node) m.MarkDead(node, "test");
  CHECK(m.IndexedDeclarations() == 1);
  m.RemoveLocal("policy/t0");
  CHECK(m.IndexedDeclarations() == 0);
}

}  // namespace
}  // namespace refit
