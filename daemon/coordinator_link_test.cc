// A node's link to its coordinator, against an in-process coordinator (a real Membership behind
// a RefitPeer service) that drops or delays one message: a node declared dead rejoins with its
// workers whichever message of the rejoin (the heartbeat, its answer, the SyncWorkers, its
// answer) is lost or late, and a worker list that failed to reach the coordinator is sent again.
#include "daemon/coordinator_link.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/membership.h"
#include "daemon/test_registrations.h"

namespace refit {
namespace {
using testing::Registration;

enum class Call { kJoin, kSync };
enum class Fault {
  kNone,
  kDropRequest,  // never reaches the coordinator
  kDropAnswer,   // the coordinator acts on it; its answer is lost
  kLateAnswer,   // the coordinator acts on it; its answer comes after the caller's deadline
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

  // Declares `node` dead and arms `fault` for the next `call`, at once.
  void DeclareDeadThen(int32_t node, Call call, Fault fault) {
    absl::MutexLock lock(&mu_);
    REQUIRE(membership_->MarkDead(node, "declared dead by the test"));
    armed_ = {call, fault};
    fired_ = false;
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

  grpc::Status Join(grpc::ServerContext* ctx, const v1::JoinRequest* r,
                    v1::JoinResponse* out) override {
    Fault f;
    {
      absl::MutexLock lock(&mu_);
      f = Take(Call::kJoin);
      if (f == Fault::kDropRequest) return Dropped();
      out->set_resync(membership_->Join(*r));
      out->set_coordinator_node(0);
      out->set_coordinator_incarnation(1);
    }
    return Answer(ctx, f);
  }
  grpc::Status SyncWorkers(grpc::ServerContext* ctx, const v1::SyncWorkersRequest* r,
                           v1::SyncWorkersResponse* out) override {
    Fault f;
    grpc::Status applied;
    {
      absl::MutexLock lock(&mu_);
      f = Take(Call::kSync);
      if (f == Fault::kDropRequest) return Dropped();
      const absl::Status s = membership_->ApplySync(*r, out);
      applied =
          s.ok() ? grpc::Status::OK
                 : grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
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
};

// A coordinator (node 0) on a loopback port, and node 1's link to it.
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

  Rejoin() {
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
    o.heartbeat = absl::Milliseconds(50);
    o.peer_timeout = absl::Milliseconds(300);
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

}  // namespace
}  // namespace refit
