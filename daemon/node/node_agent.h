// This node's part of every round: the plans the coordinator installed, the phases it runs here
// (PREPARE and COMMIT through this node's workers, TRANSFER through the backend, ABORT), and the
// end of this node's transfer when one of its workers is lost.
//
// Lock: `mu_` guards the installed plans, the resolved buffers and which round runs per group.
// It is never held across a call into the registry or the backend.
//
// The coordinator's lease. A round open here (from its PREPARE until its COMMIT is delivered or
// it aborts) lives only while the coordinator shows it is there: every phase call of the round
// and every answered heartbeat (RenewLeases) extend it by `lease` (--heartbeat x
// --heartbeats-missed, the verdict the coordinator applies to nodes). When it ends
// (ExpireLeases, called by the daemon every 100 ms on the injected clock) the node does what an
// ABORT from the coordinator does: the backend's transfer cancelled, ABORT to the group's
// workers, a wait for PREPARE ended. A round whose COMMIT is being delivered here is the
// coordinator's decision already taken: it is never aborted.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/base/clock.h"
#include "daemon/base/round_protocol.h"
#include "daemon/dataplane/backend.h"
#include "daemon/worker/worker_registry.h"
#include "plan/layout.h"
#include "plan/plan.h"
#include "plan/planner.h"
#include "proto/refit.pb.h"

namespace refit {

struct NodeAgentLease {
  const Clock* clock = Clock::Real();
  absl::Duration lease = absl::InfiniteDuration();  // infinite: none (the coordinator's own node)
  std::string coordinator;                          // its address, for the reasons
};

class NodeAgent {
 public:
  NodeAgent(int32_t node, WorkerRegistry* registry, DataBackend* backend,
            NodeAgentLease lease = {});

  // The coordinator answered a heartbeat: the lease of every open round it still runs
  // (`running`: group -> round id; null: every open round) runs on from now. A round it no longer
  // runs is not renewed: it ended there (its COMMIT or ABORT did not reach this node), and here it
  // ends with its lease.
  void RenewLeases(const std::map<std::string, int64_t>* running = nullptr);
  // Aborts every open round whose lease ended; returns how many.
  int ExpireLeases();
  // Aborts every open round (not one whose COMMIT is being delivered) because `why`: the
  // coordinator restarted or declared this node dead, so no round of its is going on here.
  int AbortOpenRounds(const std::string& why);

  // Installs the group's plan, replacing the previous one: the request's slice (this node's part,
  // made by the coordinator; its digest checked, its contents bounded), or, without one, a plan of
  // the request's layouts made here. The plan's digest is kept: a PREPARE naming another plan
  // is refused.
  absl::Status InstallPlan(const v1::InstallPlanRequest& request);
  absl::Status RunPhase(const v1::PhaseRequest& request, v1::PhaseResponse* response);
  // Draining (SIGTERM): PREPARE of a new round is refused from now on (UNAVAILABLE); waits up to
  // `deadline` for the rounds open here to end, then aborts those left (their workers told).
  // Returns how many it aborted.
  int Drain(absl::Duration deadline, const std::string& why);
  // A worker of `group` left: a transfer of its group running here cannot complete any more
  // (it fails naming that worker as its culprit). The last of the group's workers here gone,
  // with no round open, the node forgets the group (its plan, buffers, abort records).
  void WorkerLost(const std::string& group, const std::string& id, const std::string& reason);
  // Groups this node keeps anything of (plans, resolved buffers, abort records): for tests.
  size_t GroupsKept() const;

 private:
  struct InstalledPlan;
  struct Resolved;
  struct ActiveRound {
    int64_t round = -1, version = 0;
    absl::Time lease_until = absl::InfiniteFuture();
    bool committing = false;  // its COMMIT is being delivered: never aborted here
  };

  // What the coordinator's ABORT does: the transfer cancelled, the PREPARE wait ended, ABORT to
  // the group's workers. `only_if_open`: unless the round is no longer open here (raced).
  void Abort(const std::string& group, int64_t round, int64_t version, const std::string& reason,
             bool only_if_open);
  absl::Time LeaseFromNow() const;

  // The steps of RunPhase.
  // TRANSFER and COMMIT: ABORTED unless the round is still open here; its lease runs on from now.
  absl::Status RenewOpenRound(const v1::PhaseRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  // The plan installed for the request's group, epoch and digest.
  absl::StatusOr<std::shared_ptr<const InstalledPlan>> InstalledFor(
      const v1::PhaseRequest& request) const ABSL_LOCKS_EXCLUDED(mu_);
  // PREPARE: the round opened here, PREPARE to this node's workers and their answers awaited.
  absl::Status Prepare(const std::shared_ptr<const InstalledPlan>& installed,
                       const v1::PhaseRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  // Opens the round here, unless the node drains or the round was aborted already; returns the
  // group's aborted-round word, which ends the wait for PREPARE when the coordinator aborts it.
  absl::StatusOr<std::shared_ptr<std::atomic<int64_t>>> OpenRound(const v1::PhaseRequest& request,
                                                                  absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Hands the round's job to a backend that arms rounds while the workers prepare.
  void OfferToArm(const std::shared_ptr<const InstalledPlan>& installed,
                  const v1::PhaseRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  // COMMIT: to this node's workers, their answers awaited; the round is then closed here.
  absl::Status Commit(const std::shared_ptr<const InstalledPlan>& installed,
                      const v1::PhaseRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

  // The round's job on this node (its buffers found in the workers' registrations, cached while
  // the same workers stay registered); `workers` holds them (their mappings) while it is used.
  // Failures name the worker that left or the buffer it lacks.
  absl::StatusOr<TransferJob> JobFor(const std::string& group,
                                     const std::shared_ptr<const InstalledPlan>& installed,
                                     const v1::PhaseRequest& request,
                                     std::vector<std::shared_ptr<LocalWorker>>& workers);
  // JobFor's steps: the resolution kept from an earlier round when the plan and this node's
  // workers are the same; each buffer of `l` on this node (its worker held in `hold`); the plan's
  // scratch on this node, behind dst's spans.
  std::shared_ptr<const Resolved> CachedResolution(
      const std::string& group, const std::shared_ptr<const InstalledPlan>& installed,
      const std::vector<std::shared_ptr<LocalWorker>>& workers) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ResolveBuffers(const std::string& group, const Layout& l, BufferMemory& memory,
                              std::vector<std::shared_ptr<LocalWorker>>& hold) const;
  absl::Status AllocateScratch(const InstalledPlan& installed, BufferMemory& dst,
                               std::vector<std::unique_ptr<MappedBuffer>>& scratch);
  absl::Status Transfer(const std::string& group,
                        const std::shared_ptr<const InstalledPlan>& installed,
                        const v1::PhaseRequest& request, v1::PhaseResponse* response);
  // "group/name" of each worker the plan places on this node.
  std::vector<std::string> LocalIds(const std::string& group, const InstalledPlan& installed) const;
  // Drops what is kept of `group` when none of the workers its plan places here is registered
  // and no round of it is open here.
  void ForgetIfGone(const std::string& group);
  // The group's latest aborted round id, read without a lock by a wait for PREPARE.
  std::shared_ptr<std::atomic<int64_t>> AbortedRound(const std::string& group)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int32_t node_;
  WorkerRegistry* const registry_;
  DataBackend* const backend_;
  const NodeAgentLease lease_;

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const InstalledPlan>> installed_ ABSL_GUARDED_BY(mu_);
  // By group: the first worker whose loss cancelled a round's transfer here, and why.
  struct LostWorker {
    int64_t round = -1;
    std::string id;
    std::string reason;
  };
  std::map<std::string, LostWorker> lost_workers_ ABSL_GUARDED_BY(mu_);
  // The worker whose loss cancelled `round` of `group` here, if one did.
  std::optional<LostWorker> LostIn(const std::string& group, int64_t round) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The buffers of a group's last transfer, reused while the same local workers stay registered
  // (a model of 100k tensors would otherwise cost tens of milliseconds of lookups every round).
  std::map<std::string, std::shared_ptr<const Resolved>> resolved_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, ActiveRound> active_rounds_
      ABSL_GUARDED_BY(mu_);  // group -> round open here
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  struct EarlyAbort {
    int64_t round = -1;
    absl::Time at;
    std::string reason;
  };
  // group -> an ABORT that came before its round's PREPARE (refused when it arrives).
  std::map<std::string, EarlyAbort> early_aborts_ ABSL_GUARDED_BY(mu_);
  // group -> (round, why) of the latest round aborted here: its TRANSFER or COMMIT arriving late
  // (from a coordinator that was stopped) is refused, never delivered.
  std::map<std::string, std::pair<int64_t, std::string>> abort_reasons_ ABSL_GUARDED_BY(mu_);
  // group -> the latest round the coordinator aborted here: ends this node's wait for PREPARE of
  // that round at once (another node failed it).
  std::map<std::string, std::shared_ptr<std::atomic<int64_t>>> aborted_rounds_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
