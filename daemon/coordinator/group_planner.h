// Plans each model group once per membership epoch, outside any lock, and caches the result:
// rounds, Status and GetPlan all read the cached plan of the current epoch. Two callers asking
// for the same epoch at once share one planning; a caller's own locks are never held here (the
// planner takes the membership's snapshot, then plans with no lock at all).
//
// Lock: `mu_` guards the cache and which epoch is being planned per group; it is released while
// planning.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/coordinator/membership.h"
#include "plan/layout.h"
#include "plan/plan.h"
#include "plan/planner.h"
#include "proto/refit.pb.h"

namespace refit {

// A group's plan at one membership epoch, or why there is none.
struct GroupPlan {
  int64_t epoch = -1;
  absl::Status status;  // FAILED_PRECONDITION with the reason when not ready
  // Both layouts in compact form (CompactLayoutToProto: replicas described once, runs of pieces),
  // which LayoutFromProto expands to the very layouts planned here: what the plan's digest is
  // computed from. Compacted once per epoch.
  v1::Layout src, dst;
  std::shared_ptr<const Plan> plan;  // set when status is OK
  // What determines the plan (PlanInputsDigest: both compact layouts and the options): its
  // identity on every node, and the key of the plans kept for a membership that comes back.
  std::string digest;
  // The layouts' workers and buffers (no tensors, no pieces): what each node's slice names.
  std::shared_ptr<const Layout> src_layout, dst_layout;
  bool reused = false;  // the plan of an earlier epoch with the same digest: not planned again
  // Decoding, validating and planning here (wall time).
  absl::Duration planning_time = absl::ZeroDuration();
  std::vector<int32_t> nodes;       // nodes with workers in the plan
  int trainers = 0, inference = 0;  // registered
  // The inference side by replica (versions as of the epoch; Membership has the live ones). Only
  // complete replicas are planned: `planned` names them, `incomplete` the rest.
  std::vector<ReplicaView> replicas;
  std::vector<std::string> planned, incomplete;
  // The trainer side by declared rank (RegisterWorkerRequest.trainer_rank), as of the epoch.
  TrainerRanksView trainer_ranks;
};

struct GroupPlannerOptions {
  int64_t max_message_bytes = 16 << 20;
  bool routing = true;
  int32_t max_relay_depth = 0;
  // The planner (tests replace it).
  std::function<absl::StatusOr<Plan>(const Layout& src, const Layout& dst,
                                     const PlanOptions& options)>
      make_plan;
};

class GroupPlanner {
 public:
  GroupPlanner(GroupPlannerOptions options, const Membership* membership);

  // The plan of the group's current epoch (planned now if not yet). Never null.
  std::shared_ptr<const GroupPlan> Get(const std::string& group);
  // How many plannings ran (tests: one per epoch), and how many of them reused a kept plan.
  int64_t plannings() const;
  int64_t reused() const;
  // The group was forgotten (Membership::OnGroupForgotten): its cached plan goes.
  void Forget(const std::string& group);

 private:
  std::shared_ptr<const GroupPlan> Compute(const std::string& group,
                                           const GroupMembers& members) const;
  // The steps of Compute once both sides have workers: `g`'s layouts compacted, its digest, and
  // its plan, a kept one where the digest matches, else made here (and kept).
  absl::Status PlanLayouts(const std::string& group, GroupPlan& g) const ABSL_LOCKS_EXCLUDED(mu_);
  // The kept plan of `g`'s digest, if any, into `g` (the most recently used kept last).
  bool ReuseKept(GroupPlan& g) const ABSL_LOCKS_EXCLUDED(mu_);
  // `g`'s plan among the kept ones, the oldest dropped beyond kPlansKept.
  void Keep(const GroupPlan& g) const ABSL_LOCKS_EXCLUDED(mu_);

  const GroupPlannerOptions options_;
  const Membership* const membership_;

  mutable absl::Mutex mu_;
  absl::CondVar planned_;  // a planning finished
  struct Entry {
    std::shared_ptr<const GroupPlan> latest;
    int64_t planning_epoch = -1;  // being planned now, by some caller
  };
  std::map<std::string, Entry> cache_ ABSL_GUARDED_BY(mu_);
  int64_t plannings_ ABSL_GUARDED_BY(mu_) = 0;
  mutable int64_t reused_ ABSL_GUARDED_BY(mu_) = 0;
  // The plans of the last kPlansKept distinct digests, most recent last: a membership that
  // returns to a layout pair seen before (an engine restarting, a replica leaving and coming
  // back) reuses its plan instead of planning again. Bounded by count: a frontier plan is
  // hundreds of MB.
  static constexpr size_t kPlansKept = 3;
  struct KeptPlan {
    std::string digest;
    std::shared_ptr<const Plan> plan;
    std::shared_ptr<const Layout> src_layout, dst_layout;
  };
  mutable std::vector<KeptPlan> kept_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
