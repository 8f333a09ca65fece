// The coordinator's view of the cluster: its nodes (addresses, incarnation, liveness, their
// workers) and, per model group, the membership epoch (bumped whenever the set of its workers
// changes). Liveness comes from heartbeats, judged on an injected clock: a node silent for
// `heartbeat * heartbeats_missed` is dead (CheckLiveness).
//
// Lock: `mu_` guards everything here; nothing is called out of it while it is held.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/clock.h"
#include "proto/refit.pb.h"

namespace refit {

// One group's members at one epoch, as the planner needs them.
struct GroupMembers {
  bool exists = false;
  int64_t epoch = 0;
  // Alive nodes' workers of the group, by node then in registration order.
  std::vector<std::pair<int32_t, v1::RegisterWorkerRequest>> workers;
  std::vector<int32_t> nodes;  // nodes with workers of the group, ascending
  int trainers = 0, inference = 0;
};

struct DeadNode {
  int32_t node;
  std::string why;
};

class Membership {
 public:
  Membership(int32_t self, absl::Duration heartbeat, int heartbeats_missed, const Clock* clock);

  // This node (the coordinator): alive from the start, never judged by heartbeats.
  void SetSelf(const std::string& control_address, const std::string& data_address, int64_t incarnation);
  // A join or heartbeat; true when the node must send its whole worker list (new, restarted, or
  // declared dead since).
  bool Join(const v1::JoinRequest& request);
  // A node's whole worker list.
  void ApplySync(const v1::SyncWorkersRequest& request);
  // The coordinator's own workers, one at a time (a snapshot per registration would make
  // registering n workers O(n^2)).
  void AddLocal(const v1::RegisterWorkerRequest& worker);
  void RemoveLocal(const std::string& id);

  // The failure detector: declares dead every node silent too long, and returns them.
  std::vector<DeadNode> CheckLiveness();
  bool MarkDead(int32_t node, const std::string& why);

  // A live node's control address, else UNAVAILABLE.
  absl::StatusOr<std::string> ControlAddress(int32_t node) const;
  // Why a node is dead (or unknown), if it was declared dead; nullopt while it lives.
  std::optional<std::string> DeathReason(int32_t node) const;
  std::vector<v1::NodeAddress> DataAddresses() const;  // of live nodes
  GroupMembers Group(const std::string& group) const;
  std::vector<std::string> GroupNames() const;
  void NodeStatuses(v1::StatusResponse* response) const;
  void ListWorkers(const v1::ListWorkersRequest& request, v1::ListWorkersResponse* response) const;

 private:
  struct NodeInfo {
    std::string control_address, data_address;
    int64_t incarnation = 0;
    bool alive = false;
    std::vector<v1::RegisterWorkerRequest> workers;
  };
  struct GroupInfo {
    int64_t epoch = 0;
    std::string fingerprint;  // membership; a change bumps epoch
  };

  void RecomputeEpochs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool MarkDeadLocked(int32_t node, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int32_t self_;
  const absl::Duration silence_;
  const Clock* const clock_;

  mutable absl::Mutex mu_;
  std::map<int32_t, NodeInfo> nodes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, GroupInfo> groups_ ABSL_GUARDED_BY(mu_);  // a group exists once a worker names it
  // Remote nodes: (incarnation, last heartbeat). A node declared dead leaves it: its next
  // heartbeat takes the slow path and resyncs.
  std::map<int32_t, std::pair<int64_t, absl::Time>> beats_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, std::string> dead_because_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
