// A round's version is recorded in the state file before any node is told to COMMIT it: a
// round whose version cannot be recorded aborts before COMMIT, naming the state file, and its
// version is not spent; a version at the limit is refused before any node hears of it; a
// restart shows the highest version recorded and refuses it again.
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <limits>

#include "absl/strings/str_cat.h"
#include "daemon/coordinator/round_driver.h"
#include "daemon/testing/test_registrations.h"

namespace refit {
namespace {
using testing::JoinOf;
using testing::Registration;
using testing::SyncOf;

// Answers every call at once, and remembers the phases each round was sent.
class Peers : public PeerClient {
 public:
  std::function<absl::Status()> on_prepare;  // node 1's PREPARE ends as this says
  std::function<void()> on_transfer;         // runs at every TRANSFER call
  void RunPhase(int32_t node, const v1::PhaseRequest& request, absl::Duration, v1::PhaseResponse*,
                Done done) override {
    {
      absl::MutexLock lock(&mu_);
      sent_[request.round_id()].push_back(request.phase());
    }
    if (request.phase() == v1::PhaseRequest::TRANSFER && on_transfer) on_transfer();
    if (node == 1 && request.phase() == v1::PhaseRequest::PREPARE && on_prepare) {
      done(on_prepare());
      return;
    }
    done(absl::OkStatus());
  }
  void InstallPlan(int32_t, std::shared_ptr<const v1::InstallPlanRequest>, absl::Duration,
                   Done done) override {
    done(absl::OkStatus());
  }
  int Sent(int64_t round, v1::PhaseRequest::Phase phase) {
    absl::MutexLock lock(&mu_);
    int n = 0;
    for (v1::PhaseRequest::Phase p : sent_[round]) n += p == phase;
    return n;
  }
  int Calls() {
    absl::MutexLock lock(&mu_);
    int n = 0;
    for (const auto& [round, phases] : sent_) n += static_cast<int>(phases.size());
    return n;
  }

 private:
  absl::Mutex mu_;
  std::map<int64_t, std::vector<v1::PhaseRequest::Phase>> sent_ ABSL_GUARDED_BY(mu_);
};

// The real writer, failing every Replace while `fail` is set (a file system turned read-only).
class FlakyWriter : public StateFileWriter {
 public:
  explicit FlakyWriter(const std::atomic<bool>* fail) : fail_(fail), real_(AtomicFileWriter()) {}
  absl::Status Replace(const std::string& path, const std::string& text) override {
    if (*fail_)
      return absl::InternalError(
          absl::StrCat("cannot create ", path, ".tmp: Read-only file system"));
    return real_->Replace(path, text);
  }

 private:
  const std::atomic<bool>* const fail_;
  const std::unique_ptr<StateFileWriter> real_;
};

struct Coordinator {
  FakeClock clock;
  Membership membership{0, absl::Milliseconds(500), 4, &clock};
  GroupPlanner planner{GroupPlannerOptions{}, &membership};
  RoundLog log;
  Peers peers;
  std::unique_ptr<StateStore> state;
  std::unique_ptr<RoundDriver> driver;

  Coordinator(const std::string& state_file, const std::atomic<bool>* fail) {
    auto opened = StateStore::Open(state_file, std::make_unique<FlakyWriter>(fail));
    REQUIRE(opened.ok());
    state = *std::move(opened);
    membership.SetSelf("10.0.0.0:7070", "10.0.0.0:7071", 1);
    REQUIRE(membership.AddLocal(Registration("t0", v1::TRAINER, 0, 8, 0)).ok());
    membership.Join(JoinOf(1, 7));
    REQUIRE(membership.ApplySync(SyncOf(1, 7, {Registration("i0", v1::INFERENCE, 0, 8, 1)})).ok());
    RoundDriverOptions options;
    options.self = 0;
    options.peer_timeout = absl::Seconds(1);
    options.state = state.get();
    driver = std::make_unique<RoundDriver>(options, &membership, &planner, &peers, &log, &clock);
  }
  absl::Status Refit(int64_t version, v1::RoundStats* stats) {
    v1::RefitRequest r;
    r.set_group("policy");
    r.set_version(version);
    return driver->Refit(r, stats);
  }
};

std::string TempPath(const std::string& tag) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path =
      absl::StrCat(dir != nullptr ? dir : "/tmp", "/refitd-write-ahead-", tag, "-", getpid());
  unlink(path.c_str());
  return path;
}

TEST_CASE("write-ahead: a version the state file cannot hold aborts its round before COMMIT") {
  const std::string path = TempPath("abort");
  std::atomic<bool> fail{false};
  {
    Coordinator c(path, &fail);
    v1::RoundStats first;
    REQUIRE(c.Refit(1, &first).ok());
    CHECK(c.peers.Sent(first.round_id(), v1::PhaseRequest::COMMIT) == 2);

    // The file system turns read-only during the round (its id was reserved in the file).
    c.peers.on_transfer = [&] { fail = true; };
    v1::RoundStats lost;
    const absl::Status s = c.Refit(2, &lost);
    INFO(s.message());
    CHECK(s.code() == absl::StatusCode::kAborted);
    CHECK_THAT(std::string(s.message()), Catch::Contains(absl::StrCat("the state file ", path)));
    CHECK(lost.state() == v1::RoundStats::ABORTED);
    CHECK_THAT(lost.reason(), Catch::Contains(path));
    CHECK(c.peers.Sent(lost.round_id(), v1::PhaseRequest::TRANSFER) == 2);  // it got that far
    CHECK(c.peers.Sent(lost.round_id(), v1::PhaseRequest::COMMIT) == 0);    // nobody told to commit
    CHECK(c.peers.Sent(lost.round_id(), v1::PhaseRequest::ABORT) == 2);
    CHECK(c.driver->CommittedVersion("policy") == 1);
    CHECK(c.state->Committed("policy") == 1);

    // A round that fails before its commit point records nothing either.
    c.peers.on_transfer = nullptr;
    fail = false;
    c.peers.on_prepare = [] {
      return absl::AbortedError("node 1 (10.0.0.1:7070) failed PREPARE: boom");
    };
    v1::RoundStats refused;
    CHECK(c.Refit(2, &refused).code() == absl::StatusCode::kAborted);
    CHECK(c.state->Committed("policy") == 1);

    // Writable again: version 2 was never committed, so it is still free.
    c.peers.on_prepare = nullptr;
    v1::RoundStats second;
    REQUIRE(c.Refit(2, &second).ok());
    CHECK(c.peers.Sent(second.round_id(), v1::PhaseRequest::COMMIT) == 2);
  }
  // Restarted: the highest version recorded, and never accepted again.
  Coordinator again(path, &fail);
  CHECK(again.driver->CommittedVersion("policy") == 2);
  v1::RoundStats stats;
  CHECK(again.Refit(2, &stats).code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(again.Refit(3, &stats).ok());
  unlink(path.c_str());
}

TEST_CASE("write-ahead: a version at the limit is refused before any node hears of it") {
  std::atomic<bool> fail{false};
  Coordinator c("", &fail);
  for (int64_t version : {kVersionLimit, std::numeric_limits<int64_t>::max() - 1}) {
    v1::RoundStats stats;
    const absl::Status s = c.Refit(version, &stats);
    INFO(s.message());
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(s.message()), Catch::Contains("2^53 (9007199254740992)"));
  }
  CHECK(c.peers.Calls() == 0);
  CHECK(c.driver->CommittedVersion("policy") == 0);
  v1::RoundStats largest;
  REQUIRE(c.Refit(kVersionLimit - 1, &largest).ok());
  CHECK(c.driver->CommittedVersion("policy") == kVersionLimit - 1);
}

}  // namespace
}  // namespace refit
