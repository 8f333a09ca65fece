#include "daemon/coordinator/group_planner.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/base/logging.h"
#include "daemon/base/round_protocol.h"
#include "plan/planner.h"
#include "plan/validate.h"
#include "proto/layout_codec.h"
#include "proto/plan_codec.h"

namespace refit {

GroupPlanner::GroupPlanner(GroupPlannerOptions options, const Membership* membership)
    : options_(std::move(options)), membership_(membership) {}

int64_t GroupPlanner::plannings() const {
  absl::MutexLock lock(&mu_);
  return plannings_;
}

int64_t GroupPlanner::reused() const {
  absl::MutexLock lock(&mu_);
  return reused_;
}

namespace {

// The layout without its tensors and pieces: what a slice names (workers, buffers).
std::shared_ptr<const Layout> WorkersAndBuffers(Layout layout) {
  layout.tensors.clear();
  layout.pieces.clear();
  layout.boxes.clear();
  layout.box_ids.clear();
  layout.tensor_index.clear();
  auto kept = std::make_shared<Layout>(std::move(layout));
  kept->pieces.shrink_to_fit();
  kept->boxes.shrink_to_fit();
  return kept;
}

}  // namespace

void GroupPlanner::Forget(const std::string& group) {
  absl::MutexLock lock(&mu_);
  auto it = cache_.find(group);
  if (it == cache_.end()) return;
  if (it->second.planning_epoch == -1) {
    cache_.erase(it);
  } else {
    it->second.latest =
        nullptr;  // a planning in flight puts its result back; a later Forget drops it
  }
}

std::shared_ptr<const GroupPlan> GroupPlanner::Get(const std::string& group) {
  while (true) {
    // The epoch alone first: a cached plan of this epoch is the common case (every round, every
    // Status), and copying every worker's registration costs what they hold (a frontier model's
    // tensor tables, per worker).
    const int64_t epoch = membership_->Epoch(group);
    {
      absl::MutexLock lock(&mu_);
      Entry& e = cache_[group];
      if (e.latest != nullptr && e.latest->epoch == epoch) return e.latest;
      if (e.planning_epoch == epoch) {
        // Another caller plans this epoch: wait for it (bounded waits; a newer epoch may arrive).
        planned_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
        continue;
      }
    }
    GroupMembers members = membership_->Group(group, /*with_pieces=*/true);
    {
      absl::MutexLock lock(&mu_);
      Entry& e = cache_[group];
      if (e.latest != nullptr && e.latest->epoch == members.epoch) return e.latest;
      if (e.planning_epoch == members.epoch) continue;  // another caller got there first
      e.planning_epoch = members.epoch;
      ++plannings_;
    }
    std::shared_ptr<const GroupPlan> plan = Compute(group, members);
    absl::MutexLock lock(&mu_);
    Entry& e = cache_[group];
    if (e.latest == nullptr || e.latest->epoch <= plan->epoch) e.latest = plan;
    if (e.planning_epoch == plan->epoch) e.planning_epoch = -1;
    planned_.SignalAll();
    return plan;
  }
}

namespace {

// Sorts the group's replicas into planned (complete) and incomplete; returns what the first eight
// incomplete ones lack (and how many more there are), for the message of a group not ready.
std::vector<std::string> SortReplicas(const GroupMembers& members, GroupPlan& g) {
  std::vector<std::string> problems;
  for (const ReplicaView& r : members.replicas) {
    (r.complete ? g.planned : g.incomplete).push_back(r.name);
    if (!r.complete && problems.size() < 8) problems.push_back(r.problem);
  }
  if (g.incomplete.size() > problems.size()) {
    problems.push_back(
        absl::StrCat("and ", g.incomplete.size() - problems.size(), " more incomplete replicas"));
  }
  return problems;
}

// Both sides' layouts from the workers' registrations (full form: every tensor once, every
// worker), and the nodes with workers in them. FAILED_PRECONDITION when two workers disagree on a
// tensor.
absl::Status GatherLayouts(const std::string& group, const GroupMembers& members, GroupPlan& g) {
  g.src.set_model(group + " trainers");
  g.dst.set_model(group + " inference");
  std::map<std::string, std::pair<v1::TensorSpec, std::string>> seen[2];  // name -> spec, worker
  std::set<int32_t> nodes;
  for (size_t i = 0; i < members.workers.size(); ++i) {
    // Inference workers of incomplete replicas are left out: a round refits replicas whole.
    if (i < members.counts.size() && !members.counts[i]) continue;
    const auto& [node, w] = members.workers[i];
    nodes.insert(node);
    const int side = w.role() == v1::TRAINER ? 0 : 1;
    v1::Layout& l = side == 0 ? g.src : g.dst;
    for (const v1::TensorSpec& t : w.tensors()) {
      auto [it, added] = seen[side].emplace(t.name(), std::make_pair(t, w.worker().name()));
      if (added) {
        *l.add_tensors() = t;
      } else if (it->second.first.SerializeAsString() != t.SerializeAsString()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "group \"", group, "\": workers \"", it->second.second, "\" and \"", w.worker().name(),
            "\" disagree on tensor \"", t.name(), "\" (shape or dtype)"));
      }
    }
    *l.add_workers() = w.worker();
  }
  g.nodes.assign(nodes.begin(), nodes.end());
  return absl::OkStatus();
}

// FAILED_PRECONDITION where a side has no workers to plan.
absl::Status BothSidesPresent(const std::string& group, const GroupMembers& members,
                              const GroupPlan& g, const std::vector<std::string>& problems) {
  if (g.src.workers_size() > 0 && g.dst.workers_size() == 0 && members.inference > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group \"", group,
        "\" is not ready: no complete inference replica (a replica counts only with every rank "
        "registered): ",
        absl::StrJoin(problems, "; ")));
  }
  if (g.src.workers_size() == 0 || g.dst.workers_size() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("group \"", group, "\" is not ready: ", g.src.workers_size(), " trainers and ",
                     g.dst.workers_size(), " inference workers registered; both sides are needed"));
  }
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<const GroupPlan> GroupPlanner::Compute(const std::string& group,
                                                       const GroupMembers& members) const {
  auto g = std::make_shared<GroupPlan>();
  g->epoch = members.epoch;
  g->trainers = members.trainers;
  g->inference = members.inference;
  g->replicas = members.replicas;
  g->trainer_ranks = members.trainer_ranks;
  const std::vector<std::string> problems = SortReplicas(members, *g);
  // A declared trainer rank missing, or ranks in conflict: not ready, whatever the others cover
  // (the rank is named; coverage alone cannot name the last one).
  if (!members.trainer_ranks.complete()) {
    g->status = absl::FailedPreconditionError(
        absl::StrCat("group \"", group, "\" is not ready: ", members.trainer_ranks.problem));
    return g;
  }
  if (absl::Status s = GatherLayouts(group, members, *g); !s.ok()) {
    g->status = std::move(s);
    return g;
  }
  if (absl::Status s = BothSidesPresent(group, members, *g, problems); !s.ok()) {
    // A plan that is not ready keeps no layouts: the full forms would stay cached with it (and
    // Clear() would keep their repeated fields' elements allocated for reuse: swapped out, they
    // are freed here).
    v1::Layout().Swap(&g->src);
    v1::Layout().Swap(&g->dst);
    g->status = std::move(s);
    return g;
  }
  const absl::Time started = absl::Now();
  absl::Status s = PlanLayouts(group, *g);
  g->planning_time = absl::Now() - started;
  g->status = s.ok() ? s
                     : absl::FailedPreconditionError(
                           absl::StrCat("group \"", group, "\" is not ready: ", s.message()));
  return g;
}

absl::Status GroupPlanner::PlanLayouts(const std::string& group, GroupPlan& g) const {
  auto src = LayoutFromProto(g.src);
  auto dst = LayoutFromProto(g.dst);
  if (absl::Status s = src.ok() ? dst.status() : src.status(); !s.ok()) return s;
  // The full forms go: the compact ones are what every node is sent (a frontier engine's full
  // layout is hundreds of MiB; compact, a few).
  g.src = CompactLayoutToProto(*src, g.src.model());
  g.dst = CompactLayoutToProto(*dst, g.dst.model());
  v1::InstallPlanRequest probe;  // the options every node derives from the request
  *probe.mutable_source() = g.src;
  *probe.mutable_destination() = g.dst;
  probe.set_max_message_bytes(options_.max_message_bytes);
  probe.set_no_routing(!options_.routing);
  probe.set_max_relay_depth(options_.max_relay_depth);
  g.digest = PlanInputsDigest(g.src, g.dst, PlanOptionsFor(probe));
  if (ReuseKept(g)) {
    Logger("plan")->info(
        "group \"{}\" epoch {}: the layouts of an earlier epoch (plan {}): its plan is reused",
        group, g.epoch, ShortHex(g.digest));
    return absl::OkStatus();
  }
  if (absl::Status s = ValidateLayout(*src, "source"); !s.ok()) return s;
  if (absl::Status s = ValidateLayout(*dst, "destination"); !s.ok()) return s;
  auto plan = options_.make_plan ? options_.make_plan(*src, *dst, PlanOptionsFor(probe))
                                 : MakePlan(*src, *dst, PlanOptionsFor(probe));
  if (!plan.ok()) return plan.status();
  Logger("plan")->info(
      "group \"{}\" epoch {}: planned {} tensors, {} messages, {} bytes in {:.3f} s (plan {})",
      group, g.epoch, plan->stats.tensors, plan->stats.messages, plan->stats.bytes_total,
      plan->stats.planning_seconds, ShortHex(g.digest));
  g.plan = std::make_shared<const refit::Plan>(*std::move(plan));
  g.src_layout = WorkersAndBuffers(*std::move(src));
  g.dst_layout = WorkersAndBuffers(*std::move(dst));
  Keep(g);
  return absl::OkStatus();
}

bool GroupPlanner::ReuseKept(GroupPlan& g) const {
  absl::MutexLock lock(&mu_);
  for (auto it = kept_.begin(); it != kept_.end(); ++it) {
    if (it->digest != g.digest) continue;
    g.plan = it->plan;
    g.src_layout = it->src_layout;
    g.dst_layout = it->dst_layout;
    g.reused = true;
    ++reused_;
    std::rotate(it, it + 1, kept_.end());  // the most recently used last
    return true;
  }
  return false;
}

void GroupPlanner::Keep(const GroupPlan& g) const {
  absl::MutexLock lock(&mu_);
  kept_.push_back({g.digest, g.plan, g.src_layout, g.dst_layout});
  if (kept_.size() > kPlansKept) kept_.erase(kept_.begin());
}

}  // namespace refit
