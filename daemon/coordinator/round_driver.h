// The coordinator's rounds: begin (checks, the group reserved, a round id), install the plan
// where the membership changed, PREPARE, TRANSFER, COMMIT on every node of the group, or ABORT
// on all of them at the first failure, whose message (naming the culprit) becomes the round's
// reason; then finish (the committed version, WatchRounds told). Nodes are reached only through
// a PeerClient; calls go out asynchronously, so a phase costs no thread per node, and rounds
// started by StartRefit run on one bounded executor (no thread per round), joined at Stop().
//
// Round ids and committed versions come from a StateStore (persisted with --state-file): an id
// is reserved before it is used, a version recorded at the commit point, before any node is
// told to COMMIT it (a round whose version cannot be recorded aborts), so neither goes back
// when the coordinator restarts. Versions are bounded: from kVersionLimit (2^53) on,
// INVALID_ARGUMENT.
//
// Lock: `mu_` guards the per-group round state (busy, committed version, installed epochs). It
// is never held across a call into the planner, the membership, the peer client, the state store
// or the round log.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/base/clock.h"
#include "daemon/base/executor.h"
#include "daemon/base/pause_detector.h"
#include "daemon/coordinator/group_planner.h"
#include "daemon/coordinator/membership.h"
#include "daemon/coordinator/peer_client.h"
#include "daemon/coordinator/round_log.h"
#include "daemon/coordinator/state_store.h"
#include "proto/refit.pb.h"

namespace refit {

struct RoundDriverOptions {
  int32_t self = 0;  // the coordinator's node: its own part runs last, after the peers' started
  absl::Duration prepare_timeout = absl::Seconds(10);
  absl::Duration transfer_timeout = absl::Seconds(60);
  absl::Duration commit_timeout = absl::Seconds(10);
  absl::Duration peer_timeout = absl::Seconds(5);
  // Shipped with every plan (InstallPlanRequest).
  int64_t max_message_bytes = 16 << 20;
  int64_t step_bytes = int64_t{128} << 20;
  bool routing = true;
  int32_t max_relay_depth = 0;
  int64_t zero_copy_min_bytes = 0;
  bool nccl_register = false;
  int max_background_rounds = 16;  // StartRefit rounds running at once; more wait their turn
  // Threads that start a phase's calls (0: a quarter of the machine's cores, 1 to 4). A call's
  // start is gRPC's write on the starting thread, about 65 us: one thread reaches 64 nodes in
  // 4 ms, each phase. Phases with 16 peers or more are split among them.
  int fanout_threads = 0;
  // A fresh communicator id per installation (the backend's; empty: none needed).
  std::function<absl::StatusOr<std::string>()> new_communicator_id;
  // Round ids and committed versions that survive a restart (--state-file); null: in memory.
  StateStore* state = nullptr;
  // The coordinator's own pauses (SIGSTOP, starvation; null: not watched). A round that fails
  // after the coordinator did not run for `blame_pause` or more names the coordinator: what its
  // peers and workers did meanwhile (leases ended, sessions lost) was its own doing.
  PauseDetector* pause = nullptr;
  absl::Duration blame_pause = absl::Seconds(1);
};

// The largest version a refit may ask for (state_store.h says why).
inline constexpr int64_t kMaxVersion = kVersionLimit - 1;

class RoundDriver {
 public:
  RoundDriver(RoundDriverOptions options, Membership* membership, GroupPlanner* planner,
              PeerClient* peers, RoundLog* log, const Clock* clock);
  ~RoundDriver();  // Stop()

  // Runs a round to its end.
  absl::Status Refit(const v1::RefitRequest& request, v1::RoundStats* stats);
  // Checks the request (a stale version is refused now), then runs the round in the background;
  // its outcome goes to the round log.
  absl::StatusOr<int64_t> StartRefit(const v1::RefitRequest& request);
  int64_t CommittedVersion(const std::string& group) const;
  // The rounds running now (group -> round id), as a heartbeat's answer tells the nodes.
  std::map<std::string, int64_t> RunningRounds() const;
  // The group was forgotten (Membership::OnGroupForgotten): what the driver kept for it goes, but
  // its committed version (versions never go back).
  void ForgetGroup(const std::string& group);
  // Waits for the background rounds (they end by their deadlines); StartRefit refuses afterwards.
  void Stop();
  // Draining (SIGTERM): no round begins from now on (UNAVAILABLE, "draining"); waits up to
  // `deadline` for the rounds running to end (each ends by its phase deadlines anyway). True
  // when none is left running.
  bool Drain(absl::Duration deadline);

 private:
  struct GroupRounds {
    int64_t version = 0;  // last committed
    bool busy = false;
    int64_t round_id = 0;                        // the running round's, once reserved (0: none)
    std::map<int32_t, int64_t> installed_epoch;  // per node
  };
  class FanOut;
  class Aborter;
  class Round;

  absl::StatusOr<int64_t> BeginRound(const v1::RefitRequest& request);
  absl::Status FinishRound(const v1::RefitRequest& request, int64_t round_id,
                           v1::RoundStats* stats);
  absl::Status RunRound(const std::string& group, int64_t round_id, int64_t version,
                        v1::RoundStats* stats);
  absl::Status CheckVersion(const std::string& group, int64_t version) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `failure`, or the coordinator named as its culprit when it did not run meanwhile.
  absl::Status BlamePause(const std::string& group, int64_t round_id, absl::Time start,
                          const absl::Status& failure) const;
  // Remote nodes first, this node last: the peers' requests are on their way before this node's
  // own part starts (in a transfer, whoever starts first waits for the rest).
  std::vector<int32_t> Order(const std::vector<int32_t>& nodes) const;

  const RoundDriverOptions options_;
  Membership* const membership_;  // read, and told what each round committed (RecordCommit)
  GroupPlanner* const planner_;
  PeerClient* const peers_;
  RoundLog* const log_;
  const Clock* const clock_;
  Executor background_;
  const int fanout_threads_;  // fanout_threads, resolved
  Executor starters_;         // fanout_threads_ - 1 threads: the round's thread is the first

  std::unique_ptr<StateStore> own_state_;  // when options_.state is null
  StateStore* const state_;                // round ids and versions (its own lock)

  mutable absl::Mutex mu_;
  std::map<std::string, GroupRounds> groups_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace refit
