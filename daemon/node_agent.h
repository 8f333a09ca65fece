// This node's part of every round: the plans the coordinator installed, the phases it runs here
// (PREPARE and COMMIT through this node's workers, TRANSFER through the backend, ABORT), and the
// end of this node's transfer when one of its workers is lost.
//
// Lock: `mu_` guards the installed plans, the resolved buffers and which round runs per group.
// It is never held across a call into the registry or the backend.
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
#include "daemon/backend.h"
#include "daemon/worker_registry.h"
#include "plan/layout.h"
#include "plan/plan.h"
#include "plan/planner.h"
#include "proto/refit.pb.h"

namespace refit {

// The planner options every daemon derives from an InstallPlan request: identical everywhere,
// so every daemon computes the identical plan.
PlanOptions PlanOptionsFor(const v1::InstallPlanRequest& request);
const char* PhaseName(v1::PhaseRequest::Phase p);

class NodeAgent {
 public:
  NodeAgent(int32_t node, WorkerRegistry* registry, DataBackend* backend);

  // Plans the request's layouts (or takes `planned`, the coordinator's own plan of the same
  // request) and installs it for the group, replacing the previous one.
  absl::Status InstallPlan(const v1::InstallPlanRequest& request, std::shared_ptr<const Plan> planned = nullptr);
  absl::Status RunPhase(const v1::PhaseRequest& request, v1::PhaseResponse* response);
  // A worker of `group` left: a transfer of its group running here cannot complete any more.
  void WorkerLost(const std::string& group, const std::string& id, const std::string& reason);

 private:
  struct InstalledPlan;
  struct Resolved;

  absl::Status Transfer(const std::string& group, const std::shared_ptr<const InstalledPlan>& installed,
                        const v1::PhaseRequest& request, v1::PhaseResponse* response);
  // The group's latest aborted round id, read without a lock by a wait for PREPARE.
  std::shared_ptr<std::atomic<int64_t>> AbortedRound(const std::string& group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int32_t node_;
  WorkerRegistry* const registry_;
  DataBackend* const backend_;

  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const InstalledPlan>> installed_ ABSL_GUARDED_BY(mu_);
  // The buffers of a group's last transfer, reused while the same local workers stay registered
  // (a model of 100k tensors would otherwise cost tens of milliseconds of lookups every round).
  std::map<std::string, std::shared_ptr<const Resolved>> resolved_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> active_rounds_ ABSL_GUARDED_BY(mu_);  // group -> round running here
  // group -> the latest round the coordinator aborted here: ends this node's wait for PREPARE of
  // that round at once (another node failed it).
  std::map<std::string, std::shared_ptr<std::atomic<int64_t>>> aborted_rounds_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
