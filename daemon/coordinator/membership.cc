#include "daemon/coordinator/membership.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/base/logging.h"
#include "daemon/ops/memory_trim.h"
#include "daemon/worker/registration_decoder.h"
#include "plan/dtype.h"
#include "plan/status_macros.h"

namespace refit {

namespace {

using RegisteredWorkers = std::vector<std::pair<int32_t, v1::RegisterWorkerRequest>>;

struct ReplicaRank {
  size_t worker;  // index into the registered workers
  int32_t rank, size;
};

// Inference workers by replica name; a worker that names no replica is a replica of its own.
std::map<std::string, std::vector<ReplicaRank>> InferenceByReplica(
    const RegisteredWorkers& workers) {
  std::map<std::string, std::vector<ReplicaRank>> by_replica;
  for (size_t i = 0; i < workers.size(); ++i) {
    const v1::RegisterWorkerRequest& r = workers[i].second;
    if (r.role() != v1::INFERENCE) continue;
    const v1::Worker& w = r.worker();
    if (w.replica_size() > 0) {
      by_replica[w.replica()].push_back({i, w.replica_rank(), w.replica_size()});
    } else {
      by_replica[w.name()].push_back({i, 0, 1});
    }
  }
  return by_replica;
}

// Fills v.workers by rank; every disagreement (sizes, two workers on one rank) goes to conflicts.
void AssignRanks(const RegisteredWorkers& workers, const std::vector<ReplicaRank>& ranks,
                 ReplicaView& v, std::vector<std::string>& conflicts) {
  const auto worker_name = [&](const ReplicaRank& k) -> const std::string& {
    return workers[k.worker].second.worker().name();
  };
  for (const ReplicaRank& k : ranks) {
    if (k.size != v.size) {
      conflicts.push_back(absl::StrCat("workers \"", worker_name(ranks.front()), "\" and \"",
                                       worker_name(k), "\" disagree on its size (", v.size, " and ",
                                       k.size, ")"));
    }
  }
  v.workers.assign(v.size, "");
  for (const ReplicaRank& k : ranks) {
    if (k.rank < 0 || k.rank >= v.size) continue;  // its size disagrees: named above
    std::string& at = v.workers[k.rank];
    if (!at.empty()) {
      conflicts.push_back(absl::StrCat("workers \"", at, "\" and \"", worker_name(k),
                                       "\" both claim rank ", k.rank));
    } else {
      at = worker_name(k);
    }
  }
}

// Records the ranks no worker holds in v.missing; the sentence naming them and a few present
// ones, or "" when none is missing.
std::string MissingRanks(ReplicaView& v) {
  std::vector<std::string> present;
  for (int32_t rank = 0; rank < v.size; ++rank) {
    if (v.workers[rank].empty()) {
      if (v.missing.size() < static_cast<size_t>(kMaxListedRanks)) v.missing.push_back(rank);
    } else if (present.size() < 8) {
      present.push_back(absl::StrCat(rank, " \"", v.workers[rank], "\""));
    }
  }
  if (v.missing.empty()) return "";
  const int32_t held =
      v.size - static_cast<int32_t>(std::count(v.workers.begin(), v.workers.end(), ""));
  std::vector<int32_t> listed(v.missing.begin(),
                              v.missing.begin() + std::min<size_t>(v.missing.size(), 16));
  return absl::StrCat(
      held, " of ", v.size, " ranks registered; missing rank", v.missing.size() > 1 ? "s " : " ",
      absl::StrJoin(listed, ", "), v.missing.size() > listed.size() ? ", ..." : "",
      present.empty() ? "" : absl::StrCat(" (present: ", absl::StrJoin(present, ", "), ")"));
}

ReplicaView OneReplica(const RegisteredWorkers& workers, const std::string& name,
                       const std::vector<ReplicaRank>& ranks, std::vector<bool>& counts) {
  ReplicaView v;
  v.name = name;
  v.size = ranks.front().size;
  const auto uncounted = [&] {
    for (const ReplicaRank& k : ranks) counts[k.worker] = false;
  };
  if (v.size < 1 || v.size > (1 << 16)) {  // refused at registration (kMaxReplicaSize)
    v.problem = absl::StrCat("replica \"", name, "\": size ", v.size, " is not a replica's size");
    v.size = 0;
    uncounted();
    return v;
  }
  for (const ReplicaRank& k : ranks) v.nodes.push_back(workers[k.worker].first);
  std::sort(v.nodes.begin(), v.nodes.end());
  v.nodes.erase(std::unique(v.nodes.begin(), v.nodes.end()), v.nodes.end());
  std::vector<std::string> conflicts;
  AssignRanks(workers, ranks, v, conflicts);
  if (std::string missing = MissingRanks(v); !missing.empty()) {
    conflicts.insert(conflicts.begin(), std::move(missing));
  }
  v.complete = conflicts.empty();
  if (!v.complete) {
    v.problem = absl::StrCat("replica \"", name, "\": ", absl::StrJoin(conflicts, "; "));
    uncounted();
  }
  return v;
}

}  // namespace

std::vector<ReplicaView> ReplicasOf(const RegisteredWorkers& workers, std::vector<bool>* counts) {
  counts->assign(workers.size(), true);
  std::vector<ReplicaView> out;
  for (const auto& [name, ranks] : InferenceByReplica(workers)) {
    out.push_back(OneReplica(workers, name, ranks, *counts));
  }
  return out;
}

namespace {

// A trainer as its rank declaration needs it.
struct TrainerRank {
  const std::string* name;
  int32_t rank, world_size;  // world_size 0: undeclared
};

// "rank 3 of 4 is", "ranks 1, 3 of 4 are", "ranks 0, 1, ..., 15 and 40 more of 64 are".
std::string MissingRanksText(const std::vector<int32_t>& listed, int32_t missing, int32_t of) {
  constexpr size_t kNamed = 16;
  std::vector<int32_t> named(listed.begin(), listed.begin() + std::min(listed.size(), kNamed));
  const int32_t more = missing - static_cast<int32_t>(named.size());
  return absl::StrCat(missing > 1 ? "ranks " : "rank ", absl::StrJoin(named, ", "),
                      more > 0 ? absl::StrCat(" and ", more, " more") : "", " of ", of,
                      missing > 1 ? " are" : " is");
}

// The trainer side by declared rank: like a replica's ranks, with every declaring trainer one of
// the same world. Trainers that declare nothing count only where none declares (coverage alone).
TrainerRanksView TrainerRanksFrom(const std::vector<TrainerRank>& trainers) {
  TrainerRanksView v;
  const TrainerRank* first = nullptr;
  for (const TrainerRank& t : trainers) {
    if (t.world_size != 0) {
      first = &t;
      break;
    }
  }
  if (first == nullptr) return v;
  v.world_size = first->world_size;
  if (v.world_size < 1 || v.world_size > kMaxTrainerWorldSize) {
    v.problem = absl::StrCat("trainer \"", *first->name, "\" declares world size ", v.world_size,
                             ", not between 1 and ", kMaxTrainerWorldSize);
    return v;
  }
  v.workers.assign(v.world_size, "");
  std::vector<std::string> conflicts;
  int64_t more_conflicts = 0;
  const auto conflict = [&](std::string text) {
    if (conflicts.size() < 8) {
      conflicts.push_back(std::move(text));
    } else {
      ++more_conflicts;
    }
  };
  for (const TrainerRank& t : trainers) {
    if (t.world_size == 0) {
      conflict(absl::StrCat("trainer \"", *t.name, "\" declares no rank, while \"", *first->name,
                            "\" declares world size ", v.world_size,
                            " (declare a rank and world size on every trainer, or on none)"));
    } else if (t.world_size != v.world_size) {
      conflict(absl::StrCat("trainers \"", *first->name, "\" and \"", *t.name,
                            "\" disagree on the trainer world size (", v.world_size, " and ",
                            t.world_size, ")"));
    } else if (t.rank < 0 || t.rank >= v.world_size) {
      conflict(
          absl::StrCat("trainer \"", *t.name, "\" declares rank ", t.rank, " of ", v.world_size));
    } else if (std::string& at = v.workers[t.rank]; !at.empty()) {
      conflict(absl::StrCat("trainers \"", at, "\" and \"", *t.name, "\" both claim trainer rank ",
                            t.rank));
    } else {
      at = *t.name;
    }
  }
  int32_t missing = 0;
  for (int32_t rank = 0; rank < v.world_size; ++rank) {
    if (!v.workers[rank].empty()) continue;
    ++missing;
    if (v.missing.size() < static_cast<size_t>(kMaxListedRanks)) v.missing.push_back(rank);
  }
  if (missing > 0) {
    conflicts.insert(conflicts.begin(),
                     absl::StrCat("trainer ", MissingRanksText(v.missing, missing, v.world_size),
                                  " not registered"));
  }
  if (more_conflicts > 0) conflicts.push_back(absl::StrCat("and ", more_conflicts, " more"));
  v.problem = absl::StrJoin(conflicts, "; ");
  return v;
}

}  // namespace

TrainerRanksView TrainerRanksOf(
    const std::vector<std::pair<int32_t, v1::RegisterWorkerRequest>>& workers) {
  std::vector<TrainerRank> trainers;
  for (const auto& [node, r] : workers) {
    if (r.role() != v1::TRAINER) continue;
    trainers.push_back({&r.worker().name(), r.trainer_rank(), r.trainer_world_size()});
  }
  return TrainerRanksFrom(trainers);
}

Membership::Membership(int32_t self, absl::Duration heartbeat, int heartbeats_missed,
                       const Clock* clock)
    : self_(self), silence_(heartbeat * heartbeats_missed), clock_(clock) {}

void Membership::SetSelf(const std::string& control_address, const std::string& data_address,
                         int64_t incarnation) {
  absl::MutexLock lock(&mu_);
  NodeInfo& me = nodes_[self_];
  me.control_address = control_address;
  me.data_address = data_address;
  me.incarnation = incarnation;
  me.alive = true;
  me.synced = true;  // its workers arrive one at a time (AddLocal)
}

absl::StatusOr<bool> Membership::Admit(const v1::JoinRequest& request) {
  absl::StatusOr<bool> resync;
  {
    absl::MutexLock lock(&mu_);
    resync = AdmitLocked(request);
  }
  TellForgotten();
  return resync;
}

absl::StatusOr<bool> Membership::AdmitLocked(const v1::JoinRequest& request) {
  const absl::Time now = clock_->Now();
  // The common case, a heartbeat from a known, live daemon. It is asked for its workers again
  // until a sync brings them: the answer that asked first may have come late, or not at all.
  if (auto it = beats_.find(request.node());
      it != beats_.end() && it->second.first == request.incarnation()) {
    it->second.second = now;
    return !nodes_[request.node()].synced;
  }
  if (!nodes_.contains(request.node())) REFIT_RETURN_IF_ERROR(MakeRoomLocked(request.node()));
  NodeInfo& n = nodes_[request.node()];
  beats_[request.node()] = {request.incarnation(), now};
  if (n.incarnation != request.incarnation() || !n.alive) {
    if (n.incarnation != 0 && n.incarnation != request.incarnation()) {
      Logger("rpc")->warn("node {} restarted; its old workers are gone", request.node());
    }
    if (n.incarnation != request.incarnation()) {
      n.applied_sequence = 0;  // it numbers anew
      n.stashed.reset();
      RequestTrim();  // rare, and its workers may have been large
    }
    ClearWorkersLocked(n);
    n.incarnation = request.incarnation();
    n.synced = false;
  }
  // A list the node took before this answer reaches it predates its admission (ApplySync).
  n.admitted_at_resyncs = request.resyncs_seen();
  n.control_address = request.control_address();
  n.data_address = request.data_address();
  n.alive = true;
  RecomputeEpochs();
  return !n.synced;
}

absl::Status Membership::MakeRoomLocked(int32_t node) {
  if (static_cast<int64_t>(nodes_.size()) < node_limits_.max_nodes) return absl::OkStatus();
  // The node dead the longest goes first: dead, it is in no group and no round can reach it.
  std::optional<int32_t> oldest;
  for (const auto& [id, info] : nodes_) {
    if (id == self_ || info.alive) continue;
    if (!oldest || info.dead_since < nodes_.at(*oldest).dead_since) oldest = id;
  }
  if (oldest) {
    ForgetLocked(*oldest, absl::StrCat("to make room for node ", node, " (--max-nodes ",
                                       node_limits_.max_nodes, ")"));
    return absl::OkStatus();
  }
  ++counts_.refused_joins;
  const std::string why =
      absl::StrCat("node ", node, " cannot join: the coordinator lists ", nodes_.size(),
                   " nodes, every one alive, and --max-nodes is ", node_limits_.max_nodes);
  // A flood of joins logs once, not once a join; the count goes on.
  if (!std::exchange(refusing_joins_, true))
    Logger("rpc")->warn("{} (further refusals are counted, not logged)", why);
  return absl::ResourceExhaustedError(why);
}

void Membership::ForgetLocked(int32_t node, absl::string_view why) {
  auto it = nodes_.find(node);
  if (it == nodes_.end()) return;
  auto dead = dead_because_.find(node);
  Logger("rpc")->info("node {} ({}) forgotten {}; it was dead for {}{}", node,
                      it->second.control_address, std::string(why),
                      absl::FormatDuration(clock_->Now() - it->second.dead_since),
                      dead != dead_because_.end() ? absl::StrCat(" (", dead->second, ")") : "");
  nodes_.erase(it);
  dead_because_.erase(node);
  beats_.erase(node);  // none: a dead node has left it already
  ++counts_.forgotten_nodes;
  refusing_joins_ = false;
}

std::optional<absl::Status> Membership::StaleSync(const v1::SyncWorkersRequest& request,
                                                  const NodeInfo& n) const {
  if (request.sequence() == 0) return std::nullopt;  // not numbered: a daemon from before the check
  if (request.resyncs_seen() <= n.admitted_at_resyncs) {
    auto dead = dead_because_.find(request.node());
    return absl::FailedPreconditionError(
        absl::StrCat("SyncWorkers ", request.sequence(), " from node ", request.node(),
                     " was sent before the node heard that the coordinator admitted it again",
                     dead != dead_because_.end()
                         ? absl::StrCat(" (it had been declared dead: ", dead->second, ")")
                         : "",
                     "; the coordinator asks for the list in its next heartbeat's answer"));
  }
  // An older list that arrives after a newer one: it says nothing the coordinator needs.
  if (request.sequence() <= n.applied_sequence) return absl::OkStatus();
  return std::nullopt;
}

absl::Status Membership::ApplySync(const v1::SyncWorkersRequest& request,
                                   v1::SyncWorkersResponse* response) {
  // Each worker split and stored (its header built, its pieces counted) before the lock is
  // taken: a large list must not hold up the heartbeats that keep its node alive.
  std::vector<StoredWorker> stored;
  stored.reserve(static_cast<size_t>(request.workers_size()));
  bool large = false;
  for (const v1::RegisterWorkerRequest& w : request.workers()) {
    absl::StatusOr<SplitRegistration> split = SplitRegistration::Of(w);
    if (!split.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("SyncWorkers from node ", request.node(), ": ", split.status().message()));
    }
    stored.push_back(Store(*split));
    large |= static_cast<int64_t>(stored.back().wire->size()) >= kTrimAfterBytes;
  }
  {
    absl::MutexLock lock(&mu_);
    // Only a node joined at this incarnation syncs. A node declared dead (it was frozen, or cut
    // off) must learn so from its next heartbeat's answer (resync), which makes it abort the
    // rounds it still has open; a sync that revived it first would hide that for good.
    if (request.node() != self_) {
      auto beat = beats_.find(request.node());
      if (beat == beats_.end() || beat->second.first != request.incarnation()) {
        auto dead = dead_because_.find(request.node());
        const bool full = !nodes_.contains(request.node()) &&
                          static_cast<int64_t>(nodes_.size()) >= node_limits_.max_nodes;
        return absl::FailedPreconditionError(
            absl::StrCat("SyncWorkers from node ", request.node(), " (incarnation ",
                         request.incarnation(), "): the node has not joined this coordinator",
                         dead != dead_because_.end()
                             ? absl::StrCat(" since it was declared dead (", dead->second, ")")
                             : "",
                         full ? absl::StrCat(", which lists --max-nodes ", node_limits_.max_nodes,
                                             " nodes, every one alive")
                              : "; it joins again with its next heartbeat"));
      }
      if (std::optional<absl::Status> stale = StaleSync(request, nodes_.at(request.node()))) {
        ++counts_.stale_syncs;
        Logger("rpc")->debug(
            "node {}: worker list {} not applied: {}", request.node(), request.sequence(),
            stale->ok() ? std::string("a newer one was applied") : std::string(stale->message()));
        return *stale;
      }
    }
    NodeInfo& n = nodes_[request.node()];
    for (const StoredWorker& w : stored)
      counts_.synced_bytes += static_cast<int64_t>(w.wire->size());
    const bool same = n.incarnation == request.incarnation() && request.base_sequence() > 0;
    const bool onto_list = same && n.synced && n.applied_sequence == request.base_sequence();
    const bool onto_stash =
        same && !n.synced && n.stashed.has_value() && n.stashed_sequence == request.base_sequence();
    if (request.delta() && !onto_list && !onto_stash) {
      ++counts_.rebased_syncs;
      return absl::AbortedError(absl::StrCat(
          "SyncWorkers ", request.sequence(), " from node ", request.node(),
          " changes its list of sync ", request.base_sequence(), ", but the coordinator holds ",
          same && n.synced ? absl::StrCat("that of sync ", n.applied_sequence)
          : same && n.stashed.has_value()
              ? absl::StrCat("that of sync ", n.stashed_sequence, " (kept while it was dead)")
              : std::string("no list of this incarnation"),
          "; the node sends its whole list"));
    }
    n.incarnation = request.incarnation();
    if (request.sequence() > 0) n.applied_sequence = request.sequence();
    if (onto_stash && request.delta()) {
      // Revived: its list comes back, checked again as a whole list is (a name or a declaration
      // may have been taken on another node meanwhile), then changed.
      std::vector<StoredWorker> kept = *std::move(n.stashed);
      std::set<std::string> changed(request.removed().begin(), request.removed().end());
      for (const StoredWorker& w : stored)
        changed.insert(absl::StrCat(w.group(), "/", w.worker().name()));
      std::erase_if(kept, [&](const StoredWorker& w) {
        return changed.contains(absl::StrCat(w.group(), "/", w.worker().name()));
      });
      Logger("rpc")->info(
          "node {}: its list of sync {} kept while it was dead is back ({} workers)",
          request.node(), request.base_sequence(), kept.size());
      stored.insert(stored.begin(), std::make_move_iterator(kept.begin()),
                    std::make_move_iterator(kept.end()));
    } else if (request.delta()) {
      for (const std::string& id : request.removed()) large |= RemoveWorkerLocked(n, id, "");
      for (const StoredWorker& w : stored)  // the same name again: the new registration replaces it
        large |= RemoveWorkerLocked(n, absl::StrCat(w.group(), "/", w.worker().name()), "");
    } else {
      // The old list and the request itself (freed by gRPC after this returns) may be large.
      for (const StoredWorker& w : n.workers)
        large |= static_cast<int64_t>(w.wire->size()) >= kTrimAfterBytes;
      large |= static_cast<int64_t>(request.ByteSizeLong()) >= kTrimAfterBytes;
      ClearWorkersLocked(n);  // its new list is checked against the other nodes' declarations
    }
    large |= n.stashed.has_value();
    n.stashed.reset();
    n.workers.reserve(n.workers.size() + stored.size());
    // A change counts the node's other workers in its groups' limits; a whole list replaces them.
    std::map<std::string, GroupLoad> load = LoadExcept(request.delta() ? -1 : request.node());
    for (StoredWorker& w : stored) {
      // A name another live node holds stays with it: this one is refused, never admitted.
      std::optional<v1::WorkerRefusal> refused =
          Refusal(absl::StrCat(w.group(), "/", w.worker().name()), request.node());
      if (!refused) refused = OverLimit(w, load[w.group()]);
      if (!refused) refused = Declare(w.header, request.node());
      if (refused) {
        Logger("rpc")->warn("node {}: {}", request.node(), refused->reason());
        if (response != nullptr) *response->add_refused() = *std::move(refused);
        continue;
      }
      load[w.group()].Add(w);
      n.workers.push_back(std::move(w));
    }
    n.alive = true;
    n.synced = true;
    if (request.node() != self_) beats_[request.node()] = {request.incarnation(), clock_->Now()};
    for (const auto& w : n.workers) groups_[w.group()];
    RecomputeEpochs();
  }
  if (large) RequestTrim();
  TellForgotten();
  return absl::OkStatus();
}

absl::Status Membership::AddLocal(const v1::RegisterWorkerRequest& request,
                                  const std::string& registration) {
  REFIT_ASSIGN_OR_RETURN(const SplitRegistration split, SplitRegistration::Of(request));
  const v1::RegisterWorkerRequest& worker = split.header();
  absl::MutexLock lock(&mu_);
  const std::string id = absl::StrCat(worker.group(), "/", worker.worker().name());
  if (auto refused = Refusal(id, self_)) return absl::AlreadyExistsError(refused->reason());
  RemoveLocalLocked(id, "");           // an earlier registration whose removal is still on its way
  StoredWorker stored = Store(split);  // handles stay on this node
  stored.registration = registration;
  if (auto over = OverLimit(stored, LoadExcept(-1)[worker.group()]))
    return absl::ResourceExhaustedError(over->reason());
  if (auto conflict = Declare(stored.header, self_))
    return absl::FailedPreconditionError(conflict->reason());
  nodes_[self_].workers.push_back(std::move(stored));
  groups_[worker.group()];
  RecomputeEpochs();
  if (static_cast<int64_t>(nodes_[self_].workers.back().wire->size()) >= kTrimAfterBytes)
    RequestTrim();
  return absl::OkStatus();  // adding forgets no group
}

void Membership::RemoveLocal(const std::string& id, const std::string& registration) {
  {
    absl::MutexLock lock(&mu_);
    RemoveLocalLocked(id, registration);
    RecomputeEpochs();
  }
  TellForgotten();
}

void Membership::RemoveLocalLocked(const std::string& id, const std::string& registration) {
  if (RemoveWorkerLocked(nodes_[self_], id, registration)) RequestTrim();
}

bool Membership::RemoveWorkerLocked(NodeInfo& n, const std::string& id,
                                    const std::string& registration) {
  auto gone = [&](const StoredWorker& r) {
    return absl::StrCat(r.group(), "/", r.worker().name()) == id &&
           (registration.empty() || r.registration == registration);
  };
  for (const StoredWorker& r : n.workers) {
    if (gone(r)) Undeclare(r.header);
  }
  bool large = false;
  std::erase_if(n.workers, [&](const StoredWorker& r) {
    if (!gone(r)) return false;
    large |= static_cast<int64_t>(r.wire->size()) >= kTrimAfterBytes;
    return true;
  });
  return large;
}

std::map<std::string, Membership::GroupLoad> Membership::LoadExcept(int32_t except) const {
  std::map<std::string, GroupLoad> out;
  for (const auto& [node, info] : nodes_) {
    if (node == except) continue;
    for (const StoredWorker& w : info.workers) out[w.group()].Add(w);
  }
  return out;
}

std::optional<v1::WorkerRefusal> Membership::OverLimit(const StoredWorker& w,
                                                       const GroupLoad& load) const {
  auto over = [&](absl::string_view what, int64_t now, int64_t limit, absl::string_view flag) {
    v1::WorkerRefusal r;
    r.set_worker_id(absl::StrCat(w.group(), "/", w.worker().name()));
    r.set_holder_node(-1);
    r.set_code(static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
    r.set_reason(absl::StrCat("group \"", w.group(), "\" would hold ", now, " ", what,
                              " with worker \"", w.worker().name(), "\", more than ", limit, " (--",
                              flag, ")"));
    return r;
  };
  if (load.workers + 1 > limits_.max_workers) {
    return over("workers", load.workers + 1, limits_.max_workers, "max-group-workers");
  }
  if (const int64_t n = load.buffers + w.worker().buffers_size(); n > limits_.max_buffers) {
    return over("buffers", n, limits_.max_buffers, "max-group-buffers");
  }
  // Tensor specs as the workers declare them (each its own part's), summed: what is stored.
  if (const int64_t n = load.tensors + w.header.tensors_size(); n > limits_.max_tensors) {
    return over("tensor specs", n, limits_.max_tensors, "max-group-tensors");
  }
  if (load.pieces + w.pieces > limits_.max_pieces) {
    return over("pieces", load.pieces + w.pieces, limits_.max_pieces, "max-group-pieces");
  }
  const int64_t bytes = load.bytes + static_cast<int64_t>(w.wire->size());
  if (bytes > limits_.max_bytes)
    return over("registration bytes", bytes, limits_.max_bytes, "max-group-bytes");
  return std::nullopt;
}

std::optional<v1::WorkerRefusal> Membership::Refusal(const std::string& id, int32_t node) const {
  auto held = holders_.find(id);
  if (held == holders_.end() || held->second == node) return std::nullopt;
  auto holder = nodes_.find(held->second);
  v1::WorkerRefusal r;
  r.set_worker_id(id);
  r.set_holder_node(held->second);
  r.set_reason(absl::StrCat("worker \"", id, "\" is already registered on node ", held->second,
                            holder != nodes_.end() && !holder->second.control_address.empty()
                                ? absl::StrCat(" (", holder->second.control_address, ")")
                                : std::string(),
                            "; unregister it there first, or choose another name"));
  return r;
}

namespace {

// The planner pairs trainers with trainers and inference workers with inference workers.
int SideOf(v1::Role role) { return role == v1::TRAINER ? 0 : 1; }

// A declaration without its tensor's name, encoded: two agree when these are equal, as the
// planner compares them (the whole TensorSpec, encoded).
std::string SpecKey(const v1::TensorSpec& t) {
  v1::TensorSpec spec = t;
  spec.clear_name();
  return spec.SerializeAsString();
}

// "[8, 4] fp32", and its quantization: how an operator reads a declaration.
std::string Describe(const v1::TensorSpec& t) {
  std::string out = absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "] ",
                                 t.dtype().empty() ? "(no dtype)" : t.dtype());
  if (t.has_quantization()) {
    const v1::Quantization& q = t.quantization();
    absl::StrAppend(&out, " quantized ", q.format(), " [", absl::StrJoin(q.block(), ", "), "]",
                    q.scale().empty() ? "" : absl::StrCat(" scale \"", q.scale(), "\""));
  }
  return out;
}

}  // namespace

std::optional<v1::WorkerRefusal> Membership::Declare(const v1::RegisterWorkerRequest& w,
                                                     int32_t node) {
  const int side = SideOf(w.role());
  GroupDeclarations& group = declared_[w.group()];
  auto& index = group.by_tensor[side];
  std::vector<std::string> keys;
  keys.reserve(static_cast<size_t>(w.tensors_size()));
  // All checked before any is counted: a refused worker leaves the index as it was.
  for (const v1::TensorSpec& t : w.tensors()) {
    std::string& key = keys.emplace_back(SpecKey(t));
    auto it = index.find(t.name());
    if (it == index.end() || it->second.spec == key) continue;
    Declared& held = it->second;
    if (held.holder.empty()) FindHolder(w.group(), side, t.name(), held);
    v1::TensorSpec theirs;
    theirs.ParseFromString(held.spec);  // encoded here, from a parsed TensorSpec
    auto holder = nodes_.find(held.holder_node);
    const std::string role = side == 0 ? "trainer" : "inference worker";
    const std::string roles = side == 0 ? "trainers" : "inference workers";
    v1::WorkerRefusal r;
    r.set_worker_id(absl::StrCat(w.group(), "/", w.worker().name()));
    r.set_holder_node(held.holder_node);
    r.set_code(static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
    r.set_reason(absl::StrCat(
        "worker \"", r.worker_id(), "\" (node ", node, ") declares tensor \"", t.name(), "\" as ",
        Describe(t), ", but ", role, " \"", held.holder, "\" on node ", held.holder_node,
        holder != nodes_.end() && !holder->second.control_address.empty()
            ? absl::StrCat(" (", holder->second.control_address, ")")
            : std::string(),
        ", registered earlier, declares it as ", Describe(theirs),
        held.declarers > 1 ? absl::StrCat(" (as do ", held.declarers - 1, " more)") : std::string(),
        ": the ", roles,
        " of a group must agree on each tensor's shape, dtype and quantization (refused so that "
        "the group stays usable; to change the model, unregister ",
        held.declarers > 1 ? absl::StrCat("the ", held.declarers, " ", roles, " declaring it")
                           : absl::StrCat("\"", held.holder, "\""),
        " first)"));
    return r;
  }
  const std::string id = absl::StrCat(w.group(), "/", w.worker().name());
  for (int i = 0; i < w.tensors_size(); ++i) {
    Declared& d = index[w.tensors(i).name()];
    if (d.declarers++ == 0) d.spec = std::move(keys[static_cast<size_t>(i)]);
    if (d.holder.empty()) {  // the first declarer, or one since the last named left
      d.holder = id;
      d.holder_node = node;
    }
  }
  if (group.by_tensor[0].empty() && group.by_tensor[1].empty()) declared_.erase(w.group());
  return std::nullopt;
}

void Membership::Undeclare(const v1::RegisterWorkerRequest& w) {
  auto group = declared_.find(w.group());
  if (group == declared_.end()) return;
  auto& index = group->second.by_tensor[SideOf(w.role())];
  const std::string id = absl::StrCat(w.group(), "/", w.worker().name());
  for (const v1::TensorSpec& t : w.tensors()) {
    auto it = index.find(t.name());
    if (it == index.end()) continue;
    // The declaration stays with the workers that still declare it; the last takes it along.
    if (--it->second.declarers <= 0) {
      index.erase(it);
    } else if (it->second.holder == id) {
      it->second.holder.clear();
      it->second.holder_node = -1;
    }
  }
  if (group->second.by_tensor[0].empty() && group->second.by_tensor[1].empty())
    declared_.erase(group);
}

void Membership::FindHolder(const std::string& group, int side, const std::string& tensor,
                            Declared& held) const {
  for (const auto& [node, info] : nodes_) {
    if (!info.alive) continue;
    for (const StoredWorker& w : info.workers) {
      if (w.group() != group || SideOf(w.role()) != side) continue;
      for (const v1::TensorSpec& t : w.header.tensors()) {
        if (t.name() != tensor) continue;
        held.holder = absl::StrCat(group, "/", w.worker().name());
        held.holder_node = node;
        return;
      }
    }
  }
}

void Membership::ClearWorkersLocked(NodeInfo& n) {
  for (const StoredWorker& w : n.workers) Undeclare(w.header);
  n.workers.clear();
}

int64_t Membership::IndexedDeclarations() const {
  absl::MutexLock lock(&mu_);
  int64_t out = 0;
  for (const auto& [name, g] : declared_) out += g.by_tensor[0].size() + g.by_tensor[1].size();
  return out;
}

void Membership::OnGroupForgotten(std::function<void(const std::string& group)> hook) {
  absl::MutexLock lock(&mu_);
  forgotten_hooks_.push_back(std::move(hook));
}

void Membership::TellForgotten() {
  std::vector<std::string> gone;
  std::vector<std::function<void(const std::string&)>> hooks;
  {
    absl::MutexLock lock(&mu_);
    if (forgotten_.empty()) return;
    gone = std::exchange(forgotten_, {});
    hooks = forgotten_hooks_;
  }
  for (const std::string& group : gone) {
    Logger("rpc")->info("group \"{}\" has no workers left: forgotten", group);
    for (const auto& hook : hooks) hook(group);
  }
}

void Membership::RecordCommit(const std::string& group, int64_t epoch,
                              const std::vector<std::string>& replicas, int64_t version) {
  absl::MutexLock lock(&mu_);
  auto g = groups_.find(group);
  if (g == groups_.end()) return;
  for (const std::string& name : replicas) {
    auto r = g->second.replicas.find(name);
    // A replica that changed since the round was planned (a rank left, or came back) is a
    // different one: it did not receive this version whole.
    if (r != g->second.replicas.end() && r->second.since_epoch <= epoch)
      r->second.version = version;
  }
}

std::map<std::string, int64_t> Membership::ReplicaVersions(const std::string& group) const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int64_t> out;
  auto g = groups_.find(group);
  if (g == groups_.end()) return out;
  for (const auto& [name, r] : g->second.replicas) out[name] = r.version;
  return out;
}

TrainerRanksView Membership::TrainerRanks(const std::string& group) const {
  absl::MutexLock lock(&mu_);
  std::vector<TrainerRank> trainers;
  for (const auto& [node, info] : nodes_) {
    if (!info.alive) continue;
    for (const StoredWorker& w : info.workers) {
      if (w.group() != group || w.role() != v1::TRAINER) continue;
      trainers.push_back(
          {&w.worker().name(), w.header.trainer_rank(), w.header.trainer_world_size()});
    }
  }
  return TrainerRanksFrom(trainers);
}

void Membership::RecomputeEpochs() {
  std::map<std::string, std::vector<std::string>> members;
  // group -> replica -> its workers' fingerprints
  std::map<std::string, std::map<std::string, std::vector<std::string>>> replicas;
  holders_.clear();
  for (const auto& [node, info] : nodes_) {
    if (!info.alive) continue;
    for (const auto& w : info.workers) {
      const v1::Worker& k = w.worker();
      std::string f = absl::StrCat(node, ":", info.incarnation, ":", k.name(), ":", w.role(), ":",
                                   k.replica(), ":", k.replica_rank(), ":", k.replica_size(), ":",
                                   w.header.trainer_rank(), ":", w.header.trainer_world_size());
      if (w.role() == v1::INFERENCE) {
        replicas[w.group()][k.replica_size() > 0 ? k.replica() : k.name()].push_back(f);
      }
      members[w.group()].push_back(std::move(f));
      holders_.emplace(absl::StrCat(w.group(), "/", k.name()), node);
    }
  }
  for (auto it = groups_.begin(); it != groups_.end();) {
    auto& [name, g] = *it;
    auto m = members.find(name);
    if (m == members.end()) {
      // Its last worker left: forgotten (Status no longer lists or plans it; the hooks drop the
      // rest). Its epochs are never reused: they come from one counter.
      forgotten_.push_back(name);
      it = groups_.erase(it);
      continue;
    }
    std::sort(m->second.begin(), m->second.end());
    std::string fingerprint = absl::StrJoin(m->second, ",");
    if (fingerprint != g.fingerprint) {
      g.fingerprint = std::move(fingerprint);
      g.epoch = ++last_epoch_;
    }
    std::map<std::string, ReplicaRecord> now;
    for (auto& [replica, fs] : replicas[name]) {
      std::sort(fs.begin(), fs.end());
      ReplicaRecord r;
      r.fingerprint = absl::StrJoin(fs, ",");
      r.since_epoch = g.epoch;
      if (auto old = g.replicas.find(replica);
          old != g.replicas.end() && old->second.fingerprint == r.fingerprint) {
        r = old->second;  // unchanged: it keeps what it was committed
      }
      now.emplace(replica, std::move(r));
    }
    g.replicas = std::move(now);
    ++it;
  }
}

bool Membership::MarkDeadLocked(int32_t node, const std::string& why) {
  auto it = nodes_.find(node);
  if (it == nodes_.end() || !it->second.alive) return false;
  // Kept aside: a node that comes back at the same incarnation (it was frozen, or cut off) names
  // its list rather than sending it again, which for large workers takes long enough to be
  // declared dead again. A node admitted again but dead before any list reached it holds no
  // workers here: what it will name is still the list kept at its first verdict, which an empty
  // one must not replace (the node would come back believing its workers held, with none).
  NodeInfo& n = it->second;
  for (const StoredWorker& w : n.workers) Undeclare(w.header);
  if (n.synced || !n.stashed.has_value()) {
    n.stashed = std::move(n.workers);
    n.stashed_sequence = n.applied_sequence;
  }
  n.workers.clear();
  n.alive = false;
  n.synced = false;
  n.dead_since = clock_->Now();
  beats_.erase(node);  // its next heartbeat takes the slow path and resyncs
  Logger("rpc")->warn("node {} ({}) is dead: {}", node, it->second.control_address, why);
  dead_because_[node] = why;
  RecomputeEpochs();
  return true;
}

bool Membership::MarkDead(int32_t node, const std::string& why) {
  bool marked = false;
  {
    absl::MutexLock lock(&mu_);
    marked = MarkDeadLocked(node, why);
  }
  TellForgotten();
  return marked;
}

std::vector<DeadNode> Membership::CheckLiveness() {
  std::vector<DeadNode> dead;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    std::vector<int32_t> silent;
    for (const auto& [node, seen] : beats_) {
      if (now - seen.second > silence_) silent.push_back(node);
    }
    const std::string why = absl::StrCat("no heartbeat for ", absl::FormatDuration(silence_));
    for (int32_t node : silent) {
      if (MarkDeadLocked(node, why)) dead.push_back({node, why});
    }
    std::vector<int32_t> long_dead;
    for (const auto& [node, info] : nodes_) {
      if (node != self_ && !info.alive && now - info.dead_since >= node_limits_.forget_dead_after) {
        long_dead.push_back(node);
      }
    }
    const std::string after = absl::StrCat("after --forget-dead-after ",
                                           absl::FormatDuration(node_limits_.forget_dead_after));
    for (int32_t node : long_dead) ForgetLocked(node, after);
  }
  TellForgotten();
  return dead;
}

absl::StatusOr<std::string> Membership::ControlAddress(int32_t node) const {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node);
  if (it == nodes_.end() || !it->second.alive) {
    return absl::UnavailableError(absl::StrCat("node ", node, " is not alive"));
  }
  return it->second.control_address;
}

std::optional<std::string> Membership::DeathReason(int32_t node) const {
  if (node == self_) return std::nullopt;  // never judged by heartbeats
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node);
  if (it == nodes_.end()) {
    // A round may still name a node forgotten while it ran: it died before it was forgotten.
    return absl::StrCat(
        "not a member of the cluster (never joined, or forgotten after being dead for ",
        absl::FormatDuration(node_limits_.forget_dead_after), " or to make room for another)");
  }
  if (it->second.alive) return std::nullopt;
  auto dead = dead_because_.find(node);
  return dead != dead_because_.end() ? dead->second : "not alive";
}

std::vector<v1::NodeAddress> Membership::DataAddresses() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::NodeAddress> out;
  for (const auto& [node, info] : nodes_) {
    if (!info.alive) continue;
    v1::NodeAddress& a = out.emplace_back();
    a.set_node(node);
    a.set_data_address(info.data_address);
  }
  return out;
}

Membership::StoredWorker Membership::Store(const SplitRegistration& registration) {
  const v1::RegisterWorkerRequest& request = registration.header();  // its buffers have no pieces
  StoredWorker out;
  // The header: all but the pieces and the memory handles, built field by field.
  v1::RegisterWorkerRequest& h = out.header;
  h.set_group(request.group());
  h.set_role(request.role());
  *h.mutable_tensors() = request.tensors();
  h.set_gpu_uuid(request.gpu_uuid());
  h.set_trainer_rank(request.trainer_rank());
  h.set_trainer_world_size(request.trainer_world_size());
  const v1::Worker& w = request.worker();
  v1::Worker* hw = h.mutable_worker();
  hw->set_name(w.name());
  hw->set_node(w.node());
  hw->set_gpu(w.gpu());
  hw->set_replica(w.replica());
  hw->set_replica_rank(w.replica_rank());
  hw->set_replica_size(w.replica_size());
  hw->set_buffers_like(w.buffers_like());
  for (const v1::Buffer& b : w.buffers()) {
    v1::Buffer* hb = hw->add_buffers();
    hb->set_name(b.name());
    hb->set_dtype(b.dtype());
    *hb->mutable_shape() = b.shape();
  }
  // Checked before it is stored (CheckRegistration): a valid encoding.
  out.pieces = static_cast<int32_t>(std::max<int64_t>(0, CountPieces(registration.worker())));
  // The whole: the header's top-level fields, then each tensor (field 4) and the worker with its
  // pieces (field 3) appended as the wire format's length-delimited fields, the worker's bytes
  // as they came (never decoded here).
  v1::RegisterWorkerRequest top;
  top.set_group(request.group());
  top.set_role(request.role());
  top.set_gpu_uuid(request.gpu_uuid());
  top.set_trainer_rank(request.trainer_rank());
  top.set_trainer_world_size(request.trainer_world_size());
  std::string wire = top.SerializeAsString();
  auto append = [&](uint32_t field, absl::string_view bytes) {
    AppendVarint(uint64_t{field << 3 | 2}, &wire);
    AppendVarint(bytes.size(), &wire);
    wire.append(bytes.data(), bytes.size());
  };
  for (const v1::TensorSpec& t : request.tensors()) append(4, t.SerializeAsString());
  append(3, registration.worker());
  out.wire = std::make_shared<const std::string>(std::move(wire));
  return out;
}

GroupMembers Membership::Group(const std::string& group, bool with_pieces) const {
  GroupMembers out;
  // Decoded after the lock is released: a worker of 10^6 pieces takes seconds, and heartbeats
  // (Join) wait for this lock.
  std::vector<std::shared_ptr<const std::string>> wires;
  std::map<std::string, int64_t> versions;  // replica -> version
  {
    absl::MutexLock lock(&mu_);
    auto g = groups_.find(group);
    if (g == groups_.end()) return out;
    out.exists = true;
    out.epoch = g->second.epoch;
    for (const auto& [name, record] : g->second.replicas) versions[name] = record.version;
    for (const auto& [node, info] : nodes_) {
      if (!info.alive) continue;
      bool here = false;
      for (const auto& w : info.workers) {
        if (w.group() != group) continue;
        if (with_pieces) {
          out.workers.emplace_back(node, v1::RegisterWorkerRequest());
          wires.push_back(w.wire);
        } else {
          out.workers.emplace_back(node, w.header);
        }
        (w.role() == v1::TRAINER ? out.trainers : out.inference)++;
        here = true;
      }
      if (here) out.nodes.push_back(node);
    }
  }
  for (size_t i = 0; i < wires.size(); ++i) {
    // Cannot fail: Store wrote it.
    if (!out.workers[i].second.ParseFromString(*wires[i])) out.workers[i].second.Clear();
  }
  out.replicas = ReplicasOf(out.workers, &out.counts);
  out.trainer_ranks = TrainerRanksOf(out.workers);
  for (ReplicaView& r : out.replicas) {
    auto version = versions.find(r.name);
    if (version != versions.end()) r.version = version->second;
  }
  return out;
}

int64_t Membership::Epoch(const std::string& group) const {
  absl::MutexLock lock(&mu_);
  auto g = groups_.find(group);
  return g == groups_.end() ? GroupMembers().epoch : g->second.epoch;
}

std::vector<std::string> Membership::GroupNames() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const auto& [name, g] : groups_) out.push_back(name);
  return out;
}

void Membership::NodeStatuses(v1::StatusResponse* response) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [node, info] : nodes_) {
    v1::NodeStatus* n = response->add_nodes();
    n->set_node(node);
    n->set_address(info.control_address);
    n->set_alive(info.alive);
    n->set_workers(static_cast<int32_t>(info.workers.size()));
  }
}

MembershipCounts Membership::Counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

void Membership::ListWorkers(const v1::ListWorkersRequest& request,
                             v1::ListWorkersResponse* response) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [node, info] : nodes_) {
    if (!info.alive) continue;
    for (const auto& w : info.workers) {
      if (!request.group().empty() && w.group() != request.group()) continue;
      v1::WorkerInfo* out = response->add_workers();
      out->set_worker_id(absl::StrCat(w.group(), "/", w.worker().name()));
      out->set_group(w.group());
      out->set_role(w.role());
      out->set_node(node);
      out->set_gpu(w.worker().gpu());
      out->set_buffers(w.worker().buffers_size());
      int32_t pieces = 0;
      int64_t bytes = 0;
      pieces = w.pieces;
      for (const auto& b : w.worker().buffers()) {
        int64_t n = 1;
        for (int64_t d : b.shape()) n *= d;
        auto dtype = ParseDType(b.dtype());
        bytes += n * (dtype.ok() ? DTypeSize(*dtype) : 0);
      }
      out->set_pieces(pieces);
      out->set_bytes(bytes);
      out->set_connected(true);
    }
  }
}

}  // namespace refit
