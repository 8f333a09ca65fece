// The coordinator's view of the cluster: its nodes (addresses, incarnation, liveness, their
// workers) and, per model group, the membership epoch (bumped whenever the set of its workers
// changes). Liveness comes from heartbeats, judged on an injected clock: a node silent for
// `heartbeat * heartbeats_missed` is dead (CheckLiveness).
//
// Bounded: at most NodeLimits::max_nodes nodes are listed (a new one past it is refused, unless
// a dead node can be forgotten to make room), and a node dead for NodeLimits::forget_dead_after is
// forgotten (CheckLiveness). A dead node holds no workers and is in no group's view, so forgetting
// it changes no epoch and no round planned before; if it comes back it joins as a new node.
//
// A node's worker lists apply in the order it sent them, and only once it knew of its latest
// admission: SyncWorkersRequest.sequence and .resyncs_seen (ApplySync).
//
// Also, per group, its inference replicas (Worker.replica: docs/ROUNDS.md, "Replicas and
// commit"): complete or not, the missing ranks, and the last version committed to each whole;
// and its trainer side by declared rank (RegisterWorkerRequest.trainer_rank), the same way.
// A worker name is held by one node at a time: a sync or local registration naming a worker that
// another live node holds is refused (ALREADY_EXISTS naming the holder). So is a worker that
// declares a tensor otherwise (shape, dtype, quantization: the TensorSpec as the planner compares
// it) than the live workers of its group and side already do (FAILED_PRECONDITION naming both):
// the group's declarations are indexed as workers come and go (`declared_`), so a sync costs its
// own workers' declarations, not the group's. A declaration lasts while any worker declares it:
// the first declarer leaving changes nothing while others remain; the last leaving frees the
// tensor for any declaration. A group is forgotten
// when its last worker leaves (the OnGroupForgotten hooks are told). Epochs are one counter for
// every group, so a group forgotten and registered again never reuses an epoch.
//
// Lock: `mu_` guards everything here; nothing is called out of it while it is held (the hooks
// run after it is released).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/base/clock.h"
#include "daemon/worker/registration_decoder.h"
#include "daemon/worker/registration_limits.h"
#include "proto/refit.pb.h"

namespace refit {

// One inference replica of a group: ranks by the workers' declarations (a worker without one is a
// replica of its own, of size 1, named after it).
struct ReplicaView {
  std::string name;
  int32_t size = 1;
  std::vector<std::string> workers;  // by rank; "" where no worker holds it
  std::vector<int32_t> missing;      // ranks no worker holds (at most kMaxListedRanks listed)
  std::vector<int32_t> nodes;        // the nodes of its workers, ascending
  bool complete = false;
  std::string problem;  // why it does not count; empty when complete
  int64_t version = 0;  // last committed to it whole (0: none since it changed)
};
inline constexpr int kMaxListedRanks = 1024;

// A group's trainer side by the ranks its trainers declare (RegisterWorkerRequest.trainer_rank,
// trainer_world_size). `world_size` 0: no trainer declares one, and only coverage tells whether a
// trainer is missing (as before trainers declared ranks).
struct TrainerRanksView {
  int32_t world_size = 0;            // the first declaring trainer's, where they disagree
  std::vector<std::string> workers;  // by rank; "" where no trainer holds it
  std::vector<int32_t> missing;      // ranks no trainer holds (at most kMaxListedRanks listed)
  // Why the trainer side is not whole, e.g. "trainer rank 3 of 4 is not registered"; empty when
  // every declared rank is held once, or none is declared.
  std::string problem;
  bool complete() const { return problem.empty(); }
};
inline constexpr int32_t kMaxTrainerWorldSize = 1 << 20;

// One group's members at one epoch, as the planner needs them.
struct GroupMembers {
  bool exists = false;
  int64_t epoch = 0;
  // Alive nodes' workers of the group, by node then in registration order (without their pieces
  // unless Group() was asked for them).
  std::vector<std::pair<int32_t, v1::RegisterWorkerRequest>> workers;
  std::vector<int32_t> nodes;  // nodes with workers of the group, ascending
  int trainers = 0, inference = 0;
  // Per entry of `workers`: a trainer, or an inference worker of a complete replica (planned).
  std::vector<bool> counts;
  std::vector<ReplicaView> replicas;  // by name
  TrainerRanksView trainer_ranks;
};

// The replicas of a group's inference workers (pure; Group() fills GroupMembers with it).
// `counts[i]` says whether workers[i] is planned.
std::vector<ReplicaView> ReplicasOf(
    const std::vector<std::pair<int32_t, v1::RegisterWorkerRequest>>& workers,
    std::vector<bool>* counts);
// The trainer side of a group's workers by declared rank (pure; Group() fills GroupMembers).
TrainerRanksView TrainerRanksOf(
    const std::vector<std::pair<int32_t, v1::RegisterWorkerRequest>>& workers);

struct DeadNode {
  int32_t node;
  std::string why;
};

// How many nodes the coordinator lists, and how long it keeps a dead one (--max-nodes,
// --forget-dead-after).
struct NodeLimits {
  int64_t max_nodes = 4096;  // the coordinator included
  absl::Duration forget_dead_after = absl::Minutes(1);
};

// What the membership turned away or dropped since it started.
struct MembershipCounts {
  int64_t stale_syncs = 0;      // worker lists older than one applied, or from before an admission
  int64_t rebased_syncs = 0;    // changes refused for a base other than the list held (ABORTED)
  int64_t synced_bytes = 0;     // registrations received in nodes' syncs, as stored
  int64_t forgotten_nodes = 0;  // dead for --forget-dead-after, or making room for a new node
  int64_t refused_joins = 0;    // new nodes past --max-nodes, every node listed alive
};

class Membership {
 public:
  Membership(int32_t self, absl::Duration heartbeat, int heartbeats_missed, const Clock* clock);
  // What a group may hold (--max-group-*); before the first worker arrives.
  void SetLimits(const GroupLimits& limits) {
    absl::MutexLock lock(&mu_);
    limits_ = limits;
  }
  void SetNodeLimits(const NodeLimits& limits) {
    absl::MutexLock lock(&mu_);
    node_limits_ = limits;
  }

  // This node (the coordinator): alive from the start, never judged by heartbeats.
  void SetSelf(const std::string& control_address, const std::string& data_address,
               int64_t incarnation);
  // A join or heartbeat; true when the node must send its whole worker list: it is new,
  // restarted or declared dead since, and no sync of its has been applied since then. Every
  // heartbeat says so until one is (an answer that said it may have been lost, or a sync).
  // RESOURCE_EXHAUSTED, naming --max-nodes, for a new node when max_nodes are listed, all alive.
  absl::StatusOr<bool> Admit(const v1::JoinRequest& request);
  // Admit() for a caller that cannot answer an error: a refused node is told to resync, and its
  // sync is refused naming the cap.
  bool Join(const v1::JoinRequest& request) { return Admit(request).value_or(true); }
  // A node's whole worker list. A worker whose name another live node holds is not admitted:
  // it is listed in `response->refused` (may be null), naming the holder. FAILED_PRECONDITION
  // from a node not joined at this incarnation (unknown, restarted, or declared dead since), or
  // for a list taken before the node heard of its latest admission (resyncs_seen). A list older
  // than the last applied (sequence) is ignored: OK, nothing changes. A change (`delta`) applies
  // only onto the list of its `base_sequence`, else ABORTED: the node sends its whole list.
  absl::Status ApplySync(const v1::SyncWorkersRequest& request,
                         v1::SyncWorkersResponse* response = nullptr);
  // The coordinator's own workers, one at a time (a snapshot per registration would make
  // registering n workers O(n^2)). ALREADY_EXISTS, naming the holder, when another live node
  // holds the name. `registration` tells one registration of a name from the next (the worker
  // registry's session key): a worker that re-registers at once may be added before its old
  // registration's removal arrives, which then removes only the old one. Adding replaces an
  // entry of the same name still here (the registry holds one registration per name).
  // `request`'s worker may come as `worker` or, read without decoding its pieces, as
  // `worker_encoded` (LocalWorker::Encoded); so may a sync's.
  absl::Status AddLocal(const v1::RegisterWorkerRequest& request,
                        const std::string& registration = "");
  // Removes `id`'s entry if it is still that of `registration` (empty: whichever).
  void RemoveLocal(const std::string& id, const std::string& registration = "");

  // Told the name of each group whose last worker left, with no lock of the membership held
  // (a hook may call into it). Set up before the membership changes.
  void OnGroupForgotten(std::function<void(const std::string& group)> hook);
  // A round planned at `epoch` committed `version` to these replicas of `group`: each that has
  // not changed since that epoch now holds it.
  void RecordCommit(const std::string& group, int64_t epoch,
                    const std::vector<std::string>& replicas, int64_t version);
  // Replica -> the last version committed to it whole, of the group's current replicas.
  std::map<std::string, int64_t> ReplicaVersions(const std::string& group) const;
  // The group's trainer side by declared rank, now (no registration copied).
  TrainerRanksView TrainerRanks(const std::string& group) const;

  // The failure detector: declares dead every node silent too long, and returns them; forgets
  // those dead for forget_dead_after.
  std::vector<DeadNode> CheckLiveness();
  bool MarkDead(int32_t node, const std::string& why);

  // A live node's control address, else UNAVAILABLE.
  absl::StatusOr<std::string> ControlAddress(int32_t node) const;
  // Why a node is dead, or not a member (never joined, or forgotten); nullopt while it lives.
  std::optional<std::string> DeathReason(int32_t node) const;
  std::vector<v1::NodeAddress> DataAddresses() const;  // of live nodes
  // `with_pieces`: each worker's buffers with their pieces, decoded for the caller (the planner);
  // without, the rest of each registration only (cheap: what replicas, counts and epochs need).
  GroupMembers Group(const std::string& group, bool with_pieces = true) const;
  // The group's membership epoch (Group()'s, also for no such group), without copying any
  // registration: what a caller holding a plan asks every round.
  int64_t Epoch(const std::string& group) const;
  std::vector<std::string> GroupNames() const;
  void NodeStatuses(v1::StatusResponse* response) const;
  void ListWorkers(const v1::ListWorkersRequest& request, v1::ListWorkersResponse* response) const;
  MembershipCounts Counts() const;
  // Entries of the declaration index, every group and side: what its memory grows with.
  int64_t IndexedDeclarations() const;

 private:
  // A worker as the coordinator keeps it: the registration without its pieces as a
  // message, for everything but planning, and the whole of it (memory handles left out) as the
  // bytes it travels in, which the planner decodes when it plans. A piece costs about 500 bytes
  // as a message and 40 on the wire: a registration of 10^6 pieces held as a message cost the
  // coordinator 12x its size for as long as the worker lived.
  struct StoredWorker {
    v1::RegisterWorkerRequest header;  // buffers without pieces, no memory handles
    // The whole registration, serialized, no memory handles; shared, so that a reader copies it
    // under the lock by reference and decodes it after.
    std::shared_ptr<const std::string> wire;
    int32_t pieces = 0;
    std::string registration;  // AddLocal's: which registration of the name this is
    const std::string& group() const { return header.group(); }
    v1::Role role() const { return header.role(); }
    const v1::Worker& worker() const { return header.worker(); }
  };
  // From a registration checked by CheckRegistration (its worker a valid encoding).
  static StoredWorker Store(const SplitRegistration& registration);
  struct NodeInfo {
    std::string control_address, data_address;
    int64_t incarnation = 0;
    bool alive = false;
    // Its worker list arrived since it last joined at this incarnation (or was revived).
    bool synced = false;
    // JoinRequest.resyncs_seen of the join that last admitted it: a list must carry more.
    int64_t admitted_at_resyncs = 0;
    int64_t applied_sequence = 0;  // of the last list applied at this incarnation
    absl::Time dead_since = absl::InfinitePast();
    std::vector<StoredWorker> workers;
    // Its list when it was declared dead (of sync `stashed_sequence`), out of every group: the
    // node revived at the same incarnation names it in a change instead of sending it again.
    // Kept through another verdict that comes before any list (the node admitted again, then
    // silent again); dropped at a whole list, a restart or when the node is forgotten.
    std::optional<std::vector<StoredWorker>> stashed;
    int64_t stashed_sequence = 0;
  };
  struct ReplicaRecord {
    std::string fingerprint;  // its workers; a change resets the version
    int64_t since_epoch = 0;  // the group epoch at which it last changed
    int64_t version = 0;
  };
  struct GroupInfo {
    int64_t epoch = 0;
    std::string fingerprint;  // membership; a change bumps epoch
    std::map<std::string, ReplicaRecord> replicas;
  };

  absl::StatusOr<bool> AdmitLocked(const v1::JoinRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Room for one more node: OK while below max_nodes, or once the longest-dead node is forgotten.
  absl::Status MakeRoomLocked(int32_t node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why a numbered sync is not applied (nullopt: it is): FAILED_PRECONDITION, or OK to ignore it.
  std::optional<absl::Status> StaleSync(const v1::SyncWorkersRequest& request,
                                        const NodeInfo& n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a dead node's record; it holds no workers, so no group changes.
  void ForgetLocked(int32_t node, absl::string_view why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After every change: epochs, replicas, name holders; groups left without workers forgotten.
  void RecomputeEpochs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The hooks, told of the groups RecomputeEpochs forgot. Called without `mu_`.
  void TellForgotten() ABSL_LOCKS_EXCLUDED(mu_);
  // Why `id` may not join from `node`: another live node holds it (nullopt: it may).
  std::optional<v1::WorkerRefusal> Refusal(const std::string& id, int32_t node) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool MarkDeadLocked(int32_t node, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // One tensor as the live workers of a group's side declare it.
  struct Declared {
    std::string spec;       // its TensorSpec without the name, encoded: what the planner compares
    int64_t declarers = 0;  // live workers declaring it; the entry goes with the last
    std::string holder;     // one of them, for errors ("" once it left: found again when needed)
    int32_t holder_node = -1;
  };
  // Per side (trainers, inference): tensor name -> its declaration.
  struct GroupDeclarations {
    absl::flat_hash_map<std::string, Declared> by_tensor[2];
  };
  // Counts `w`'s declarations (it joins from `node`) into the index, or, when one is a tensor it
  // declares otherwise than its group's side, nothing: the refusal (FAILED_PRECONDITION naming
  // the tensor, both declarations and a worker holding the group's). Costs `w`'s tensors.
  std::optional<v1::WorkerRefusal> Declare(const v1::RegisterWorkerRequest& w, int32_t node)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a leaving worker's declarations out of the index.
  void Undeclare(const v1::RegisterWorkerRequest& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RemoveLocal's work, without recomputing the epochs.
  void RemoveLocalLocked(const std::string& id, const std::string& registration)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `id`'s entries (of `registration`; empty: any) off `n`, undeclared; true when one
  // was large enough to trim the heap for.
  bool RemoveWorkerLocked(NodeInfo& n, const std::string& id, const std::string& registration)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A live worker of `group`'s `side` declaring `tensor`, made `held`'s holder: a scan of the
  // group, only when a refusal must name a holder and the indexed one left.
  void FindHolder(const std::string& group, int side, const std::string& tensor,
                  Declared& held) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Empties a node's worker list, its declarations out of the index.
  void ClearWorkersLocked(NodeInfo& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int32_t self_;
  const absl::Duration silence_;
  const Clock* const clock_;

  mutable absl::Mutex mu_;
  std::map<int32_t, NodeInfo> nodes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, GroupInfo> groups_ ABSL_GUARDED_BY(mu_);
  GroupLimits limits_ ABSL_GUARDED_BY(mu_);
  NodeLimits node_limits_ ABSL_GUARDED_BY(mu_);
  MembershipCounts counts_ ABSL_GUARDED_BY(mu_);
  bool refusing_joins_ ABSL_GUARDED_BY(mu_) = false;  // logged once per stretch of refusals
  struct GroupLoad {
    int64_t workers = 0, buffers = 0, tensors = 0, pieces = 0, bytes = 0;
    void Add(const StoredWorker& w) {
      ++workers;
      buffers += w.worker().buffers_size();
      tensors += w.header.tensors_size();
      pieces += w.pieces;
      bytes += static_cast<int64_t>(w.wire->size());
    }
  };
  // Each group's workers, pieces and encoded bytes on every node but `except` (-1: none).
  std::map<std::string, GroupLoad> LoadExcept(int32_t except) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A refusal when adding `w` to `load` would pass a limit (the caller adds it otherwise).
  std::optional<v1::WorkerRefusal> OverLimit(const StoredWorker& w, const GroupLoad& load) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // a group exists once a worker names it
  // Remote nodes: (incarnation, last heartbeat). A node declared dead leaves it: its next
  // heartbeat takes the slow path and resyncs.
  std::map<int32_t, std::pair<int64_t, absl::Time>> beats_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, std::string> dead_because_ ABSL_GUARDED_BY(mu_);
  int64_t last_epoch_ ABSL_GUARDED_BY(mu_) = 0;                  // every group's epochs
  std::map<std::string, int32_t> holders_ ABSL_GUARDED_BY(mu_);  // worker id -> its live node
  // Group -> the tensors its live workers declare; a group without any has no entry.
  std::map<std::string, GroupDeclarations> declared_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> forgotten_ ABSL_GUARDED_BY(mu_);  // not yet told to the hooks
  std::vector<std::function<void(const std::string&)>> forgotten_hooks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
