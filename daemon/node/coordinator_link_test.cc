// A node's link to its coordinator, against an in-process coordinator (a real Membership behind
// a RefitPeer service) that drops or delays one message: a node declared dead rejoins with its
// workers whichever message of the rejoin (the heartbeat, its answer, the SyncWorkers, its
// answer) is lost or late, and a worker list that failed to reach the coordinator is sent again.
// A worker list that reaches the coordinator late (after a newer one, or after the node was
// declared dead and admitted again) changes nothing.
#include "daemon/node/coordinator_link.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/membership.h"
#include "daemon/testing/test_registrations.h"

namespace refit {
namespace {
using testing::Registration;

enum class Call { kJoin, kSync };
enum class Fault {
  kNone,
  kDropRequest,  // never reaches the coordinator
  kDropAnswer,   // the coordinator acts on it; its answer is lost
  kLateAnswer,   // the coordinator acts on it; its answer comes after the caller's deadline
  kRebase,       // a change: refused as onto another list than the one held (ABORTED)
};

std::string Name(Call c) { return c == Call::kJoin ? "Join" : "SyncWorkers"; }
std::string Name(Fault f) {
  switch (f) {
    case Fault::kDropRequest:
      return "request dropped";
    case Fault::kDropAnswer:
      return "answer dropped";
    case Fault::kLateAnswer:
      return "answer late";
    case Fault::kRebase:
      return "change refused";
    case Fault::kNone:
      break;
  }
  return "none";
}

// The coordinator's side of Join and SyncWorkers, as services.cc answers them, with one fault
// armed at a time. Calls are handled one at a time (`mu_` held across the membership's call), so
// that a fault armed together with a verdict hits the first call that sees the verdict.
class FakeCoordinator : public v1::RefitPeer::Service {
 public:
  explicit FakeCoordinator(Membership* membership) : membership_(membership) {}

  // Declares `node` dead and arms `fault` for the next `call`, at once. `deliver_held`: the
  // armed call, once handled, lets a held sync (HoldNextSync) reach the membership.
  void DeclareDeadThen(int32_t node, Call call, Fault fault, bool deliver_held = false) {
    absl::MutexLock lock(&mu_);
    REQUIRE(membership_->MarkDead(node, "declared dead by the test"));
    armed_ = {call, fault};
    fired_ = false;
    deliver_after_ = deliver_held ? std::optional<Call>(call) : std::nullopt;
  }
  // The next SyncWorkers is held in the network: its caller gives up at its deadline, and the
  // membership receives it only after the next `after` call has been handled (nullopt: the call
  // DeclareDeadThen arms).
  void HoldNextSync(std::optional<Call> after) {
    absl::MutexLock lock(&mu_);
    hold_next_sync_ = true;
    deliver_after_ = after;
  }
  // What the membership answered the held sync, once it reached it (within 10 s; nullopt if not).
  std::optional<absl::Status> HeldSyncDelivered() {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(
        absl::Condition(
            +[](std::optional<absl::Status>* s) { return s->has_value(); }, &held_result_),
        absl::Seconds(10));
    return held_result_;
  }
  // Whether the sync to hold has arrived (waiting for it 10 s at most).
  bool SyncHeld() {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&sync_held_), absl::Seconds(10));
  }
  // Arms `fault` for the next `call`.
  void Arm(Call call, Fault fault) {
    absl::MutexLock lock(&mu_);
    armed_ = {call, fault};
    fired_ = false;
  }
  bool Fired() {
    absl::MutexLock lock(&mu_);
    return fired_;
  }
  struct Seen {
    int joins = 0, changes = 0, whole_lists = 0;
  };
  Seen seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

  grpc::Status Join(grpc::ServerContext* ctx, const v1::JoinRequest* r,
                    v1::JoinResponse* out) override {
    Fault f;
    {
      absl::MutexLock lock(&mu_);
      f = Take(Call::kJoin);
      if (f == Fault::kDropRequest) return Dropped();
      ++seen_.joins;
      out->set_resync(membership_->Join(*r));
      out->set_coordinator_node(0);
      out->set_coordinator_incarnation(1);
      DeliverHeldAfter(Call::kJoin);
    }
    return Answer(ctx, f);
  }
  grpc::Status SyncWorkers(grpc::ServerContext* ctx, const v1::SyncWorkersRequest* r,
                           v1::SyncWorkersResponse* out) override {
    Fault f;
    grpc::Status applied;
    {
      absl::MutexLock lock(&mu_);
      if (std::exchange(hold_next_sync_, false)) return DeliverWhenReleased(*r, out);
      f = Take(Call::kSync);
      if (f == Fault::kDropRequest) return Dropped();
      ++(r->delta() ? seen_.changes : seen_.whole_lists);
      if (f == Fault::kRebase && r->delta())
        return grpc::Status(grpc::StatusCode::ABORTED, "refused by the test");
      const absl::Status s = membership_->ApplySync(*r, out);
      applied =
          s.ok() ? grpc::Status::OK
                 : grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
      DeliverHeldAfter(Call::kSync);
    }
    if (!applied.ok()) return applied;
    return Answer(ctx, f);
  }

 private:
  Fault Take(Call call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (armed_.second == Fault::kNone || armed_.first != call) return Fault::kNone;
    fired_ = true;
    return std::exchange(armed_.second, Fault::kNone);
  }
  // The held sync, delivered once released (its caller may have given up on it meanwhile).
  grpc::Status DeliverWhenReleased(const v1::SyncWorkersRequest& held, v1::SyncWorkersResponse* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    sync_held_ = true;
    if (!mu_.AwaitWithTimeout(absl::Condition(&release_held_), absl::Seconds(10))) return Dropped();
    const absl::Status s = membership_->ApplySync(held, out);
    held_result_ = s;
    return s.ok() ? grpc::Status::OK
                  : grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
  }
  // After a `call` handled: the held sync, if it waits for this call, reaches the membership
  // now, before any other call (this one waits for it, lock released).
  void DeliverHeldAfter(Call call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (deliver_after_ != call || release_held_) return;
    release_held_ = true;
    mu_.AwaitWithTimeout(
        absl::Condition(
            +[](std::optional<absl::Status>* s) { return s->has_value(); }, &held_result_),
        absl::Seconds(10));
  }
  static grpc::Status Dropped() {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "dropped by the test");
  }
  // The answer as `f` says; a late one is held until the caller has given up on it.
  static grpc::Status Answer(grpc::ServerContext* ctx, Fault f) {
    if (f == Fault::kDropAnswer) return Dropped();
    if (f == Fault::kLateAnswer)
      std::this_thread::sleep_until(ctx->deadline() + std::chrono::milliseconds(20));
    return grpc::Status::OK;
  }

  Membership* const membership_;
  absl::Mutex mu_;
  std::pair<Call, Fault> armed_ ABSL_GUARDED_BY(mu_){Call::kJoin, Fault::kNone};
  bool fired_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_next_sync_ ABSL_GUARDED_BY(mu_) = false;
  bool sync_held_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<Call> deliver_after_ ABSL_GUARDED_BY(mu_);
  bool release_held_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<absl::Status> held_result_ ABSL_GUARDED_BY(mu_);
  Seen seen_ ABSL_GUARDED_BY(mu_);
};

// A coordinator (node 0) on a loopback port, and node 1's link to it, heartbeating every
// `heartbeat`.
struct Rejoin {
  FakeClock clock;  // nobody is declared dead by the clock: the test does it
  Membership membership{0, absl::Milliseconds(50), 4, &clock};
  FakeCoordinator coordinator{&membership};
  std::unique_ptr<grpc::Server> server;
  absl::Mutex mu;
  std::vector<v1::RegisterWorkerRequest> workers ABSL_GUARDED_BY(mu) = {
      Registration("i0", v1::INFERENCE, 0, 4, 1), Registration("i1", v1::INFERENCE, 4, 8, 1)};
  std::atomic<int> resyncs{0};  // answers that told the node to resync (it aborts its rounds)
  std::unique_ptr<CoordinatorLink> link;

  explicit Rejoin(absl::Duration heartbeat = absl::Milliseconds(50),
                  absl::Duration peer_timeout = absl::Milliseconds(300)) {
    membership.SetSelf("127.0.0.1:1", "127.0.0.1:2", 1);
    REQUIRE(membership.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&coordinator);
    server = builder.BuildAndStart();
    REQUIRE(server != nullptr);
    CoordinatorLinkOptions o;
    o.coordinator = absl::StrCat("127.0.0.1:", port);
    o.node = 1;
    o.incarnation = 11;
    o.heartbeat = heartbeat;
    o.peer_timeout = peer_timeout;
    o.snapshot = [this] {
      absl::MutexLock lock(&mu);
      return workers;
    };
    o.on_answer = [this](const v1::JoinResponse& answer) {
      if (answer.resync()) ++resyncs;
    };
    link = std::make_unique<CoordinatorLink>(std::move(o));
    REQUIRE(link->Join("127.0.0.1:3", "127.0.0.1:4").ok());
    REQUIRE(link->Sync().ok());  // as a registration does
    REQUIRE(Converges(2));
  }
  ~Rejoin() {
    link->Stop();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  // Node 1 alive with `n` workers at the coordinator within 10 s (a heartbeat is 50 ms).
  bool Converges(int n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      if (membership.ControlAddress(1).ok() && membership.Group("policy", false).inference == n)
        return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }
};

TEST_CASE(
    "coordinator link: a node declared dead rejoins with its workers, whichever message is lost or "
    "late") {
  for (Call call : {Call::kJoin, Call::kSync}) {
    for (Fault fault : {Fault::kDropRequest, Fault::kDropAnswer, Fault::kLateAnswer}) {
      DYNAMIC_SECTION(Name(call) << ": " << Name(fault)) {
        Rejoin r;
        const int told_before = r.resyncs.load();
        r.coordinator.DeclareDeadThen(1, call, fault);
        CHECK(r.Converges(2));
        CHECK(r.coordinator.Fired());           // the fault did hit the rejoin
        CHECK(r.resyncs.load() > told_before);  // the node learned it had been declared dead
        // And it stays so: plain heartbeats from now on, the workers kept.
        const int told = r.resyncs.load();
        absl::SleepFor(absl::Milliseconds(300));
        CHECK(r.resyncs.load() == told);
        CHECK(r.membership.Group("policy", false).inference == 2);
      }
    }
  }
}

TEST_CASE("coordinator link: a worker list that did not reach the coordinator is sent again") {
  Rejoin r;
  {
    absl::MutexLock lock(&r.mu);
    r.workers.push_back(Registration("i2", v1::INFERENCE, 0, 8, 1, "other"));
  }
  // A registration's sync is lost; the coordinator, which has a list of the node's, does not ask.
  r.coordinator.Arm(Call::kSync, Fault::kDropRequest);
  CHECK_FALSE(r.link->Sync().ok());
  CHECK(r.coordinator.Fired());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (r.membership.Group("other", false).inference != 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  CHECK(r.membership.Group("other", false).inference == 1);
  CHECK(r.membership.Group("policy", false).inference == 2);
}

// The coordinator keeps serving a call its caller gave up on: a sync that timed out here may be
// applied after the one sent in its place. It used to overwrite the newer list, for good.
TEST_CASE("coordinator link: a worker list that arrives after a newer one changes nothing") {
  // Heartbeats far apart: the only syncs are the test's own, in the order it sends them.
  Rejoin r(absl::Seconds(30));
  {
    absl::MutexLock lock(&r.mu);
    r.workers.push_back(Registration("i2", v1::INFERENCE, 0, 8, 1, "other"));
  }
  r.coordinator.HoldNextSync(Call::kSync);
  CHECK_FALSE(r.link->Sync().ok());  // held past its deadline
  {
    absl::MutexLock lock(&r.mu);
    r.workers.pop_back();  // "i2" leaves; the list without it goes next
  }
  REQUIRE(r.link->Sync().ok());
  const std::optional<absl::Status> held = r.coordinator.HeldSyncDelivered();
  REQUIRE(held.has_value());
  CHECK(held->ok());  // ignored: its sender has long moved on
  CHECK(r.membership.Counts().stale_syncs == 1);
  CHECK_FALSE(r.membership.Group("other", false).exists);
  CHECK(r.membership.Group("policy", false).inference == 2);
}

// A list sent before the node was declared dead, reaching the coordinator just after the
// heartbeat that admitted the node again (whose answer was lost), used to count as the node's
// resync: it never heard that it had been declared dead, so it never aborted its rounds.
TEST_CASE("coordinator link: a worker list sent before a death verdict is not the revived node's") {
  Rejoin r;
  const int told_before = r.resyncs.load();
  r.coordinator.HoldNextSync(std::nullopt);  // delivered after the call DeclareDeadThen arms
  std::thread registration([&] { (void)r.link->Sync(); });  // as a registration does
  CHECK(r.coordinator.SyncHeld());
  r.coordinator.DeclareDeadThen(1, Call::kJoin, Fault::kDropAnswer, /*deliver_held=*/true);
  const std::optional<absl::Status> held = r.coordinator.HeldSyncDelivered();
  registration.join();
  REQUIRE(held.has_value());
  CHECK(held->code() == absl::StatusCode::kFailedPrecondition);
  CHECK(r.membership.Counts().stale_syncs == 1);
  CHECK(r.Converges(2));
  CHECK(r.resyncs.load() > told_before);  // the node learned it had been declared dead
}

TEST_CASE(
    "coordinator link: registrations and departures travel as changes; a change the coordinator "
    "cannot apply is followed by the whole list in the same call") {
  Rejoin r;
  const FakeCoordinator::Seen start = r.coordinator.seen();
  const v1::RegisterWorkerRequest i2 = Registration("i2", v1::INFERENCE, 0, 8, 1, "other");
  {
    absl::MutexLock lock(&r.mu);
    r.workers.push_back(i2);
  }
  REQUIRE(r.link->SyncAdded(i2).ok());
  CHECK(r.membership.Group("other", false).inference == 1);
  {
    absl::MutexLock lock(&r.mu);
    r.workers.erase(r.workers.begin());  // i0 leaves
  }
  REQUIRE(r.link->SyncRemoved("policy/i0").ok());
  CHECK(r.membership.Group("policy", false).inference == 1);
  FakeCoordinator::Seen now = r.coordinator.seen();
  CHECK(now.changes - start.changes == 2);
  CHECK(now.whole_lists == start.whole_lists);
  // The coordinator holds another list than the node believes: refused, then the whole list.
  const v1::RegisterWorkerRequest i3 = Registration("i3", v1::INFERENCE, 0, 8, 1, "third");
  {
    absl::MutexLock lock(&r.mu);
    r.workers.push_back(i3);
  }
  r.coordinator.Arm(Call::kSync, Fault::kRebase);
  REQUIRE(r.link->SyncAdded(i3).ok());
  CHECK(r.coordinator.Fired());
  CHECK(r.membership.Group("third", false).inference == 1);
  CHECK(r.membership.Group("policy", false).inference == 1);
  now = r.coordinator.seen();
  CHECK(now.whole_lists == start.whole_lists + 1);
  // A sync whose answer was lost: the coordinator's list is unknown, so the next goes whole.
  r.coordinator.Arm(Call::kSync, Fault::kDropAnswer);
  CHECK_FALSE(r.link->SyncRemoved("other/i2").ok());
  const FakeCoordinator::Seen lost = r.coordinator.seen();
  {
    absl::MutexLock lock(&r.mu);
    r.workers.erase(r.workers.begin() + 1);  // i2 left
  }
  REQUIRE(r.link->SyncRemoved("other/i2").ok());
  CHECK(r.coordinator.seen().whole_lists >= lost.whole_lists + 1);
  CHECK_FALSE(r.membership.Group("other", false).exists);
  // The deadline of a sync grows with its size.
  CHECK(r.link->SyncTimeout(0) == absl::Milliseconds(300));
  CHECK(r.link->SyncTimeout(80'000'000) == absl::Milliseconds(300) + absl::Seconds(10));
}

// A change sent while the node was dead and had not yet heartbeated again was refused unapplied,
// yet the node then took the coordinator's list for unknown and sent its whole list: tens of MB
// for a node of large workers, where the coordinator kept the list to revive with a change.
TEST_CASE(
    "coordinator link: a change refused before the node rejoined follows as a change onto the "
    "list kept for it, a departure included") {
  Rejoin r(/*heartbeat=*/absl::Milliseconds(400));
  const FakeCoordinator::Seen start = r.coordinator.seen();
  REQUIRE(r.membership.MarkDead(1, "declared dead by the test"));
  {
    absl::MutexLock lock(&r.mu);
    r.workers.erase(r.workers.begin());  // i0 leaves while the node is dead
  }
  const absl::Status refused = r.link->SyncRemoved("policy/i0");
  CHECK(refused.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(refused.message().find("has not joined") != std::string::npos);
  // The next heartbeat rejoins the node; its resync is a change onto the kept list, with i0 gone.
  CHECK(r.Converges(1));
  const FakeCoordinator::Seen now = r.coordinator.seen();
  CHECK(now.whole_lists == start.whole_lists);
  CHECK(now.changes >= start.changes + 2);
  std::vector<std::string> names;
  for (const auto& [node, w] : r.membership.Group("policy", false).workers)
    if (node == 1) names.push_back(w.worker().name());
  CHECK(names == std::vector<std::string>{"i1"});
  // And the list the coordinator holds is the base of the next change.
  const v1::RegisterWorkerRequest i2 = Registration("i2", v1::INFERENCE, 0, 8, 1, "other");
  {
    absl::MutexLock lock(&r.mu);
    r.workers.push_back(i2);
  }
  REQUIRE(r.link->SyncAdded(i2).ok());
  CHECK(r.membership.Group("other", false).inference == 1);
  CHECK(r.coordinator.seen().whole_lists == start.whole_lists);
}

// Resyncs were sent from the heartbeat thread: a list that took longer than the death verdict to
// send held up the heartbeats, the node was declared dead for it, and asked for the list again.
TEST_CASE("coordinator link: heartbeats go on while a sync is on its way") {
  Rejoin r(absl::Milliseconds(50), /*peer_timeout=*/absl::Seconds(3));
  r.coordinator.DeclareDeadThen(1, Call::kJoin, Fault::kNone);
  r.coordinator.HoldNextSync(Call::kSync);  // the resync, held until the next sync is handled
  REQUIRE(r.coordinator.SyncHeld());
  const int joins = r.coordinator.seen().joins;
  absl::SleepFor(absl::Seconds(1));                // within the held sync's deadline
  CHECK(r.coordinator.seen().joins >= joins + 4);  // heartbeats every 50 ms
  CHECK(r.Converges(2));  // the next resync is applied (then the held one, stale, is not)
  const std::optional<absl::Status> held = r.coordinator.HeldSyncDelivered();
  REQUIRE(held.has_value());
  CHECK(held->ok());
  CHECK(r.Converges(2));
}

}  // namespace
}  // namespace refit
