// RoundDriver against a fake PeerClient and clock: the plan installed once per membership, the
// phases in order on every node (peers before the coordinator's own node), the first failure
// aborting every node with the culprit's message as the reason, versions, and no thread left
// behind by 1,000 StartRefit rounds.
#include "daemon/coordinator/round_driver.h"

#include <dirent.h>

#include <catch2/catch.hpp>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/base/culprit.h"
#include "daemon/testing/test_registrations.h"

namespace refit {
namespace {
using testing::JoinOf;
using testing::Registration;
using testing::SyncOf;

// Answers every call at once, on the caller's thread (the hardest case for re-entrancy: a
// failure's ABORT fan-out starts from inside a callback).
class FakePeers : public PeerClient {
 public:
  struct Call {
    int32_t node;
    std::string what;  // INSTALL or the phase
    std::string reason;
    std::thread::id thread;  // that made the call
  };

  void RunPhase(int32_t node, const v1::PhaseRequest& request, absl::Duration,
                v1::PhaseResponse* response, Done done) override {
    const std::string what = request.phase() == v1::PhaseRequest::PREPARE    ? "PREPARE"
                             : request.phase() == v1::PhaseRequest::TRANSFER ? "TRANSFER"
                             : request.phase() == v1::PhaseRequest::COMMIT   ? "COMMIT"
                                                                             : "ABORT";
    absl::Status s;
    {
      absl::MutexLock lock(&mu_);
      calls_.push_back({node, what, request.reason(), std::this_thread::get_id()});
      if (node == fail_node_ && what == fail_phase_) {
        s = absl::UnavailableError(
            absl::StrCat("node ", node, " (10.0.0.", node, ":7070) failed ", what, ": boom"));
        // As a node's registry names a worker, or the transport names the node it lost.
        s = WithCulprit(s, fail_as_node_ ? NodeCulprit(node, "10.0.0.1:7070", what)
                                         : WorkerCulprit(node, "policy/i0", what));
      }
    }
    if (what == "TRANSFER") {
      response->set_bytes_received(100);
      response->set_bytes_nvlink(40);
      response->set_data_plane_ms(2.5 + node);
      response->set_started_after_request_ms(0.25);
      response->set_request_arrived_unix_us(absl::ToUnixMicros(absl::Now()));
    }
    done(s);
  }
  void InstallPlan(int32_t node, std::shared_ptr<const v1::InstallPlanRequest>, absl::Duration,
                   Done done) override {
    {
      absl::MutexLock lock(&mu_);
      calls_.push_back({node, "INSTALL", ""});
    }
    done(absl::OkStatus());
  }
  void FailAt(int32_t node, const std::string& phase, bool as_node = false) {
    absl::MutexLock lock(&mu_);
    fail_node_ = node;
    fail_phase_ = phase;
    fail_as_node_ = as_node;
  }
  std::vector<Call> Take() {
    absl::MutexLock lock(&mu_);
    return std::exchange(calls_, {});
  }

 private:
  absl::Mutex mu_;
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
  int32_t fail_node_ ABSL_GUARDED_BY(mu_) = -1;
  std::string fail_phase_ ABSL_GUARDED_BY(mu_);
  bool fail_as_node_ ABSL_GUARDED_BY(mu_) = false;
};

std::vector<std::string> Seq(const std::vector<FakePeers::Call>& calls) {
  std::vector<std::string> out;
  for (const auto& c : calls) out.push_back(absl::StrCat(c.what, "@", c.node));
  return out;
}

int Threads() {
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

// A coordinator (node 0, a trainer) and node 1 (an inference worker "i0"), or more inference
// nodes (worker "i<k>" on node k + 1); a phase's calls started from `fanout_threads` threads.
struct Fixture {
  FakeClock clock;
  Membership membership{0, absl::Milliseconds(500), 4, &clock};
  GroupPlanner planner{GroupPlannerOptions{}, &membership};
  RoundLog log;
  FakePeers peers;
  std::unique_ptr<RoundDriver> driver;

  explicit Fixture(int nodes = 2, int fanout_threads = 0,
                   absl::Duration peer_timeout = absl::Seconds(1)) {
    membership.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
    REQUIRE(membership.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
    for (int n = 1; n < nodes; ++n) {
      membership.Join(JoinOf(n, 7));
      REQUIRE(membership
                  .ApplySync(SyncOf(
                      n, 7, {Registration(absl::StrCat("i", n - 1), v1::INFERENCE, 0, 8, n)}))
                  .ok());
    }
    RoundDriverOptions options;
    options.self = 0;
    options.peer_timeout = peer_timeout;
    options.max_background_rounds = 2;
    options.fanout_threads = fanout_threads;
    driver = std::make_unique<RoundDriver>(options, &membership, &planner, &peers, &log, &clock);
  }
  absl::Status Refit(int64_t version, v1::RoundStats* stats = nullptr) {
    v1::RefitRequest r;
    r.set_group("policy");
    r.set_version(version);
    v1::RoundStats ignored;
    return driver->Refit(r, stats != nullptr ? stats : &ignored);
  }
};

TEST_CASE("round driver: install once per membership, then PREPARE, TRANSFER, COMMIT in order") {
  Fixture f;
  v1::RoundStats stats;
  REQUIRE(f.Refit(1, &stats).ok());
  CHECK(Seq(f.peers.Take()) == std::vector<std::string>{"INSTALL@1", "INSTALL@0", "PREPARE@1",
                                                        "PREPARE@0", "TRANSFER@1", "TRANSFER@0",
                                                        "COMMIT@1", "COMMIT@0"});
  CHECK(stats.state() == v1::RoundStats::COMMITTED);
  CHECK(stats.bytes() == 200);
  // Each node's TRANSFER as it reported it, with when the coordinator called it.
  REQUIRE(stats.nodes_size() == 2);
  for (const v1::NodeTransfer& n : stats.nodes()) {
    CHECK(n.bytes_received() == 100);
    CHECK(n.bytes_nvlink() == 40);
    CHECK(n.data_plane_ms() == 2.5 + n.node());
    CHECK(n.started_after_request_ms() == 0.25);
    CHECK(n.request_sent_unix_us() > 0);
    CHECK(n.request_arrived_unix_us() >= n.request_sent_unix_us());
  }
  CHECK(stats.nodes(0).node() == 0);
  CHECK(stats.nodes(1).node() == 1);
  CHECK(f.driver->CommittedVersion("policy") == 1);
  CHECK(stats.unconfirmed_replicas().empty());
  CHECK(f.membership.ReplicaVersions("policy") == std::map<std::string, int64_t>{{"i0", 1}});
  // Same membership: no install.
  REQUIRE(f.Refit(2).ok());
  CHECK(Seq(f.peers.Take()) == std::vector<std::string>{"PREPARE@1", "PREPARE@0", "TRANSFER@1",
                                                        "TRANSFER@0", "COMMIT@1", "COMMIT@0"});
  // Stale, repeated and non-positive versions; an unknown group.
  CHECK(f.Refit(2).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(f.Refit(0).code() == absl::StatusCode::kInvalidArgument);
  v1::RefitRequest unknown;
  unknown.set_group("nope");
  unknown.set_version(3);
  v1::RoundStats ignored;
  CHECK(f.driver->Refit(unknown, &ignored).code() == absl::StatusCode::kNotFound);
  CHECK(f.peers.Take().empty());
}

// The coordinator and 39 inference nodes. Their peer timeout, far longer than a round here, also
// bounds the wait for the starters: a share that never reports started would show as a round this
// long.
constexpr int kManyNodes = 40;
constexpr absl::Duration kManyNodesPeerTimeout = absl::Seconds(20);

// A phase's calls to 39 peers start from one thread, or from several at once when the driver has
// them (each a share); every node is called once a phase, and the coordinator's own node after
// every peer's call started, either way, without waiting out the starters' deadline.
TEST_CASE("round driver: a phase's calls to many nodes start on several threads, its own last") {
  for (int threads : {1, 4}) {
    CAPTURE(threads);
    Fixture f(kManyNodes, threads, kManyNodesPeerTimeout);
    v1::RoundStats stats;
    const absl::Time t0 = absl::Now();
    REQUIRE(f.Refit(1, &stats).ok());
    CHECK(absl::Now() - t0 < absl::Seconds(5));
    CHECK(stats.state() == v1::RoundStats::COMMITTED);
    CHECK(stats.nodes_size() == kManyNodes);
    const std::vector<FakePeers::Call> calls = f.peers.Take();
    for (const std::string phase : {"PREPARE", "TRANSFER", "COMMIT"}) {
      CAPTURE(phase);
      std::vector<int32_t> order;
      std::set<std::thread::id> peer_threads;
      for (const FakePeers::Call& c : calls) {
        if (c.what != phase) continue;
        order.push_back(c.node);
        if (c.node != 0) peer_threads.insert(c.thread);
      }
      REQUIRE(order.size() == kManyNodes);
      CHECK(std::set<int32_t>(order.begin(), order.end()).size() == kManyNodes);
      CHECK(order.back() == 0);
      if (threads == 1) {
        CHECK(peer_threads.size() == 1);
      } else {
        CHECK(peer_threads.size() >= 2);
      }
    }
  }
}

// A failure in one share of the calls (a starter's thread, not the round's) aborts the round on
// every node, naming the culprit, as a failure on the round's thread does.
TEST_CASE("round driver: a failure among calls started by another thread aborts every node") {
  Fixture f(kManyNodes, 4, kManyNodesPeerTimeout);
  f.peers.FailAt(33, "TRANSFER", /*as_node=*/true);  // in the last share
  v1::RoundStats stats;
  const absl::Status s = f.Refit(1, &stats);
  const std::string culprit = "node 33 (10.0.0.33:7070) failed TRANSFER: boom";
  CHECK(s.code() == absl::StatusCode::kAborted);
  CHECK(std::string(s.message()) == "round 1 of group \"policy\" aborted: " + culprit);
  CHECK(stats.state() == v1::RoundStats::ABORTED);
  CHECK(stats.reason() == culprit);
  CHECK(stats.culprit().kind() == v1::Culprit::NODE);
  CHECK(stats.culprit().node() == 33);
  std::set<int32_t> aborted;
  for (const FakePeers::Call& c : f.peers.Take()) {
    CHECK(c.what != "COMMIT");
    if (c.what == "ABORT") {
      CHECK(c.reason == culprit);
      aborted.insert(c.node);
    }
  }
  CHECK(aborted.size() == kManyNodes);
  CHECK(f.driver->CommittedVersion("policy") == 0);
}

TEST_CASE(
    "round driver: the first failure aborts every node, the culprit's message is the reason") {
  Fixture f;
  const std::string culprit = "node 1 (10.0.0.1:7070) failed TRANSFER: boom";
  SECTION("in TRANSFER") {
    f.peers.FailAt(1, "TRANSFER");
    v1::RoundStats stats;
    const absl::Status s = f.Refit(1, &stats);
    CHECK(s.code() == absl::StatusCode::kAborted);
    CHECK(std::string(s.message()) == "round 1 of group \"policy\" aborted: " + culprit);
    CHECK(stats.state() == v1::RoundStats::ABORTED);
    CHECK(stats.reason() == culprit);
    // The culprit travels structured, in the returned status and in the round's statistics.
    REQUIRE(CulpritOf(s).has_value());
    CHECK(CulpritOf(s)->kind() == v1::Culprit::WORKER);
    CHECK(CulpritOf(s)->worker_id() == "policy/i0");
    CHECK(CulpritOf(s)->phase() == "TRANSFER");
    CHECK(stats.culprit().kind() == v1::Culprit::WORKER);
    CHECK(stats.culprit().node() == 1);
    const auto calls = f.peers.Take();
    std::set<int32_t> aborted;
    for (const auto& c : calls) {
      CHECK(c.what != "COMMIT");
      if (c.what == "ABORT") {
        CHECK(c.reason == culprit);
        aborted.insert(c.node);
      }
    }
    CHECK(aborted == std::set<int32_t>{0, 1});
    CHECK(f.driver->CommittedVersion("policy") == 0);
    // The next round installs again (an aborted communicator is gone) and commits.
    f.peers.FailAt(-1, "");
    REQUIRE(f.Refit(1).ok());
    CHECK(Seq(f.peers.Take()).front() == "INSTALL@1");
  }
  SECTION("in PREPARE, on the coordinator's own node") {
    f.peers.FailAt(0, "PREPARE");
    const absl::Status s = f.Refit(1);
    CHECK(std::string(s.message()).find("node 0 (10.0.0.0:7070) failed PREPARE: boom") !=
          std::string::npos);
    const auto calls = f.peers.Take();
    int aborts = 0;
    for (const auto& c : calls) {
      CHECK(c.what != "TRANSFER");
      aborts += c.what == "ABORT";
    }
    CHECK(aborts == 2);  // once per node, however many failures
  }
  SECTION("in COMMIT: the round is committed all the same, and no ABORT follows a COMMIT") {
    // docs/ROUNDS.md, "Replicas and commit": once every TRANSFER succeeded the round is
    // committed; a node that fails its COMMIT is noted, never sent ABORT.
    f.peers.FailAt(1, "COMMIT");
    v1::RoundStats stats;
    REQUIRE(f.Refit(1, &stats).ok());
    CHECK(stats.state() == v1::RoundStats::COMMITTED);
    CHECK(stats.commit_note() == "node 1 (10.0.0.1:7070) failed COMMIT: boom");
    const auto seq = Seq(f.peers.Take());
    CHECK(std::count(seq.begin(), seq.end(), "COMMIT@0") == 1);
    CHECK(std::count(seq.begin(), seq.end(), "COMMIT@1") == 1);
    CHECK(std::count(seq.begin(), seq.end(), "ABORT@0") == 0);
    CHECK(std::count(seq.begin(), seq.end(), "ABORT@1") == 0);
    CHECK(f.driver->CommittedVersion("policy") == 1);
    // The replica ("i0", its own, on node 1) was refit but not confirmed: it holds no version as
    // far as anyone knows, and says so, until a round refits it whole.
    CHECK(f.membership.ReplicaVersions("policy") == std::map<std::string, int64_t>{{"i0", 0}});
    CHECK(std::vector<std::string>(stats.replicas().begin(), stats.replicas().end()) ==
          std::vector<std::string>{"i0"});
    CHECK(std::vector<std::string>(stats.unconfirmed_replicas().begin(),
                                   stats.unconfirmed_replicas().end()) ==
          std::vector<std::string>{"i0"});
    f.peers.FailAt(-1, "");
    v1::RoundStats next;
    REQUIRE(f.Refit(2, &next).ok());
    CHECK(next.unconfirmed_replicas().empty());
    CHECK(f.membership.ReplicaVersions("policy") == std::map<std::string, int64_t>{{"i0", 2}});
  }
  SECTION("in COMMIT, a node cut off: none of its replicas holds the version") {
    f.peers.FailAt(1, "COMMIT", /*as_node=*/true);
    v1::RoundStats stats;
    REQUIRE(f.Refit(1, &stats).ok());
    CHECK(stats.state() == v1::RoundStats::COMMITTED);
    CHECK(std::vector<std::string>(stats.unconfirmed_replicas().begin(),
                                   stats.unconfirmed_replicas().end()) ==
          std::vector<std::string>{"i0"});
    CHECK(f.membership.ReplicaVersions("policy") == std::map<std::string, int64_t>{{"i0", 0}});
  }
  SECTION("after a committed version: the replica its engines dropped holds no version") {
    // PREPARE stops the engines and an ABORT leaves them at no version: status must not keep
    // showing the version committed before.
    REQUIRE(f.Refit(1).ok());
    REQUIRE(f.membership.ReplicaVersions("policy") == std::map<std::string, int64_t>{{"i0", 1}});
    f.peers.Take();
    f.peers.FailAt(1, "TRANSFER");
    CHECK(f.Refit(2).code() == absl::StatusCode::kAborted);
    CHECK(f.membership.ReplicaVersions("policy") == std::map<std::string, int64_t>{{"i0", 0}});
    CHECK(f.driver->CommittedVersion("policy") == 1);
    f.peers.FailAt(-1, "");
    REQUIRE(f.Refit(2).ok());
    CHECK(f.membership.ReplicaVersions("policy") == std::map<std::string, int64_t>{{"i0", 2}});
  }
}

TEST_CASE("round driver: 1,000 StartRefit rounds leave no thread behind") {
  Fixture f;
  v1::RefitRequest r;
  r.set_group("policy");
  r.set_version(1);
  REQUIRE(f.driver->StartRefit(r).ok());
  while (f.driver->CommittedVersion("policy") < 1)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  const int threads = Threads();
  for (int64_t v = 2; v <= 1000; ++v) {
    r.set_version(v);
    absl::StatusOr<int64_t> id;
    // One round per group at a time: a start while the previous one finishes is ABORTED.
    while (!(id = f.driver->StartRefit(r)).ok()) {
      REQUIRE(id.status().code() == absl::StatusCode::kAborted);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    CHECK(*id == v);
  }
  while (f.driver->CommittedVersion("policy") < 1000)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  CHECK(Threads() <= threads + 1);  // the executor may have started its second thread
  f.driver->Stop();
  // A thread that just exited may still be listed for a moment under load: wait a little.
  for (int i = 0; i < 100 && Threads() >= threads; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(Threads() < threads);
  f.peers.Take();
}

// Each node is sent its own slice of the plan; the install's deadline follows the slice's bytes,
// and a node that overruns it is named.
class SlowInstallPeers : public FakePeers {
 public:
  explicit SlowInstallPeers(absl::Duration delay) : delay_(delay) {}
  ~SlowInstallPeers() override {
    for (std::thread& t : threads_) t.join();
  }
  void InstallPlan(int32_t node, std::shared_ptr<const v1::InstallPlanRequest> request,
                   absl::Duration timeout, Done done) override {
    absl::MutexLock lock(&mu_);
    requests_[node] = request;
    if (node == 0)
      return FakePeers::InstallPlan(node, std::move(request), timeout, std::move(done));
    timeouts_.push_back(timeout);
    threads_.emplace_back([this, node, request, timeout, done = std::move(done)] {
      absl::SleepFor(delay_);
      FakePeers::InstallPlan(node, request, timeout, done);
    });
  }
  std::vector<absl::Duration> Timeouts() {
    absl::MutexLock lock(&mu_);
    return timeouts_;
  }
  std::shared_ptr<const v1::InstallPlanRequest> Request(int32_t node) {
    absl::MutexLock lock(&mu_);
    return requests_[node];
  }

 private:
  const absl::Duration delay_;
  absl::Mutex mu_;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Duration> timeouts_
      ABSL_GUARDED_BY(mu_);  // the remote installs' call deadlines
  std::map<int32_t, std::shared_ptr<const v1::InstallPlanRequest>> requests_ ABSL_GUARDED_BY(mu_);
};

struct SlicedGroup {
  FakeClock clock;
  Membership membership{0, absl::Milliseconds(500), 4, &clock};
  GroupPlanner planner{{}, &membership};
  RoundLog log;
  SlicedGroup() {
    membership.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
    REQUIRE(membership.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
    membership.Join(JoinOf(1, 7));
    REQUIRE(membership.ApplySync(SyncOf(1, 7, {Registration("i0", v1::INFERENCE, 0, 8, 1)})).ok());
  }
  absl::Status Refit(SlowInstallPeers& peers) {
    RoundDriverOptions options;
    options.self = 0;
    options.peer_timeout = absl::Milliseconds(100);
    RoundDriver driver(options, &membership, &planner, &peers, &log, &clock);
    v1::RefitRequest r;
    r.set_group("policy");
    r.set_version(1);
    v1::RoundStats stats;
    return driver.Refit(r, &stats);
  }
};

TEST_CASE(
    "round driver: each node is sent its slice and the plan's digest, with a deadline for its "
    "bytes") {
  SlicedGroup g;
  SlowInstallPeers peers(absl::Milliseconds(50));
  const absl::Status s = g.Refit(peers);
  INFO(s.message());
  REQUIRE(s.ok());
  const std::string digest = g.planner.Get("policy")->digest;
  REQUIRE(digest.size() == 32);
  for (int32_t node : {0, 1}) {
    auto request = peers.Request(node);
    REQUIRE(request != nullptr);
    CHECK(request->plan_digest() == digest);
    CHECK(!request->slice().empty());
    CHECK(request->source().workers_size() == 0);  // the layouts themselves are not sent
    v1::PlanSlice slice;
    REQUIRE(slice.ParseFromString(request->slice()));
    CHECK(slice.node() == node);
  }
  const std::vector<absl::Duration> timeouts = peers.Timeouts();
  REQUIRE(timeouts.size() == 1);
  const int64_t bytes = static_cast<int64_t>(peers.Request(1)->slice().size());
  CHECK(timeouts[0] >= absl::Milliseconds(400) + absl::Nanoseconds(100) * bytes);
}

TEST_CASE("round driver: a node that overruns its install's deadline is named") {
  SlicedGroup g;
  SlowInstallPeers peers(absl::Seconds(3));  // past 4 x 100 ms + the slice's allowance + 1 s
  const absl::Status s = g.Refit(peers);
  INFO(s.message());
  CHECK(s.code() == absl::StatusCode::kAborted);
  CHECK(s.message().find("node 1 did not answer InstallPlan") != std::string::npos);
  auto culprit = CulpritOf(s);
  REQUIRE(culprit.has_value());
  CHECK(culprit->node() == 1);
}

}  // namespace
}  // namespace refit
