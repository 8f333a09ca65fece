#include "daemon/membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/logging.h"
#include "plan/dtype.h"

namespace refit {

Membership::Membership(int32_t self, absl::Duration heartbeat, int heartbeats_missed, const Clock* clock)
    : self_(self), silence_(heartbeat * heartbeats_missed), clock_(clock) {}

void Membership::SetSelf(const std::string& control_address, const std::string& data_address,
                         int64_t incarnation) {
  absl::MutexLock lock(&mu_);
  NodeInfo& me = nodes_[self_];
  me.control_address = control_address;
  me.data_address = data_address;
  me.incarnation = incarnation;
  me.alive = true;
}

bool Membership::Join(const v1::JoinRequest& request) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  // The common case, a heartbeat from a known, live daemon.
  if (auto it = beats_.find(request.node()); it != beats_.end() && it->second.first == request.incarnation()) {
    it->second.second = now;
    return false;
  }
  NodeInfo& n = nodes_[request.node()];
  beats_[request.node()] = {request.incarnation(), now};
  bool resync = false;
  if (n.incarnation != request.incarnation() || !n.alive) {
    if (n.incarnation != 0 && n.incarnation != request.incarnation()) {
      Logger("rpc")->warn("node {} restarted; its old workers are gone", request.node());
    }
    n.workers.clear();
    n.incarnation = request.incarnation();
    resync = true;
  }
  n.control_address = request.control_address();
  n.data_address = request.data_address();
  n.alive = true;
  RecomputeEpochs();
  return resync;
}

void Membership::ApplySync(const v1::SyncWorkersRequest& request) {
  absl::MutexLock lock(&mu_);
  NodeInfo& n = nodes_[request.node()];
  n.incarnation = request.incarnation();
  n.workers.assign(request.workers().begin(), request.workers().end());
  n.alive = true;
  if (request.node() != self_) beats_[request.node()] = {request.incarnation(), clock_->Now()};
  for (const auto& w : n.workers) groups_[w.group()];
  RecomputeEpochs();
}

void Membership::AddLocal(const v1::RegisterWorkerRequest& worker) {
  absl::MutexLock lock(&mu_);
  auto& mine = nodes_[self_].workers;
  mine.push_back(worker);
  mine.back().clear_memory();  // handles stay on this node
  mine.back().clear_vmm_ranges();
  mine.back().clear_fd_token();
  groups_[worker.group()];
  RecomputeEpochs();
}

void Membership::RemoveLocal(const std::string& id) {
  absl::MutexLock lock(&mu_);
  std::erase_if(nodes_[self_].workers, [&](const v1::RegisterWorkerRequest& r) {
    return absl::StrCat(r.group(), "/", r.worker().name()) == id;
  });
  RecomputeEpochs();
}

void Membership::RecomputeEpochs() {
  std::map<std::string, std::vector<std::string>> members;
  for (const auto& [node, info] : nodes_) {
    if (!info.alive) continue;
    for (const auto& w : info.workers) {
      members[w.group()].push_back(absl::StrCat(node, ":", info.incarnation, ":", w.worker().name(), ":", w.role()));
    }
  }
  for (auto& [name, g] : groups_) {
    auto& m = members[name];
    std::sort(m.begin(), m.end());
    std::string fingerprint = absl::StrJoin(m, ",");
    if (fingerprint != g.fingerprint) {
      g.fingerprint = std::move(fingerprint);
      ++g.epoch;
    }
  }
}

bool Membership::MarkDeadLocked(int32_t node, const std::string& why) {
  auto it = nodes_.find(node);
  if (it == nodes_.end() || !it->second.alive) return false;
  it->second.alive = false;
  it->second.workers.clear();
  beats_.erase(node);  // its next heartbeat takes the slow path and resyncs
  Logger("rpc")->warn("node {} ({}) is dead: {}", node, it->second.control_address, why);
  dead_because_[node] = why;
  RecomputeEpochs();
  return true;
}

bool Membership::MarkDead(int32_t node, const std::string& why) {
  absl::MutexLock lock(&mu_);
  return MarkDeadLocked(node, why);
}

std::vector<DeadNode> Membership::CheckLiveness() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  std::vector<int32_t> silent;
  for (const auto& [node, seen] : beats_) {
    if (now - seen.second > silence_) silent.push_back(node);
  }
  std::vector<DeadNode> dead;
  const std::string why = absl::StrCat("no heartbeat for ", absl::FormatDuration(silence_));
  for (int32_t node : silent) {
    if (MarkDeadLocked(node, why)) dead.push_back({node, why});
  }
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
  absl::MutexLock lock(&mu_);
  auto dead = dead_because_.find(node);
  if (dead == dead_because_.end()) return std::nullopt;
  auto it = nodes_.find(node);
  if (it != nodes_.end() && it->second.alive) return std::nullopt;
  return dead->second;
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

GroupMembers Membership::Group(const std::string& group) const {
  absl::MutexLock lock(&mu_);
  GroupMembers out;
  auto g = groups_.find(group);
  if (g == groups_.end()) return out;
  out.exists = true;
  out.epoch = g->second.epoch;
  for (const auto& [node, info] : nodes_) {
    if (!info.alive) continue;
    bool here = false;
    for (const auto& w : info.workers) {
      if (w.group() != group) continue;
      out.workers.emplace_back(node, w);
      (w.role() == v1::TRAINER ? out.trainers : out.inference)++;
      here = true;
    }
    if (here) out.nodes.push_back(node);
  }
  return out;
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

void Membership::ListWorkers(const v1::ListWorkersRequest& request, v1::ListWorkersResponse* response) const {
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
      for (const auto& b : w.worker().buffers()) {
        pieces += b.pieces_size();
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
