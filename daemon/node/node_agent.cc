#include "daemon/node/node_agent.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/base/culprit.h"
#include "daemon/base/logging.h"
#include "plan/planner.h"
#include "plan/status_macros.h"
#include "plan/validate.h"
#include "proto/layout_codec.h"
#include "proto/plan_codec.h"

namespace refit {

struct NodeAgent::InstalledPlan {
  int64_t epoch = -1;
  std::string digest;  // the plan's (InstallPlanRequest.plan_digest); empty: not given
  // From a slice: every worker, and this node's buffers (others are placeholders, worker -1).
  Layout src, dst;
  std::shared_ptr<const Plan> plan;
  absl::flat_hash_map<int32_t, std::string> data_addresses;
  CollectiveParams collective;
};

struct NodeAgent::Resolved {
  std::weak_ptr<const InstalledPlan> plan;  // resolved for this installation
  std::vector<std::weak_ptr<LocalWorker>> workers;
  BufferMemory src, dst;  // dst: the destination's buffers, then the plan's scratch
  // The plan's scratch buffers on this node, behind dst's last spans; shared with the transfers
  // that use them, so a re-resolve during a round does not free memory in use.
  std::shared_ptr<std::vector<std::unique_ptr<MappedBuffer>>> scratch;
};

NodeAgent::NodeAgent(int32_t node, WorkerRegistry* registry, DataBackend* backend,
                     NodeAgentLease lease)
    : node_(node), registry_(registry), backend_(backend), lease_(std::move(lease)) {}

absl::Time NodeAgent::LeaseFromNow() const {
  if (lease_.lease == absl::InfiniteDuration()) return absl::InfiniteFuture();
  return lease_.clock->Now() + lease_.lease;
}

void NodeAgent::RenewLeases(const std::map<std::string, int64_t>* running) {
  const absl::Time until = LeaseFromNow();
  absl::MutexLock lock(&mu_);
  for (auto& [group, active] : active_rounds_) {
    if (running != nullptr) {
      auto it = running->find(group);
      if (it == running->end() || it->second != active.round) continue;
    }
    active.lease_until = std::max(active.lease_until, until);
  }
}

int NodeAgent::ExpireLeases() {
  if (lease_.lease == absl::InfiniteDuration()) return 0;
  const absl::Time now = lease_.clock->Now();
  std::vector<std::pair<std::string, ActiveRound>> ended;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [group, active] : active_rounds_) {
      if (!active.committing && now > active.lease_until) ended.emplace_back(group, active);
    }
  }
  for (const auto& [group, active] : ended) {
    const std::string reason = absl::StrCat(
        "the coordinator (", lease_.coordinator, ") was lost: its lease on round ", active.round,
        " of group \"", group, "\" ended (no phase call or heartbeat answer for ",
        absl::FormatDuration(lease_.lease), ")");
    Logger("round")->warn("{}; aborting it here", reason);
    Abort(group, active.round, active.version, reason, /*only_if_open=*/true);
  }
  return static_cast<int>(ended.size());
}

int NodeAgent::Drain(absl::Duration deadline, const std::string& why) {
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_rounds_.empty(); };
    mu_.AwaitWithDeadline(absl::Condition(&idle), absl::Now() + deadline);
  }
  return AbortOpenRounds(why);
}

int NodeAgent::AbortOpenRounds(const std::string& why) {
  std::vector<std::pair<std::string, ActiveRound>> open;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [group, active] : active_rounds_) {
      if (!active.committing) open.emplace_back(group, active);
    }
  }
  for (const auto& [group, active] : open) {
    const std::string reason =
        absl::StrCat("round ", active.round, " of group \"", group, "\" ended: ", why);
    Logger("round")->warn("{}", reason);
    Abort(group, active.round, active.version, reason, /*only_if_open=*/true);
  }
  return static_cast<int>(open.size());
}

void NodeAgent::Abort(const std::string& group, int64_t round, int64_t version,
                      const std::string& reason, bool only_if_open) {
  {
    absl::MutexLock lock(&mu_);
    auto it = active_rounds_.find(group);
    const bool open = it != active_rounds_.end() && it->second.round == round;
    if (only_if_open && (!open || it->second.committing)) return;
    if (open) active_rounds_.erase(it);
    // The coordinator's ABORT can overtake the round's PREPARE to this node (another node
    // failed first): remembered, so that the PREPARE arriving next does not reopen the round.
    if (!open) early_aborts_[group] = {round, absl::Now(), reason};
    AbortedRound(group)->store(round);
    abort_reasons_[group] = {round, reason};
  }
  backend_->Cancel(group, round, reason);
  registry_->Notify();  // a wait for this round's PREPARE ends now
  v1::RoundEvent e;
  e.set_kind(v1::RoundEvent::ABORT);
  e.set_round_id(round);
  e.set_version(version);
  e.set_reason(reason);
  // To the workers of the round: the plan's, which were sent its PREPARE. A worker of the group
  // outside the plan (its replica incomplete, or registered since) was in no round: an ABORT
  // would make it drop a version it still holds whole.
  std::shared_ptr<const InstalledPlan> installed;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = installed_.find(group); it != installed_.end()) installed = it->second;
  }
  if (installed != nullptr) {
    registry_
        ->Send(LocalIds(group, *installed), e, /*reset_prepared=*/false, /*reset_resumed=*/false)
        .IgnoreError();
  } else {
    registry_->SendToGroup(group, e);  // no plan here: every worker of the group may be in it
  }
  ForgetIfGone(group);  // the round that held the group here is over
}

std::vector<std::string> NodeAgent::LocalIds(const std::string& group,
                                             const InstalledPlan& installed) const {
  std::vector<std::string> ids;
  for (const Layout* l : {&installed.src, &installed.dst}) {
    for (const Worker& w : l->workers) {
      if (w.node == node_) ids.push_back(absl::StrCat(group, "/", w.name));
    }
  }
  return ids;
}

namespace {

// A slice's own bytes must hash to what the coordinator sent, and name the plan they are part of.
absl::Status CheckSliceDigests(const v1::InstallPlanRequest& request, int32_t node) {
  const std::string where = absl::StrCat("node ", node, ": the plan slice of group \"",
                                         request.group(), "\" epoch ", request.epoch());
  if (request.plan_digest().size() != 32) {
    return absl::InvalidArgumentError(absl::StrCat(where, " names no plan digest"));
  }
  const std::string digest = Sha256(request.slice());
  if (digest != request.slice_digest()) {
    return absl::DataLossError(
        absl::StrCat(where, " (plan ", ShortHex(request.plan_digest()), ") arrived damaged: its ",
                     request.slice().size(), " bytes hash to ", ShortHex(digest),
                     ", the coordinator sent ", ShortHex(request.slice_digest())));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status NodeAgent::InstallPlan(const v1::InstallPlanRequest& request) {
  const absl::Time started = absl::Now();
  auto installed = std::make_shared<InstalledPlan>();
  installed->epoch = request.epoch();
  installed->digest = request.plan_digest();
  if (!request.slice().empty()) {
    // The coordinator's slice for this node: checked, bounded, run as it is (no planning here).
    REFIT_RETURN_IF_ERROR(CheckSliceDigests(request, node_));
    auto slice = SliceFromWire(request.slice(), node_);
    if (!slice.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("node ", node_, ": group \"", request.group(),
                                                     "\" epoch ", request.epoch(), ": ",
                                                     slice.status().message()));
    }
    installed->src = std::move(slice->src);
    installed->dst = std::move(slice->dst);
    installed->plan = std::make_shared<const Plan>(std::move(slice->plan));
  } else {
    // The layouts themselves: this node plans them (as the coordinator would).
    auto src = LayoutFromProto(request.source());
    auto dst = LayoutFromProto(request.destination());
    if (!src.ok()) return src.status();
    if (!dst.ok()) return dst.status();
    installed->src = *std::move(src);
    installed->dst = *std::move(dst);
    REFIT_RETURN_IF_ERROR(ValidateLayout(installed->src, "source"));
    REFIT_RETURN_IF_ERROR(ValidateLayout(installed->dst, "destination"));
    auto plan = MakePlan(installed->src, installed->dst, PlanOptionsFor(request));
    if (!plan.ok()) return plan.status();
    installed->plan = std::make_shared<const Plan>(*std::move(plan));
  }
  for (const v1::NodeAddress& n : request.nodes())
    installed->data_addresses[n.node()] = n.data_address();
  installed->collective = CollectiveParams{.nccl_id = request.nccl_id(),
                                           .step_bytes = request.step_bytes(),
                                           .zero_copy_min_bytes = request.zero_copy_min_bytes(),
                                           .nccl_register = request.nccl_register()};
  Logger("plan")->info(
      "group \"{}\" epoch {}: installed a plan of {} messages, {} bytes (plan {}, {}; {} "
      "descriptors "
      "here) in {:.3f} s",
      request.group(), request.epoch(), installed->plan->stats.messages,
      installed->plan->stats.bytes_total, ShortHex(installed->digest),
      request.slice().empty() ? "planned here"
                              : absl::StrCat("a slice of ", request.slice().size(), " bytes"),
      installed->plan->descriptors.size(), absl::ToDoubleSeconds(absl::Now() - started));
  absl::MutexLock lock(&mu_);
  installed_[request.group()] = std::move(installed);
  return absl::OkStatus();
}

std::shared_ptr<std::atomic<int64_t>> NodeAgent::AbortedRound(const std::string& group) {
  auto& a = aborted_rounds_[group];
  if (a == nullptr) a = std::make_shared<std::atomic<int64_t>>(-1);
  return a;
}

void NodeAgent::WorkerLost(const std::string& group, const std::string& id,
                           const std::string& reason) {
  int64_t round = -1;
  const std::string why = absl::StrCat("worker \"", id, "\" on node ", node_, " left: ", reason);
  {
    absl::MutexLock lock(&mu_);
    if (auto it = active_rounds_.find(group); it != active_rounds_.end()) {
      round = it->second.round;
      // The first worker lost in a round is its culprit, as the backends keep the first reason
      // (several can go at once: a frozen daemon's workers all drop their sessions).
      LostWorker& lost = lost_workers_[group];
      if (lost.round != round) lost = LostWorker{round, id, why};
    }
  }
  if (round >= 0) {
    backend_->Cancel(group, round, why);
  } else {
    ForgetIfGone(group);
  }
}

void NodeAgent::ForgetIfGone(const std::string& group) {
  std::shared_ptr<const InstalledPlan> installed;
  {
    absl::MutexLock lock(&mu_);
    if (active_rounds_.contains(group)) return;
    if (auto it = installed_.find(group); it != installed_.end()) installed = it->second;
  }
  if (installed != nullptr) {
    for (const Layout* l : {&installed->src, &installed->dst}) {
      for (const Worker& w : l->workers) {
        if (w.node == node_ && registry_->Find(absl::StrCat(group, "/", w.name)) != nullptr) return;
      }
    }
  }
  // What the group held here (its plan, its scratch) goes after the lock: freeing GPU memory may
  // wait for the GPU (daemon/dataplane/cuda/cuda_backend.h, armed rounds), and nothing should wait
  // holding mu_.
  std::shared_ptr<const InstalledPlan> dropped_plan;
  std::shared_ptr<const Resolved> dropped_resolved;
  absl::MutexLock lock(&mu_);
  if (active_rounds_.contains(group)) return;  // a round began meanwhile
  if (auto it = installed_.find(group); it != installed_.end() && it->second != installed)
    return;  // reinstalled
  if (auto it = installed_.find(group); it != installed_.end())
    dropped_plan = std::move(it->second);
  if (auto it = resolved_.find(group); it != resolved_.end())
    dropped_resolved = std::move(it->second);
  installed_.erase(group);
  resolved_.erase(group);
  abort_reasons_.erase(group);
  aborted_rounds_.erase(group);
  lost_workers_.erase(group);
  early_aborts_.erase(group);
  Logger("plan")->info("group \"{}\": no worker of it left on node {}; its plan is dropped here",
                       group, node_);
}

size_t NodeAgent::GroupsKept() const {
  absl::MutexLock lock(&mu_);
  std::set<std::string> groups;
  for (const auto& [g, _] : installed_) groups.insert(g);
  for (const auto& [g, _] : resolved_) groups.insert(g);
  for (const auto& [g, _] : abort_reasons_) groups.insert(g);
  for (const auto& [g, _] : aborted_rounds_) groups.insert(g);
  for (const auto& [g, _] : lost_workers_) groups.insert(g);
  for (const auto& [g, _] : early_aborts_) groups.insert(g);
  return groups.size();
}

absl::Status NodeAgent::RunPhase(const v1::PhaseRequest& request, v1::PhaseResponse* response) {
  const std::string& group = request.group();
  ScopedLogContext log_context(group, request.round_id());
  if (request.phase() == v1::PhaseRequest::ABORT) {
    Abort(group, request.round_id(), request.version(), request.reason(), /*only_if_open=*/false);
    return absl::OkStatus();
  }
  if (request.phase() == v1::PhaseRequest::TRANSFER ||
      request.phase() == v1::PhaseRequest::COMMIT) {
    REFIT_RETURN_IF_ERROR(RenewOpenRound(request));
  }
  REFIT_ASSIGN_OR_RETURN(std::shared_ptr<const InstalledPlan> installed, InstalledFor(request));
  switch (request.phase()) {
    case v1::PhaseRequest::PREPARE:
      return Prepare(installed, request);
    case v1::PhaseRequest::TRANSFER:
      return Transfer(group, installed, request, response);
    case v1::PhaseRequest::COMMIT:
      return Commit(installed, request);
    default:
      return absl::InvalidArgumentError("RunPhase: unknown phase");
  }
}

absl::Status NodeAgent::RenewOpenRound(const v1::PhaseRequest& request) {
  const std::string& group = request.group();
  // The round must still be open here: a coordinator that was stopped past its lease may send
  // the next phase of a round this node aborted meanwhile (its workers were told ABORT).
  absl::MutexLock lock(&mu_);
  auto it = active_rounds_.find(group);
  if (it == active_rounds_.end() || it->second.round != request.round_id()) {
    auto why = abort_reasons_.find(group);
    return absl::AbortedError(
        absl::StrCat("round ", request.round_id(), " of group \"", group, "\" is not open here",
                     why != abort_reasons_.end() && why->second.first == request.round_id()
                         ? ": " + why->second.second
                         : std::string()));
  }
  it->second.lease_until = std::max(it->second.lease_until, LeaseFromNow());
  if (request.phase() == v1::PhaseRequest::COMMIT) it->second.committing = true;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const NodeAgent::InstalledPlan>> NodeAgent::InstalledFor(
    const v1::PhaseRequest& request) const {
  const std::string& group = request.group();
  std::shared_ptr<const InstalledPlan> installed;
  {
    absl::MutexLock lock(&mu_);
    auto it = installed_.find(group);
    if (it != installed_.end()) installed = it->second;
  }
  if (installed == nullptr || installed->epoch != request.epoch()) {
    return absl::FailedPreconditionError(absl::StrCat("node ", node_, " has no plan of group \"",
                                                      group, "\" for membership epoch ",
                                                      request.epoch()));
  }
  if (!request.plan_digest().empty() && request.plan_digest() != installed->digest) {
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", node_, " holds plan ", ShortHex(installed->digest), " of group \"", group,
        "\" epoch ", request.epoch(), ", the round runs plan ", ShortHex(request.plan_digest())));
  }
  return installed;
}

namespace {

// The event a phase sends this node's workers.
v1::RoundEvent RoundEventOf(const v1::PhaseRequest& request, v1::RoundEvent::Kind kind) {
  v1::RoundEvent e;
  e.set_round_id(request.round_id());
  e.set_version(request.version());
  e.set_kind(kind);
  return e;
}

}  // namespace

absl::Status NodeAgent::Prepare(const std::shared_ptr<const InstalledPlan>& installed,
                                const v1::PhaseRequest& request) {
  const std::string& group = request.group();
  const std::vector<std::string> ids = LocalIds(group, *installed);
  const absl::Duration timeout = absl::Milliseconds(request.timeout_ms());
  REFIT_ASSIGN_OR_RETURN(std::shared_ptr<std::atomic<int64_t>> aborted,
                         OpenRound(request, timeout));
  // Aborted since OpenRound (the coordinator's ABORT, or this node's own on a resync answer): its
  // ABORT went to the workers already, and a PREPARE after it would leave a worker prepared for a
  // round whose end it already heard, waiting for another end that never comes. (Checked before
  // the send, not after: after it, an abort answering the workers' own refusal looks the same,
  // and a second ABORT of the round would follow theirs.)
  if (aborted->load() == request.round_id()) {
    return absl::AbortedError(absl::StrCat("node ", node_, ": round ", request.round_id(),
                                           " of group \"", group,
                                           "\" was aborted before its PREPARE was sent"));
  }
  // Answers about an earlier round of the same id (before a coordinator restart) are stale. An
  // ABORT that comes between the check above and the send reaches some workers first: they are
  // not sent the PREPARE, and the wait below ends on the abort.
  REFIT_RETURN_IF_ERROR(registry_->Send(ids, RoundEventOf(request, v1::RoundEvent::PREPARE),
                                        /*reset_prepared=*/true, /*reset_resumed=*/false,
                                        aborted.get()));
  const bool arms = backend_->ArmsRounds();
  if (arms) OfferToArm(installed, request);
  if (absl::Status s = registry_->AwaitWorkers(group, ids, request.round_id(), false, timeout,
                                               "PREPARE", aborted.get());
      !s.ok()) {
    if (arms) backend_->Cancel(group, request.round_id(), "its workers did not prepare");
    return s;
  }
  // Before the answer, so that the TRANSFER cannot overtake it.
  backend_->WorkersPrepared(group, request.round_id());
  if (arms) {
    bool open = false;
    {
      absl::MutexLock lock(&mu_);
      auto it = active_rounds_.find(group);
      open = it != active_rounds_.end() && it->second.round == request.round_id();
    }
    // Aborted meanwhile (its Cancel may have found nothing to call off yet): called off now.
    if (!open) {
      backend_->Cancel(group, request.round_id(),
                       "the round was aborted while its transfer was made ready");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<std::atomic<int64_t>>> NodeAgent::OpenRound(
    const v1::PhaseRequest& request, absl::Duration timeout) {
  const std::string& group = request.group();
  absl::MutexLock lock(&mu_);
  if (draining_) {
    return absl::UnavailableError(
        absl::StrCat("node ", node_, " is draining (shutting down): no new rounds"));
  }
  // Aborted before its PREPARE got here, by this coordinator in this round's lifetime (an
  // older record of the same id, from before a coordinator restart, is long past it).
  if (auto early = early_aborts_.find(group); early != early_aborts_.end() &&
                                              early->second.round == request.round_id() &&
                                              absl::Now() - early->second.at < timeout) {
    return absl::AbortedError(absl::StrCat("round ", request.round_id(), " of group \"", group,
                                           "\" was aborted before its PREPARE reached node ", node_,
                                           ": ", early->second.reason));
  }
  // What this node remembers of earlier rounds must not answer for this one: round ids
  // start again at 1 when the coordinator restarts.
  std::shared_ptr<std::atomic<int64_t>> aborted = AbortedRound(group);
  aborted->store(-1);
  ActiveRound& active = active_rounds_[group];
  active = ActiveRound{request.round_id(), request.version(), LeaseFromNow(), false};
  return aborted;
}

void NodeAgent::OfferToArm(const std::shared_ptr<const InstalledPlan>& installed,
                           const v1::PhaseRequest& request) {
  // While the workers prepare, the backend may launch the round's work, to run when the
  // TRANSFER comes (the cuda backend's armed rounds): off the PREPARE answer's path. A job
  // that cannot be built now is left to the TRANSFER, which reports why.
  std::vector<std::shared_ptr<LocalWorker>> workers;
  if (auto job = JobFor(request.group(), installed, request, workers); job.ok()) {
    job->holds =
        std::make_shared<const std::vector<std::shared_ptr<LocalWorker>>>(std::move(workers));
    backend_->RoundPreparing(*std::move(job));
  }
}

absl::Status NodeAgent::Commit(const std::shared_ptr<const InstalledPlan>& installed,
                               const v1::PhaseRequest& request) {
  const std::string& group = request.group();
  const std::vector<std::string> ids = LocalIds(group, *installed);
  const absl::Duration timeout = absl::Milliseconds(request.timeout_ms());
  // Its answer to this COMMIT, not to an earlier round of the same id.
  absl::Status s =
      registry_->Send(ids, RoundEventOf(request, v1::RoundEvent::COMMIT), /*reset_prepared=*/false,
                      /*reset_resumed=*/true);
  // Those still here are awaited whoever left: the answer names every worker that did not
  // confirm (its replica holds no version until refit whole).
  std::vector<std::string> present;
  for (const std::string& id : ids) {
    if (registry_->Find(id) != nullptr) present.push_back(id);
  }
  const absl::Status confirmed =
      registry_->AwaitWorkers(group, present, request.round_id(), true, timeout, "COMMIT", nullptr);
  if (s.ok()) {
    s = confirmed;
  } else if (!confirmed.ok()) {
    s = Rewrap(s, s.code(), absl::StrCat(s.message(), "; ", confirmed.message()));
  }
  {
    absl::MutexLock lock(&mu_);
    if (auto it = active_rounds_.find(group);
        it != active_rounds_.end() && it->second.round == request.round_id()) {
      active_rounds_.erase(it);
    }
  }
  ForgetIfGone(group);  // workers that left during the round
  return s;
}

absl::Status NodeAgent::ResolveBuffers(const std::string& group, const Layout& l,
                                       BufferMemory& memory,
                                       std::vector<std::shared_ptr<LocalWorker>>& hold) const {
  memory.assign(l.buffers.size(), {});
  std::vector<LocalWorker*> by_worker(l.workers.size(), nullptr);
  for (size_t b = 0; b < l.buffers.size(); ++b) {
    const int32_t wi = l.buffers[b].worker;
    if (wi < 0) continue;  // a slice's placeholder: a buffer of another node
    const Worker& w = l.workers[wi];
    if (w.node != node_) continue;
    if (by_worker[wi] == nullptr) {
      const std::string id = absl::StrCat(group, "/", w.name);
      auto local = registry_->Find(id);
      if (local == nullptr) {
        return WithCulprit(
            absl::AbortedError(absl::StrCat("worker \"", id, "\" left node ", node_)),
            WorkerCulprit(node_, id, "TRANSFER"));
      }
      by_worker[wi] = local.get();
      hold.push_back(std::move(local));
    }
    const LocalWorker& local = *by_worker[wi];
    auto k = local.buffer_index.find(l.buffers[b].name);
    if (k == local.buffer_index.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker \"", local.id, "\" has no buffer \"", l.buffers[b].name, "\""));
    }
    memory[b] = local.buffers[k->second]->bytes();
    if (static_cast<int64_t>(memory[b].size()) < l.buffers[b].NumBytes()) {
      // The worker registered again, otherwise, since the plan was made.
      return absl::FailedPreconditionError(absl::StrCat(
          "node ", node_, ": worker \"", local.id, "\" buffer \"", l.buffers[b].name, "\" holds ",
          memory[b].size(), " bytes, the plan's layout ", l.buffers[b].NumBytes()));
    }
  }
  return absl::OkStatus();
}

absl::Status NodeAgent::AllocateScratch(const InstalledPlan& installed, BufferMemory& dst,
                                        std::vector<std::unique_ptr<MappedBuffer>>& scratch) {
  for (const ScratchBuffer& b : installed.plan->scratch) {
    const Worker& w = installed.dst.workers[b.worker];
    if (w.node != node_) {
      dst.emplace_back();
      continue;
    }
    auto memory = backend_->AllocateScratch(w, b.NumBytes());
    if (!memory.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("scratch of ", b.NumBytes(), " bytes for worker \"", w.name,
                       "\" (fp8 blocks no source holds whole): ", memory.status().message()));
    }
    dst.push_back((*memory)->bytes());
    scratch.push_back(*std::move(memory));
  }
  return absl::OkStatus();
}

std::shared_ptr<const NodeAgent::Resolved> NodeAgent::CachedResolution(
    const std::string& group, const std::shared_ptr<const InstalledPlan>& installed,
    const std::vector<std::shared_ptr<LocalWorker>>& workers) const {
  std::shared_ptr<const Resolved> cached;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = resolved_.find(group); it != resolved_.end()) cached = it->second;
  }
  bool same = cached != nullptr && cached->plan.lock() == installed &&
              cached->workers.size() == workers.size();
  for (size_t i = 0; same && i < workers.size(); ++i) {
    same = workers[i] != nullptr && cached->workers[i].lock() == workers[i];
  }
  return same ? cached : nullptr;
}

absl::StatusOr<TransferJob> NodeAgent::JobFor(const std::string& group,
                                              const std::shared_ptr<const InstalledPlan>& installed,
                                              const v1::PhaseRequest& request,
                                              std::vector<std::shared_ptr<LocalWorker>>& workers) {
  const absl::Duration timeout = absl::Milliseconds(request.timeout_ms());
  TransferJob job;
  job.requested = absl::Now();
  job.group = group;
  job.round_id = request.round_id();
  job.node = node_;
  job.plan = installed->plan;
  job.data_addresses = installed->data_addresses;
  job.deadline = absl::Now() + timeout;
  job.epoch = installed->epoch;
  job.collective = installed->collective;
  // This node's workers of both layouts, as registered now; held for the transfer (they keep
  // the mappings alive).
  workers.clear();
  for (const Layout* l : {&installed->src, &installed->dst}) {
    for (const Worker& w : l->workers) {
      if (w.node == node_) workers.push_back(registry_->Find(absl::StrCat(group, "/", w.name)));
    }
  }
  if (auto cached = CachedResolution(group, installed, workers)) {
    job.src = cached->src;
    job.dst = cached->dst;
    job.scratch = cached->scratch;
    return job;
  }
  // Each buffer of the plan on this node, found by name in its worker's registration (once per
  // worker, then by hash: linear over 100k buffers, not quadratic).
  std::vector<std::shared_ptr<LocalWorker>> hold;
  REFIT_RETURN_IF_ERROR(ResolveBuffers(group, installed->src, job.src, hold));
  REFIT_RETURN_IF_ERROR(ResolveBuffers(group, installed->dst, job.dst, hold));
  auto fresh = std::make_shared<Resolved>();
  fresh->scratch = std::make_shared<std::vector<std::unique_ptr<MappedBuffer>>>();
  REFIT_RETURN_IF_ERROR(AllocateScratch(*installed, job.dst, *fresh->scratch));
  job.scratch = fresh->scratch;
  fresh->plan = installed;
  for (const auto& w : workers) fresh->workers.push_back(w);
  fresh->src = job.src;
  fresh->dst = job.dst;
  workers.insert(workers.end(), hold.begin(), hold.end());
  std::shared_ptr<const Resolved> old;  // freed after the lock (its scratch: GPU memory)
  absl::MutexLock lock(&mu_);
  old = std::exchange(resolved_[group], std::move(fresh));
  return job;
}

std::optional<NodeAgent::LostWorker> NodeAgent::LostIn(const std::string& group,
                                                       int64_t round) const {
  absl::MutexLock lock(&mu_);
  auto lost = lost_workers_.find(group);
  if (lost == lost_workers_.end() || lost->second.round != round) return std::nullopt;
  return lost->second;
}

absl::Status NodeAgent::Transfer(const std::string& group,
                                 const std::shared_ptr<const InstalledPlan>& installed,
                                 const v1::PhaseRequest& request, v1::PhaseResponse* response) {
  std::vector<std::shared_ptr<LocalWorker>> workers;
  auto job = JobFor(group, installed, request, workers);
  if (!job.ok()) {
    // A worker missing from the registry: the first one lost in this round, if one was (not
    // whichever of several comes first in the layouts).
    if (auto lost = LostIn(group, request.round_id())) {
      return WithCulprit(absl::AbortedError(lost->reason),
                         WorkerCulprit(node_, lost->id, "TRANSFER"));
    }
    return job.status();
  }
  auto stats = backend_->Transfer(*job);
  if (!stats.ok()) {
    if (auto lost = LostIn(group, request.round_id())) {
      return WithCulpritIfNone(stats.status(), WorkerCulprit(node_, lost->id, "TRANSFER"));
    }
    return stats.status();
  }
  response->set_bytes_sent(stats->bytes_sent);
  response->set_bytes_received(stats->bytes_received);
  response->set_bytes_local(stats->bytes_local);
  response->set_bytes_nvlink(stats->bytes_nvlink);
  response->set_data_plane_ms(stats->data_plane_ms);
  response->set_started_after_request_ms(stats->started_after_request_ms);
  response->set_request_arrived_unix_us(absl::ToUnixMicros(job->requested));
  response->set_answered_unix_us(absl::ToUnixMicros(absl::Now()));
  return absl::OkStatus();
}

}  // namespace refit
