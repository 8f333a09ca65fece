// A node installing its plan (a slice with its digests) and the coordinator's lease on its
// rounds, on the injected clock: phase calls and heartbeat answers renew it; when it ends the node
// aborts its round as the coordinator's ABORT would (the transfer cancelled, ABORT to every worker
// of the group); a round whose COMMIT is being delivered is never aborted; a late phase of an
// aborted round is refused. And the pause detector: a failure detector that was itself stopped does
// not declare its peers dead.
#include <catch2/catch.hpp>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/base/culprit.h"
#include "daemon/base/pause_detector.h"
#include "daemon/coordinator/membership.h"
#include "daemon/node/node_agent.h"
#include "daemon/testing/test_registrations.h"
#include "plan/plan_slice.h"
#include "plan/validate.h"
#include "proto/plan_codec.h"

namespace refit {
namespace {
using testing::JoinOf;
using testing::Registration;
using testing::SyncOf;

class FakeBuffer : public MappedBuffer {
 public:
  explicit FakeBuffer(int64_t bytes) : data_(static_cast<size_t>(bytes)) {}
  std::span<std::byte> bytes() const override {
    return {const_cast<std::byte*>(data_.data()), data_.size()};
  }

 private:
  std::vector<std::byte> data_;
};

class FakeBackend : public DataBackend {
 public:
  std::string name() const override { return "fake"; }
  std::string data_address() const override { return "fake:0"; }
  absl::StatusOr<std::unique_ptr<MappedBuffer>> Map(const v1::BufferMemory&,
                                                    int64_t bytes) override {
    return std::unique_ptr<MappedBuffer>(new FakeBuffer(bytes));
  }
  absl::StatusOr<int32_t> GpuIndex(const std::string&) override { return 0; }
  absl::StatusOr<std::unique_ptr<MappedBuffer>> AllocateScratch(const Worker&, int64_t) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<TransferStats> Transfer(const TransferJob&) override { return TransferStats{}; }
  void Cancel(const std::string& group, int64_t round_id, const std::string& reason) override {
    absl::MutexLock lock(&mu_);
    cancels.push_back(absl::StrCat(group, "/", round_id, ": ", reason));
  }
  std::vector<std::string> Cancels() {
    absl::MutexLock lock(&mu_);
    return cancels;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> cancels ABSL_GUARDED_BY(mu_);
};

v1::RegisterWorkerRequest WithMemory(v1::RegisterWorkerRequest r) {
  r.add_memory()->mutable_shm()->set_name("unused");
  return r;
}

struct Node {
  FakeClock clock;
  FakeBackend backend;
  WorkerRegistry registry{1, {}, &backend, nullptr};
  std::unique_ptr<NodeAgent> agent;
  std::shared_ptr<LocalWorker> trainer, engine;

  // `sliced`: the plan arrives as the coordinator sends it, this node's slice and its digests
  // (plan_digest: the plan's identity); otherwise as layouts the node plans itself.
  explicit Node(bool sliced = false, const std::string& plan_digest = std::string(32, 'p')) {
    NodeAgentLease lease;
    lease.clock = &clock;
    lease.lease = absl::Seconds(2);
    lease.coordinator = "10.0.0.0:7070";
    agent = std::make_unique<NodeAgent>(1, &registry, &backend, lease);
    auto t = registry.Register(WithMemory(Registration("t0", v1::TRAINER, 0, 8, 1)),
                               WorkerTransport::kInProcess);
    auto e = registry.Register(WithMemory(Registration("i0", v1::INFERENCE, 0, 8, 1)),
                               WorkerTransport::kInProcess);
    REQUIRE(t.ok());
    REQUIRE(e.ok());
    trainer = t->worker;
    engine = e->worker;
    // The plan: this node holds both sides.
    v1::InstallPlanRequest install;
    install.set_group("policy");
    install.set_epoch(1);
    Layout src, dst;
    testing::AddSplitTensor(src, "w", Dims{8, 4}, DType::kF32, 0, {0, 8}, {{0, 0}}, "t0");
    testing::AddSplitTensor(dst, "w", Dims{8, 4}, DType::kF32, 0, {0, 8}, {{0, 0}}, "i0");
    src.workers[0].name = "t0";
    dst.workers[0].name = "i0";
    src.workers[0].node = 1;
    dst.workers[0].node = 1;
    install.set_max_message_bytes(1 << 20);
    if (sliced) {
      REQUIRE(ValidateLayout(src, "source").ok());
      REQUIRE(ValidateLayout(dst, "destination").ok());
      auto plan = MakePlan(src, dst, PlanOptions{});
      REQUIRE(plan.ok());
      install.set_plan_digest(plan_digest);
      install.set_slice(SliceToWire(SliceOfPlan(*plan, 1, 0), 1, src, dst));
      install.set_slice_digest(Sha256(install.slice()));
      sliced_install = install;
    } else {
      *install.mutable_source() = LayoutToProto(src);
      *install.mutable_destination() = LayoutToProto(dst);
    }
    REQUIRE(agent->InstallPlan(install).ok());
  }
  v1::InstallPlanRequest sliced_install;

  // PREPARE of `round`, both workers confirming at once (as their sessions would).
  absl::Status Prepare(int64_t round, const std::string& plan_digest = std::string()) {
    std::thread confirm([&] {
      const absl::Time until = absl::Now() + absl::Seconds(5);
      for (auto* w : {trainer.get(), engine.get()}) {
        while (absl::Now() < until) {
          {
            absl::MutexLock lock(&w->mu);
            if (!w->outbox.empty() && w->outbox.back().kind() == v1::RoundEvent::PREPARE) break;
          }
          absl::SleepFor(absl::Milliseconds(1));
        }
        v1::WorkerMessage m;
        m.set_prepared(round);
        registry.Record(*w, m);
      }
    });
    v1::PhaseResponse out;
    v1::PhaseRequest prepare = Phase(v1::PhaseRequest::PREPARE, round);
    prepare.set_plan_digest(plan_digest);
    const absl::Status s = agent->RunPhase(prepare, &out);
    confirm.join();
    return s;
  }
  static v1::PhaseRequest Phase(v1::PhaseRequest::Phase p, int64_t round) {
    v1::PhaseRequest r;
    r.set_phase(p);
    r.set_group("policy");
    r.set_round_id(round);
    r.set_version(round * 10);
    r.set_epoch(1);
    r.set_timeout_ms(5000);
    return r;
  }
  // The kinds of events queued for a worker, oldest first.
  static std::vector<std::string> Events(LocalWorker& w) {
    absl::MutexLock lock(&w.mu);
    std::vector<std::string> out;
    for (const auto& e : w.outbox) {
      out.push_back(absl::StrCat(v1::RoundEvent::Kind_Name(e.kind()), " ", e.round_id()));
    }
    return out;
  }
  static std::string LastReason(LocalWorker& w) {
    absl::MutexLock lock(&w.mu);
    return w.outbox.empty() ? "" : w.outbox.back().reason();
  }
};

TEST_CASE(
    "lease: ends the node's round when the coordinator falls silent, and tells every worker") {
  Node n;
  REQUIRE(n.Prepare(7).ok());
  CHECK(n.agent->ExpireLeases() == 0);
  n.clock.Advance(absl::Seconds(2));
  CHECK(n.agent->ExpireLeases() == 0);  // exactly the lease: still held
  n.clock.Advance(absl::Milliseconds(1));
  CHECK(n.agent->ExpireLeases() == 1);
  CHECK(Node::Events(*n.trainer) == std::vector<std::string>{"PREPARE 7", "ABORT 7"});
  CHECK(Node::Events(*n.engine) == std::vector<std::string>{"PREPARE 7", "ABORT 7"});
  const std::string why = Node::LastReason(*n.engine);
  INFO(why);
  CHECK(why.find("the coordinator (10.0.0.0:7070) was lost: its lease on round 7") !=
        std::string::npos);
  CHECK(why.find("node 1") == std::string::npos);  // never names this innocent node
  REQUIRE(n.backend.Cancels().size() == 1);
  CHECK(n.backend.Cancels()[0].rfind("policy/7: the coordinator", 0) == 0);
  CHECK(n.agent->ExpireLeases() == 0);  // once

  // The coordinator, woken, sends the next phase of the round: refused, never delivered.
  v1::PhaseResponse out;
  for (auto p : {v1::PhaseRequest::TRANSFER, v1::PhaseRequest::COMMIT}) {
    const absl::Status s = n.agent->RunPhase(Node::Phase(p, 7), &out);
    CHECK(s.code() == absl::StatusCode::kAborted);
    CHECK(s.message().find("lease on round 7") != std::string::npos);
  }
  CHECK(Node::Events(*n.engine).back() == "ABORT 7");
}

TEST_CASE("lease: heartbeat answers and phase calls renew it") {
  Node n;
  REQUIRE(n.Prepare(3).ok());
  for (int i = 0; i < 10; ++i) {  // 15 s of heartbeat answers every 1.5 s
    n.clock.Advance(absl::Milliseconds(1500));
    n.agent->RenewLeases();
    CHECK(n.agent->ExpireLeases() == 0);
  }
  n.clock.Advance(absl::Milliseconds(1500));
  v1::PhaseResponse out;
  CHECK(n.agent->RunPhase(Node::Phase(v1::PhaseRequest::TRANSFER, 3), &out).ok());  // renews it
  n.clock.Advance(absl::Milliseconds(1500));
  CHECK(n.agent->ExpireLeases() == 0);
  CHECK(Node::Events(*n.engine) == std::vector<std::string>{"PREPARE 3"});
  n.clock.Advance(absl::Milliseconds(600));
  CHECK(n.agent->ExpireLeases() == 1);
}

TEST_CASE("lease: answers that no longer list the round do not renew it (its COMMIT never came)") {
  // An asymmetric partition: the coordinator's calls to this node are lost, this node's
  // heartbeats reach it. The coordinator ended round 6 (committed without this node's
  // confirmation, or aborted); its answers list what it still runs.
  Node n;
  REQUIRE(n.Prepare(6).ok());
  v1::PhaseResponse out;
  REQUIRE(n.agent->RunPhase(Node::Phase(v1::PhaseRequest::TRANSFER, 6), &out).ok());
  const std::map<std::string, int64_t> running_6 = {{"policy", 6}};
  const std::map<std::string, int64_t> another = {{"policy", 7}, {"other", 6}};
  const std::map<std::string, int64_t> none;
  for (int i = 0; i < 4; ++i) {  // while the coordinator runs it: renewed
    n.clock.Advance(absl::Milliseconds(1500));
    n.agent->RenewLeases(&running_6);
    CHECK(n.agent->ExpireLeases() == 0);
  }
  // Over at the coordinator: answers keep coming, and renew nothing.
  n.clock.Advance(absl::Milliseconds(1500));
  n.agent->RenewLeases(&none);
  n.agent->RenewLeases(&another);  // another round of the group, or the same id of another group
  CHECK(n.agent->ExpireLeases() == 0);
  n.clock.Advance(absl::Milliseconds(501));
  n.agent->RenewLeases(&none);
  CHECK(n.agent->ExpireLeases() == 1);
  // The engines drop the round (and with it any version: their replica holds none).
  CHECK(Node::Events(*n.engine) == std::vector<std::string>{"PREPARE 6", "ABORT 6"});
  CHECK(Node::LastReason(*n.engine).find("lease on round 6") != std::string::npos);
}

TEST_CASE(
    "lease: a round whose COMMIT is being delivered is never aborted; a resync ends open rounds") {
  Node n;
  REQUIRE(n.Prepare(4).ok());
  v1::PhaseResponse out;
  REQUIRE(n.agent->RunPhase(Node::Phase(v1::PhaseRequest::TRANSFER, 4), &out).ok());
  // COMMIT delivered, the engine slow to confirm; the coordinator goes silent meanwhile.
  std::thread commit([&] {
    v1::PhaseRequest c = Node::Phase(v1::PhaseRequest::COMMIT, 4);
    c.set_timeout_ms(300);
    n.agent->RunPhase(c, &out).IgnoreError();
  });
  while (Node::Events(*n.engine).back() != "COMMIT 4") absl::SleepFor(absl::Milliseconds(1));
  n.clock.Advance(absl::Seconds(10));
  CHECK(n.agent->ExpireLeases() == 0);
  CHECK(n.agent->AbortOpenRounds("the coordinator restarted") == 0);
  commit.join();
  CHECK(Node::Events(*n.engine).back() == "COMMIT 4");

  // The coordinator restarted (or declared this node dead) while round 5 was open here.
  REQUIRE(n.Prepare(5).ok());
  CHECK(n.agent->AbortOpenRounds("the coordinator no longer knows this node") == 1);
  CHECK(Node::Events(*n.trainer).back() == "ABORT 5");
  CHECK(Node::Events(*n.engine).back() == "ABORT 5");
  CHECK(Node::LastReason(*n.engine).find("no longer knows this node") != std::string::npos);
}

// Not the lease, but the same node: a worker lost mid-round is named the culprit of the node's
// TRANSFER failure (structured, not only in words), and the node forgets a group none of whose
// workers is left once no round of it is open.
TEST_CASE(
    "node agent: a lost worker is the culprit of its round; a group without workers is forgotten") {
  Node n;
  REQUIRE(n.Prepare(1).ok());
  REQUIRE(n.registry.Drop("policy/i0") != nullptr);
  n.agent->WorkerLost("policy", "policy/i0", "its session ended");
  v1::PhaseResponse out;
  const absl::Status transfer = n.agent->RunPhase(Node::Phase(v1::PhaseRequest::TRANSFER, 1), &out);
  CHECK(transfer.code() == absl::StatusCode::kAborted);
  const std::optional<v1::Culprit> culprit = CulpritOf(transfer);
  REQUIRE(culprit.has_value());
  CHECK(culprit->kind() == v1::Culprit::WORKER);
  CHECK(culprit->worker_id() == "policy/i0");
  CHECK(culprit->node() == 1);
  CHECK(culprit->phase() == "TRANSFER");
  CHECK(n.agent->GroupsKept() == 1);
  // A worker of the group outside the plan (registered since: its replica incomplete) was in no
  // round: the ABORT goes to the round's workers only.
  auto outsider = n.registry.Register(WithMemory(Registration("i9", v1::INFERENCE, 0, 8, 1)),
                                      WorkerTransport::kInProcess);
  REQUIRE(outsider.ok());
  REQUIRE(n.agent->RunPhase(Node::Phase(v1::PhaseRequest::ABORT, 1), &out).ok());
  CHECK(Node::Events(*n.trainer).back() == "ABORT 1");
  CHECK(Node::Events(*outsider->worker).empty());
  REQUIRE(n.registry.Drop("policy/i9") != nullptr);
  CHECK(n.agent->GroupsKept() == 1);  // its trainer is still here
  REQUIRE(n.registry.Drop("policy/t0") != nullptr);
  n.agent->WorkerLost("policy", "policy/t0", "unregistered");
  CHECK(n.agent->GroupsKept() == 0);
  // A PREPARE for the forgotten group is refused: no plan of it here any more.
  CHECK(n.agent->RunPhase(Node::Phase(v1::PhaseRequest::PREPARE, 2), &out).code() ==
        absl::StatusCode::kFailedPrecondition);
}

// Several workers lost in one round (a frozen daemon's workers all drop their sessions at once):
// the first is the culprit, and the failure's words name the same worker.
TEST_CASE(
    "node agent: of several workers lost in a round, the first is its culprit and its reason") {
  Node n;
  REQUIRE(n.Prepare(1).ok());
  REQUIRE(n.registry.Drop("policy/i0") != nullptr);
  n.agent->WorkerLost("policy", "policy/i0", "its session ended");
  REQUIRE(n.registry.Drop("policy/t0") != nullptr);
  n.agent->WorkerLost("policy", "policy/t0", "its session ended");
  v1::PhaseResponse out;
  const absl::Status transfer = n.agent->RunPhase(Node::Phase(v1::PhaseRequest::TRANSFER, 1), &out);
  CHECK(transfer.code() == absl::StatusCode::kAborted);
  const std::optional<v1::Culprit> culprit = CulpritOf(transfer);
  REQUIRE(culprit.has_value());
  CHECK(culprit->worker_id() == "policy/i0");
  CHECK(transfer.message().find("policy/i0") != absl::string_view::npos);
  CHECK(transfer.message().find("policy/t0") == absl::string_view::npos);
}

// The coordinator's ABORT (another node failed first) can reach a node before the same round's
// PREPARE: the PREPARE must not reopen the round (it used to, and waited for its workers).
TEST_CASE("node agent: a PREPARE that arrives after its round's ABORT is refused at once") {
  Node n;
  v1::PhaseResponse out;
  v1::PhaseRequest abort = Node::Phase(v1::PhaseRequest::ABORT, 5);
  abort.set_reason("node 2 (10.0.0.2:7070) failed PREPARE: refused");
  REQUIRE(n.agent->RunPhase(abort, &out).ok());
  const absl::Time t0 = absl::Now();
  const absl::Status late = n.agent->RunPhase(Node::Phase(v1::PhaseRequest::PREPARE, 5), &out);
  CHECK(absl::Now() - t0 < absl::Milliseconds(500));
  CHECK(late.code() == absl::StatusCode::kAborted);
  CHECK_THAT(std::string(late.message()),
             Catch::Contains("was aborted before its PREPARE reached node 1"));
  CHECK_THAT(std::string(late.message()), Catch::Contains("failed PREPARE: refused"));
  for (auto* w : {n.trainer.get(), n.engine.get()}) {
    for (const std::string& e : Node::Events(*w))
      CHECK(e.rfind("PREPARE", 0) != 0);  // never asked to prepare
  }
  // The next round is not affected.
  CHECK(n.Prepare(6).ok());
}

TEST_CASE("lease: none on the coordinator's own node") {
  FakeClock clock;
  FakeBackend backend;
  WorkerRegistry registry{0, {}, &backend, nullptr};
  NodeAgentLease lease;
  lease.clock = &clock;
  NodeAgent agent(0, &registry, &backend, lease);
  clock.Advance(absl::Hours(1));
  CHECK(agent.ExpireLeases() == 0);
}

TEST_CASE(
    "pause detector: a gap between ticks is a pause; the frozen failure detector judges nobody") {
  FakeClock clock;
  PauseDetector pause(&clock, absl::Milliseconds(500));
  for (int i = 0; i < 10; ++i) {
    clock.Advance(absl::Milliseconds(100));
    CHECK_FALSE(pause.Tick().has_value());
  }
  CHECK_FALSE(pause.LastPause().has_value());

  // The coordinator's failure detector as Daemon::MonitorLoop runs it: peers judged only when
  // the detector has run for a whole verdict since its last pause.
  Membership m(0, absl::Milliseconds(500), 4, &clock);  // dead after 2 s of silence
  m.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
  for (int32_t node : {1, 2}) {
    m.Join(JoinOf(node, 10 + node));
    REQUIRE(m.ApplySync(SyncOf(node, 10 + node,
                               {Registration(absl::StrCat("i", node), v1::INFERENCE, 0, 8, node)}))
                .ok());
  }
  auto monitor = [&] {
    pause.Tick();
    if (pause.PausedWithin(absl::Seconds(2))) return std::vector<DeadNode>{};
    return m.CheckLiveness();
  };
  // SIGSTOP for 12 s: no heartbeat received meanwhile (both peers went on sending them).
  clock.Advance(absl::Seconds(12));
  CHECK(monitor().empty());
  const auto p = pause.LastPause();
  REQUIRE(p.has_value());
  CHECK(p->length() == absl::Seconds(12));
  // Awake: node 1's queued heartbeats arrive; node 2 really died during the freeze.
  for (int i = 0; i < 19; ++i) {
    clock.Advance(absl::Milliseconds(100));
    m.Join(JoinOf(1, 11));
    CHECK(monitor().empty());
  }
  clock.Advance(absl::Milliseconds(200));
  m.Join(JoinOf(1, 11));
  const std::vector<DeadNode> dead = monitor();
  REQUIRE(dead.size() == 1);
  CHECK(dead[0].node == 2);  // the one that failed, a whole verdict after the detector woke
  CHECK(m.ControlAddress(1).ok());
}

TEST_CASE("a node runs the slice the coordinator sent, and only the plan the round names") {
  const std::string digest(32, 'd');
  Node node(/*sliced=*/true, digest);
  REQUIRE(node.Prepare(1, digest).ok());
  v1::PhaseResponse out;
  REQUIRE(node.agent->RunPhase(Node::Phase(v1::PhaseRequest::TRANSFER, 1), &out).ok());
  // A round running another plan (a node that missed an install) is refused, naming both.
  node.agent->RunPhase(Node::Phase(v1::PhaseRequest::ABORT, 1), &out).IgnoreError();
  const absl::Status other = node.Prepare(2, std::string(32, 'x'));
  CHECK(other.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(other.message().find("node 1 holds plan 646464646464") != std::string::npos);
  CHECK(other.message().find("the round runs plan 787878787878") != std::string::npos);
}

TEST_CASE(
    "a damaged slice, or one made for another node, is refused and the plan installed stays") {
  Node node(/*sliced=*/true, std::string(32, 'd'));
  v1::InstallPlanRequest damaged = node.sliced_install;
  damaged.mutable_slice()->back() ^= 1;
  absl::Status s = node.agent->InstallPlan(damaged);
  CHECK(s.code() == absl::StatusCode::kDataLoss);
  CHECK(s.message().find("node 1: the plan slice of group \"policy\" epoch 1 (plan 646464646464) "
                         "arrived damaged") != std::string::npos);
  v1::InstallPlanRequest elsewhere = node.sliced_install;
  v1::PlanSlice slice;
  REQUIRE(slice.ParseFromString(elsewhere.slice()));
  slice.set_node(2);
  elsewhere.set_slice(slice.SerializeAsString());
  elsewhere.set_slice_digest(Sha256(elsewhere.slice()));
  s = node.agent->InstallPlan(elsewhere);
  CHECK(s.message().find("made for node 2, not node 1") != std::string::npos);
  v1::InstallPlanRequest unnamed = node.sliced_install;
  unnamed.clear_plan_digest();
  CHECK(node.agent->InstallPlan(unnamed).message().find("names no plan digest") !=
        std::string::npos);
  // The plan installed before is still there: its round runs.
  CHECK(node.Prepare(1, std::string(32, 'd')).ok());
}

}  // namespace
}  // namespace refit
