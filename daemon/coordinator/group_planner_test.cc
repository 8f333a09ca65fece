// GroupPlanner: one planning per membership epoch, cached and shared by concurrent callers, the
// not-ready reasons, and planning with no lock held (the membership keeps answering meanwhile).
#include "daemon/coordinator/group_planner.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <thread>

#include "daemon/base/round_protocol.h"
#include "daemon/testing/test_registrations.h"
#include "plan/planner.h"
#include "plan/validate.h"

namespace refit {
namespace {
using testing::JoinOf;
using testing::Registration;
using testing::SyncOf;

TEST_CASE("group planner: one plan per epoch, cached; a new membership plans again") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  GroupPlanner planner(GroupPlannerOptions{}, &m);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());

  auto first = planner.Get("policy");
  CHECK(first->status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(first->status.message())
            .find("is not ready: 1 trainers and 0 inference workers") != std::string::npos);
  CHECK(planner.Get("policy") == first);
  CHECK(planner.plannings() == 1);

  REQUIRE(m.AddLocal(Registration("i0", v1::INFERENCE, 0, 4, 0)).ok());
  REQUIRE(m.AddLocal(Registration("i1", v1::INFERENCE, 4, 8, 0)).ok());
  auto ready = planner.Get("policy");
  REQUIRE(ready->status.ok());
  CHECK(ready->plan != nullptr);
  CHECK(ready->inference == 2);
  CHECK(ready->epoch == m.Group("policy").epoch);
  const int64_t after = planner.plannings();
  for (int i = 0; i < 10; ++i) CHECK(planner.Get("policy") == ready);
  CHECK(planner.plannings() == after);

  // A heartbeat changes nothing; a node joining with workers of the group does.
  m.Join(JoinOf(1, 5));
  CHECK(planner.Get("policy") == ready);
  REQUIRE(m.ApplySync(SyncOf(1, 5, {Registration("i2", v1::INFERENCE, 0, 8, 1)})).ok());
  auto replanned = planner.Get("policy");
  CHECK(replanned != ready);
  CHECK(replanned->nodes == std::vector<int32_t>{0, 1});
  CHECK(planner.plannings() == after + 1);
}

TEST_CASE(
    "group planner: a membership that comes back to a layout pair seen before reuses its plan") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  GroupPlannerOptions options;
  std::atomic<int> made{0};
  options.make_plan = [&made](const Layout& src, const Layout& dst, const PlanOptions& o) {
    ++made;
    return MakePlan(src, dst, o);
  };
  GroupPlanner planner(options, &m);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  REQUIRE(m.AddLocal(Registration("i0", v1::INFERENCE, 0, 8, 0)).ok());
  auto first = planner.Get("policy");
  REQUIRE(first->status.ok());
  CHECK(first->digest.size() == 32);
  CHECK_FALSE(first->reused);
  CHECK(made == 1);
  // A second engine joins (a new layout pair: planned), then leaves (the first pair: reused),
  // then comes back (reused too).
  REQUIRE(m.AddLocal(Registration("i1", v1::INFERENCE, 0, 8, 0)).ok());
  auto two = planner.Get("policy");
  REQUIRE(two->status.ok());
  CHECK(two->digest != first->digest);
  CHECK(made == 2);
  m.RemoveLocal("policy/i1");
  auto back = planner.Get("policy");
  REQUIRE(back->status.ok());
  CHECK(back->epoch > two->epoch);
  CHECK(back->digest == first->digest);
  CHECK(back->reused);
  CHECK(back->plan == first->plan);
  REQUIRE(m.AddLocal(Registration("i1", v1::INFERENCE, 0, 8, 0)).ok());
  auto again = planner.Get("policy");
  CHECK(again->plan == two->plan);
  CHECK(made == 2);
  CHECK(planner.reused() == 2);
}

TEST_CASE("group planner: a worker that disagrees on a tensor is refused, the rest is planned") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  GroupPlanner planner(GroupPlannerOptions{}, &m);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  v1::RegisterWorkerRequest odd = Registration("t1", v1::TRAINER, 0, 8, 0);
  odd.mutable_tensors(0)->set_dtype("bf16");
  const absl::Status refused = m.AddLocal(odd);
  CHECK(refused.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(refused.message()).find("\"policy/t0\"") != std::string::npos);
  REQUIRE(m.AddLocal(Registration("i0", v1::INFERENCE, 0, 8, 0)).ok());
  auto plan = planner.Get("policy");
  CHECK(plan->status.ok());
  CHECK(plan->trainers == 1);
}

TEST_CASE(
    "group planner: plans outside any lock; concurrent callers of one epoch share one planning") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  std::atomic<bool> entered{false}, release{false};
  std::atomic<int> calls{0};
  GroupPlannerOptions options;
  options.make_plan = [&](const Layout& src, const Layout& dst, const PlanOptions& o) {
    ++calls;
    entered = true;
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return MakePlan(src, dst, o);
  };
  GroupPlanner planner(options, &m);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  REQUIRE(m.AddLocal(Registration("i0", v1::INFERENCE, 0, 8, 0)).ok());
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0, "other"))
              .ok());  // another group: not ready

  std::shared_ptr<const GroupPlan> a, b;
  std::thread first([&] { a = planner.Get("policy"); });
  while (!entered) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::thread second([&] { b = planner.Get("policy"); });
  // While "policy" plans: the membership takes heartbeats and syncs, and another group's plan
  // (not ready, so no planner call) is answered at once.
  CHECK(m.Join(JoinOf(3, 9)));
  REQUIRE(m.ApplySync(SyncOf(3, 9, {})).ok());
  CHECK_FALSE(m.Join(JoinOf(3, 9)));
  CHECK_FALSE(planner.Get("other")->status.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(calls == 1);
  release = true;
  first.join();
  second.join();
  REQUIRE(a != nullptr);
  CHECK(a == b);
  CHECK(a->status.ok());
  CHECK(calls == 1);
}

v1::RegisterWorkerRequest Rank(const std::string& name, const std::string& replica, int32_t rank,
                               int32_t size, int64_t r0, int64_t r1, int32_t node) {
  v1::RegisterWorkerRequest r = Registration(name, v1::INFERENCE, r0, r1, node);
  r.mutable_worker()->set_replica(replica);
  r.mutable_worker()->set_replica_rank(rank);
  r.mutable_worker()->set_replica_size(size);
  return r;
}

std::vector<std::string> Workers(const v1::Layout& l) {
  std::vector<std::string> out;
  for (const auto& w : l.workers()) out.push_back(w.name());
  return out;
}

TEST_CASE("group planner: only complete replicas are planned, never part of one") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  GroupPlanner planner(GroupPlannerOptions{}, &m);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  CHECK(m.Join(JoinOf(1, 5)));
  CHECK(m.Join(JoinOf(2, 6)));
  // TP2 x DP2: dp0 on node 1, dp1 on node 2 without its rank 0 (killed, say).
  REQUIRE(m.ApplySync(SyncOf(1, 5,
                             {Rank("vllm-dp0-tp0", "dp0", 0, 2, 0, 4, 1),
                              Rank("vllm-dp0-tp1", "dp0", 1, 2, 4, 8, 1)}))
              .ok());
  REQUIRE(m.ApplySync(SyncOf(2, 6, {Rank("vllm-dp1-tp1", "dp1", 1, 2, 4, 8, 2)})).ok());
  auto plan = planner.Get("policy");
  REQUIRE(plan->status.ok());
  CHECK(Workers(plan->dst) == std::vector<std::string>{"vllm-dp0-tp0", "vllm-dp0-tp1"});
  CHECK(plan->planned == std::vector<std::string>{"dp0"});
  CHECK(plan->incomplete == std::vector<std::string>{"dp1"});
  CHECK(plan->nodes == std::vector<int32_t>{0, 1});  // node 2 takes no part in a round
  CHECK(plan->inference == 3);                       // registered
  // The replica's rank comes back: both planned.
  REQUIRE(m.ApplySync(SyncOf(2, 6,
                             {Rank("vllm-dp1-tp1", "dp1", 1, 2, 4, 8, 2),
                              Rank("vllm-dp1-tp0", "dp1", 0, 2, 0, 4, 2)}))
              .ok());
  plan = planner.Get("policy");
  REQUIRE(plan->status.ok());
  CHECK(plan->planned == std::vector<std::string>{"dp0", "dp1"});
  CHECK(plan->nodes == std::vector<int32_t>{0, 1, 2});
  CHECK(Workers(plan->dst).size() == 4);

  // No replica complete: not ready, naming the missing ranks.
  REQUIRE(m.ApplySync(SyncOf(1, 5, {Rank("vllm-dp0-tp1", "dp0", 1, 2, 4, 8, 1)})).ok());
  REQUIRE(m.ApplySync(SyncOf(2, 6, {})).ok());
  plan = planner.Get("policy");
  CHECK(plan->status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(plan->status.message()) ==
        "group \"policy\" is not ready: no complete inference replica (a replica counts only with "
        "every rank "
        "registered): replica \"dp0\": 1 of 2 ranks registered; missing rank 0 (present: 1 "
        "\"vllm-dp0-tp1\")");
}

TEST_CASE("group planner: a declared trainer rank missing: not ready, the rank named") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  GroupPlanner planner(GroupPlannerOptions{}, &m);
  // Rank 0 of 2 holds the whole tensor: it covers the engine, yet rank 1 is missing.
  auto trainer = [](const std::string& name, int32_t rank) {
    v1::RegisterWorkerRequest r = Registration(name, v1::TRAINER, 0, 8, 0);
    r.set_trainer_rank(rank);
    r.set_trainer_world_size(2);
    return r;
  };
  REQUIRE(m.AddLocal(trainer("t0", 0)).ok());
  REQUIRE(m.AddLocal(Registration("e0", v1::INFERENCE, 0, 8, 0)).ok());
  auto plan = planner.Get("policy");
  CHECK(plan->status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(plan->status.message()) ==
        "group \"policy\" is not ready: trainer rank 1 of 2 is not registered");
  CHECK(plan->trainer_ranks.missing == std::vector<int32_t>{1});
  // It comes: ready.
  REQUIRE(m.AddLocal(trainer("t1", 1)).ok());
  CHECK(planner.Get("policy")->status.ok());
}

TEST_CASE("group planner: a complete replica must still be covered by the trainers") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  GroupPlanner planner(GroupPlannerOptions{}, &m);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 4, 0)).ok());  // rows [4, 8) held by nobody
  REQUIRE(m.AddLocal(Rank("e0", "dp0", 0, 2, 0, 4, 0)).ok());
  REQUIRE(m.AddLocal(Rank("e1", "dp0", 1, 2, 4, 8, 0)).ok());
  auto plan = planner.Get("policy");
  CHECK(plan->status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(plan->status.message()).find("is not ready") != std::string::npos);
}

TEST_CASE("group planner: a forgotten group's plan is dropped") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  GroupPlanner planner(GroupPlannerOptions{}, &m);
  m.OnGroupForgotten([&](const std::string& g) { planner.Forget(g); });
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  REQUIRE(m.AddLocal(Registration("i0", v1::INFERENCE, 0, 8, 0)).ok());
  auto ready = planner.Get("policy");
  REQUIRE(ready->status.ok());
  m.RemoveLocal("policy/t0");
  m.RemoveLocal("policy/i0");
  CHECK(m.GroupNames().empty());
  // Registered again, at a new epoch: planned anew (the old plan is gone, not reused).
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  REQUIRE(m.AddLocal(Registration("i0", v1::INFERENCE, 0, 8, 0)).ok());
  auto again = planner.Get("policy");
  REQUIRE(again->status.ok());
  CHECK(again != ready);
  CHECK(again->epoch > ready->epoch);
}

TEST_CASE("group planner: the layouts sent are compact and expand to the layouts planned") {
  FakeClock clock;
  Membership m(0, absl::Milliseconds(500), 4, &clock);
  m.SetSelf("a", "b", 1);
  GroupPlanner planner(GroupPlannerOptions{}, &m);
  REQUIRE(m.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
  // Two engine replicas of one rank each, with the same buffers (only name and GPU differ).
  v1::RegisterWorkerRequest i0 = Registration("i0", v1::INFERENCE, 0, 8, 0);
  v1::RegisterWorkerRequest i1 = i0;
  i1.mutable_worker()->set_name("i1");
  i1.mutable_worker()->set_gpu(1);
  REQUIRE(m.AddLocal(i0).ok());
  REQUIRE(m.AddLocal(i1).ok());
  auto g = planner.Get("policy");
  REQUIRE(g->status.ok());
  REQUIRE(g->dst.workers_size() == 2);
  CHECK(g->dst.workers(0).buffers_size() == 1);
  CHECK(g->dst.workers(1).buffers_like() == "i0");  // described once
  CHECK(g->dst.workers(1).buffers_size() == 0);
  CHECK(g->planning_time > absl::ZeroDuration());
  // What a node decodes from it is what was planned here: it plans the same plan.
  auto src = LayoutFromProto(g->src);
  auto dst = LayoutFromProto(g->dst);
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  REQUIRE(dst->pieces.size() == 2);
  CHECK(dst->workers[1].gpu == 1);
  REQUIRE(ValidateLayout(*src, "source").ok());
  REQUIRE(ValidateLayout(*dst, "destination").ok());
  v1::InstallPlanRequest request;
  *request.mutable_source() = g->src;
  *request.mutable_destination() = g->dst;
  request.set_max_message_bytes(GroupPlannerOptions{}.max_message_bytes);
  auto again = MakePlan(*src, *dst, PlanOptionsFor(request));
  REQUIRE(again.ok());
  CHECK(again->stats.transfers == g->plan->stats.transfers);
  CHECK(again->stats.messages == g->plan->stats.messages);
  CHECK(again->stats.bytes_total == g->plan->stats.bytes_total);
}

}  // namespace
}  // namespace refit
