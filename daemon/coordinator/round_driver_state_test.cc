// RoundDriver's round ids and versions across a coordinator restart (a StateStore file), the
// version bound, and a round that fails while the coordinator itself was stopped naming the
// coordinator, not the innocent node whose lease on it ran out.
#include <unistd.h>

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

// Answers every call at once; `on_prepare` runs on node 1's PREPARE and says how it ends.
class Peers : public PeerClient {
 public:
  std::function<absl::Status()> on_prepare;
  void RunPhase(int32_t node, const v1::PhaseRequest& request, absl::Duration, v1::PhaseResponse*,
                Done done) override {
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
};

struct Coordinator {
  FakeClock clock;
  Membership membership{0, absl::Milliseconds(500), 4, &clock};
  GroupPlanner planner{GroupPlannerOptions{}, &membership};
  RoundLog log;
  Peers peers;
  PauseDetector pause{&clock, absl::Milliseconds(500)};
  std::unique_ptr<StateStore> state;
  std::unique_ptr<RoundDriver> driver;

  explicit Coordinator(const std::string& state_file) {
    auto opened = StateStore::Open(state_file);
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
    options.pause = &pause;
    options.blame_pause = absl::Seconds(2);
    driver = std::make_unique<RoundDriver>(options, &membership, &planner, &peers, &log, &clock);
  }
  absl::StatusOr<v1::RoundStats> Refit(int64_t version) {
    v1::RefitRequest r;
    r.set_group("policy");
    r.set_version(version);
    v1::RoundStats stats;
    absl::Status s = driver->Refit(r, &stats);
    if (!s.ok()) return s;
    return stats;
  }
};

std::string TempPath(const std::string& tag) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path =
      absl::StrCat(dir != nullptr ? dir : "/tmp", "/refitd-driver-", tag, "-", getpid());
  unlink(path.c_str());
  return path;
}

TEST_CASE("round driver: versions and round ids never go back across a restart") {
  const std::string path = TempPath("restart");
  int64_t last_id = 0;
  {
    Coordinator c(path);
    REQUIRE(c.Refit(5).ok());
    auto r = c.Refit(9);
    REQUIRE(r.ok());
    last_id = r->round_id();
  }
  Coordinator again(path);  // restarted with the same state file
  CHECK(again.driver->CommittedVersion("policy") == 9);
  for (int64_t stale : {1, 5, 9})
    CHECK(again.Refit(stale).status().code() == absl::StatusCode::kFailedPrecondition);
  auto r = again.Refit(10);
  REQUIRE(r.ok());
  CHECK(r->round_id() > last_id);
  unlink(path.c_str());
}

TEST_CASE("round driver: a version that would leave no next one is refused, naming the bound") {
  Coordinator c("");
  const auto refused = c.Refit(std::numeric_limits<int64_t>::max());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(refused.status().message().find(absl::StrCat(kMaxVersion)) != std::string::npos);
  REQUIRE(c.Refit(kMaxVersion).ok());
  CHECK(c.driver->CommittedVersion("policy") == kMaxVersion);
}

TEST_CASE("round driver: a round failing while the coordinator was stopped names the coordinator") {
  Coordinator c("");
  c.pause.Tick();
  // Frozen 5 s inside PREPARE: node 1's lease on the round ended meanwhile, and it says so.
  c.peers.on_prepare = [&] {
    c.clock.Advance(absl::Seconds(5));
    return absl::AbortedError(
        "node 1 (10.0.0.1:7070) failed PREPARE: the coordinator was lost: its lease ended");
  };
  auto r = c.Refit(1);
  CHECK(r.status().code() == absl::StatusCode::kAborted);
  INFO(r.status().message());
  CHECK(r.status().message().find("node 0 (the coordinator) did not run for 5s") !=
        std::string::npos);
  CHECK(r.status().message().find("node 1") == std::string::npos);
  // A failure with no pause of the coordinator keeps its culprit.
  c.peers.on_prepare = [] {
    return absl::AbortedError("node 1 (10.0.0.1:7070) failed PREPARE: boom");
  };
  c.clock.Advance(absl::Seconds(10));  // well after the pause: not during this round
  c.pause.Tick();                      // (a gap: a pause, before the round starts)
  c.clock.Advance(absl::Milliseconds(100));
  c.pause.Tick();
  auto later = c.Refit(1);
  CHECK(later.status().message().find("node 1 (10.0.0.1:7070) failed PREPARE: boom") !=
        std::string::npos);
}

}  // namespace
}  // namespace refit
