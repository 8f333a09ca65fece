#include "plan/planner.h"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "plan/lower.h"
#include "plan/region_set.h"
#include "plan/status_macros.h"
#include "plan/validate.h"

namespace refit {
namespace {

// Pieces of a layout grouped by tensor: pieces_of(t) lists piece indices of tensor t.
struct PiecesByTensor {
  std::vector<int32_t> begin;
  std::vector<int32_t> ids;

  explicit PiecesByTensor(const Layout& layout) : begin(layout.tensors.size() + 1, 0) {
    for (const Piece& p : layout.pieces) ++begin[p.tensor + 1];
    std::partial_sum(begin.begin(), begin.end(), begin.begin());
    ids.resize(layout.pieces.size());
    std::vector<int32_t> next(begin.begin(), begin.end() - 1);
    for (size_t i = 0; i < layout.pieces.size(); ++i) {
      ids[next[layout.pieces[i].tensor]++] = static_cast<int32_t>(i);
    }
  }
  std::span<const int32_t> of(int32_t tensor) const {
    return {ids.data() + begin[tensor], static_cast<size_t>(begin[tensor + 1] - begin[tensor])};
  }
};

// Volume of the union of boxes (small lists: the destination nodes that need one region).
int64_t UnionVolume(const std::vector<Box>& boxes) {
  std::vector<Box> disjoint;
  for (const Box& b : boxes) {
    std::vector<Box> parts = {b};
    for (const Box& u : disjoint) {
      std::vector<Box> rest;
      for (const Box& p : parts) {
        for (const Box& q : Subtract(p, u)) rest.push_back(q);
      }
      parts = std::move(rest);
      if (parts.empty()) break;
    }
    disjoint.insert(disjoint.end(), parts.begin(), parts.end());
  }
  int64_t v = 0;
  for (const Box& b : disjoint) v += b.NumElements();
  return v;
}

class Planner {
 public:
  Planner(const Layout& src, const Layout& dst, const PlanOptions& options)
      : src_(src), dst_(dst), opt_(options), topo_(options.topology) {}

  absl::StatusOr<Plan> Run();

 private:
  int32_t GpuId(const Worker& w);
  int32_t NodeId(int32_t node);
  absl::Status PlanTensor(int32_t dst_tensor, const PiecesByTensor& src_by_tensor,
                          const PiecesByTensor& dst_by_tensor);
  absl::Status CoverageError(int32_t dst_tensor, const Box& need, int32_t dst_piece,
                             int64_t covered) const;
  void Route(const Box& x, std::span<const int32_t> needers, std::span<const int32_t> holders,
             int32_t node);
  int32_t LeastSendingSource(std::span<const int32_t> holders, LinkClass link) const;
  void Emit(const Box& x, int32_t from_piece, bool from_destination, int32_t to_piece,
            uint8_t stage);
  void BuildMessages();
  void ComputeCost();

  const Layout& src_;
  const Layout& dst_;
  const PlanOptions& opt_;
  const Topology& topo_;
  Plan plan_;

  absl::flat_hash_map<int64_t, int32_t> gpu_ids_;
  absl::flat_hash_map<int32_t, int32_t> node_ids_;
  std::vector<int32_t> gpu_node_;  // dense node id of each GPU
  std::vector<int32_t> gpu_nic_;   // dense NIC id of each GPU
  std::vector<int32_t> src_piece_gpu_, dst_piece_gpu_;
  int32_t num_nics_ = 0;

  // Loads, in wire bytes.
  std::vector<int64_t> nic_send_, nic_recv_, nvl_send_, nvl_recv_, local_;
  // Lower-bound accounting.
  std::vector<int64_t> node_net_need_, node_unique_out_, gpu_remote_need_, gpu_total_need_;

  struct Bucket {
    uint8_t stage;
    int32_t src_gpu, dst_gpu;
    LinkClass link;
    std::vector<CopyDescriptor> descriptors;
  };
  absl::flat_hash_map<uint64_t, int32_t> bucket_of_;
  std::vector<Bucket> buckets_;

  // Scratch reused across tensors.
  RegionSet src_regions_, need_regions_;
  std::vector<std::pair<Box, int32_t>> items_;
  std::vector<int32_t> remaining_, by_node_, seen_gpus_;
  std::vector<char> region_single_node_;
  std::vector<int32_t> region_node_;
  std::vector<std::vector<Box>> region_needed_elsewhere_;
  int64_t wire_elem_bytes_ = 0;
  int64_t stage1_max_bytes_ = 0;
};

int32_t Planner::NodeId(int32_t node) {
  auto [it, added] = node_ids_.emplace(node, static_cast<int32_t>(node_ids_.size()));
  return it->second;
}

int32_t Planner::GpuId(const Worker& w) {
  const int64_t key = (int64_t{w.node} << 32) | static_cast<uint32_t>(w.gpu);
  auto [it, added] = gpu_ids_.emplace(key, static_cast<int32_t>(plan_.gpus.size()));
  if (added) {
    plan_.gpus.push_back({w.node, w.gpu});
    gpu_node_.push_back(NodeId(w.node));
  }
  return it->second;
}

absl::StatusOr<Plan> Planner::Run() {
  const auto start = std::chrono::steady_clock::now();
  if (src_.tensor_index.size() != src_.tensors.size() ||
      dst_.tensor_index.size() != dst_.tensors.size()) {
    return absl::FailedPreconditionError("MakePlan: both layouts must pass ValidateLayout first");
  }
  REFIT_RETURN_IF_ERROR(ValidatePair(src_, dst_));
  if (opt_.max_message_bytes <= 0) {
    return absl::InvalidArgumentError("max_message_bytes must be positive");
  }
  if (topo_.gpus_per_node <= 0 || topo_.nics_per_node <= 0 || topo_.nic_gbps <= 0 ||
      topo_.nvlink_gbps <= 0 || topo_.local_copy_gbps <= 0) {
    return absl::InvalidArgumentError(
        "topology: gpus_per_node, nics_per_node and every bandwidth must be positive");
  }

  src_piece_gpu_.resize(src_.pieces.size());
  for (size_t i = 0; i < src_.pieces.size(); ++i) {
    src_piece_gpu_[i] = GpuId(src_.worker_of(src_.pieces[i]));
  }
  dst_piece_gpu_.resize(dst_.pieces.size());
  for (size_t i = 0; i < dst_.pieces.size(); ++i) {
    dst_piece_gpu_[i] = GpuId(dst_.worker_of(dst_.pieces[i]));
  }
  absl::flat_hash_map<int64_t, int32_t> nic_ids;
  for (const PlanGpu& g : plan_.gpus) {
    const int64_t key = (int64_t{g.node} << 32) | static_cast<uint32_t>(topo_.NicOf(g.gpu));
    gpu_nic_.push_back(nic_ids.emplace(key, static_cast<int32_t>(nic_ids.size())).first->second);
  }
  num_nics_ = static_cast<int32_t>(nic_ids.size());
  const size_t G = plan_.gpus.size();
  nic_send_.assign(num_nics_, 0);
  nic_recv_.assign(num_nics_, 0);
  nvl_send_.assign(G, 0);
  nvl_recv_.assign(G, 0);
  local_.assign(G, 0);
  gpu_remote_need_.assign(G, 0);
  gpu_total_need_.assign(G, 0);
  node_net_need_.assign(node_ids_.size(), 0);
  node_unique_out_.assign(node_ids_.size(), 0);

  const PiecesByTensor src_by_tensor(src_), dst_by_tensor(dst_);
  for (size_t t = 0; t < dst_.tensors.size(); ++t) {
    if (dst_by_tensor.of(static_cast<int32_t>(t)).empty()) continue;
    REFIT_RETURN_IF_ERROR(PlanTensor(static_cast<int32_t>(t), src_by_tensor, dst_by_tensor));
    ++plan_.stats.tensors;
  }
  plan_.stats.pieces = static_cast<int64_t>(src_.pieces.size() + dst_.pieces.size());
  BuildMessages();
  ComputeCost();
  plan_.stats.planning_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return std::move(plan_);
}

absl::Status Planner::PlanTensor(int32_t dst_tensor, const PiecesByTensor& src_by_tensor,
                                 const PiecesByTensor& dst_by_tensor) {
  const LogicalTensor& dt = dst_.tensors[dst_tensor];
  const int32_t src_tensor = src_.tensor_index.at(dt.name);
  wire_elem_bytes_ =
      std::min(DTypeSize(dt.dtype), DTypeSize(src_.tensors[src_tensor].dtype));

  // Match: index the source regions of this tensor.
  items_.clear();
  for (int32_t p : src_by_tensor.of(src_tensor)) items_.push_back({src_.pieces[p].tensor_box, p});
  src_regions_.Build(items_);
  region_single_node_.assign(src_regions_.size(), 1);
  region_node_.assign(src_regions_.size(), -1);
  if (region_needed_elsewhere_.size() < src_regions_.size()) {
    region_needed_elsewhere_.resize(src_regions_.size());
  }
  for (size_t s = 0; s < src_regions_.size(); ++s) {
    region_needed_elsewhere_[s].clear();
    for (int32_t p : src_regions_.owners(s)) {
      const int32_t node = gpu_node_[src_piece_gpu_[p]];
      if (region_node_[s] == -1) region_node_[s] = node;
      if (region_node_[s] != node) region_single_node_[s] = 0;
    }
  }

  // Destination pieces of this tensor, node by node.
  by_node_.assign(dst_by_tensor.of(dst_tensor).begin(), dst_by_tensor.of(dst_tensor).end());
  std::stable_sort(by_node_.begin(), by_node_.end(), [&](int32_t a, int32_t b) {
    return gpu_node_[dst_piece_gpu_[a]] < gpu_node_[dst_piece_gpu_[b]];
  });
  for (size_t i = 0; i < by_node_.size();) {
    const int32_t node = gpu_node_[dst_piece_gpu_[by_node_[i]]];
    size_t j = i;
    items_.clear();
    for (; j < by_node_.size() && gpu_node_[dst_piece_gpu_[by_node_[j]]] == node; ++j) {
      items_.push_back({dst_.pieces[by_node_[j]].tensor_box, by_node_[j]});
    }
    i = j;
    need_regions_.Build(items_);
    for (size_t r = 0; r < need_regions_.size(); ++r) {
      const Box& need = need_regions_.box(r);
      int64_t covered = 0;
      src_regions_.ForEachIntersecting(need, [&](size_t s) {
        const Box x = Intersect(need, src_regions_.box(s));
        covered += x.NumElements();
        Route(x, need_regions_.owners(r), src_regions_.owners(s), node);
        if (region_single_node_[s] && region_node_[s] != node) {
          region_needed_elsewhere_[s].push_back(x);
        }
      });
      if (covered != need.NumElements()) {
        return CoverageError(dst_tensor, need, need_regions_.owners(r)[0], covered);
      }
    }
  }
  for (size_t s = 0; s < src_regions_.size(); ++s) {
    if (!region_single_node_[s] || region_needed_elsewhere_[s].empty()) continue;
    node_unique_out_[region_node_[s]] +=
        UnionVolume(region_needed_elsewhere_[s]) * wire_elem_bytes_;
  }
  return absl::OkStatus();
}

absl::Status Planner::CoverageError(int32_t dst_tensor, const Box& need, int32_t dst_piece,
                                    int64_t covered) const {
  std::vector<Box> missing = {need};
  src_regions_.ForEachIntersecting(need, [&](size_t s) {
    std::vector<Box> rest;
    for (const Box& m : missing) {
      for (const Box& part : Subtract(m, src_regions_.box(s))) rest.push_back(part);
    }
    missing = std::move(rest);
  });
  const int64_t total = need.NumElements();
  return absl::InvalidArgumentError(absl::StrCat(
      "destination ", DescribePiece(dst_, dst_piece), ": ", total - covered, " of ", total,
      " elements of region ", need.ToString(), " have no source in the source layout (",
      missing.size(), " uncovered boxes, e.g. ", missing.empty() ? "?" : missing[0].ToString(),
      "); the source layout has ", src_regions_.size(), " distinct boxes of tensor \"",
      dst_.tensors[dst_tensor].name, "\""));
}

int32_t Planner::LeastSendingSource(std::span<const int32_t> holders, LinkClass link) const {
  int32_t best = holders[0];
  int64_t best_load = INT64_MAX;
  for (int32_t c : holders) {
    const int32_t g = src_piece_gpu_[c];
    const int64_t load = link == LinkClass::kNetwork ? nic_send_[gpu_nic_[g]] : nvl_send_[g];
    if (load < best_load) best = c, best_load = load;
  }
  return best;
}

void Planner::Route(const Box& x, std::span<const int32_t> needers,
                    std::span<const int32_t> holders, int32_t node) {
  const int64_t bytes = x.NumElements() * wire_elem_bytes_;
  // Lower-bound accounting: what this node and each of its GPUs must receive.
  bool node_has_it = false;
  for (int32_t c : holders) node_has_it |= gpu_node_[src_piece_gpu_[c]] == node;
  if (!node_has_it) node_net_need_[node] += bytes;

  remaining_.clear();
  seen_gpus_.clear();
  for (int32_t h : needers) {
    const int32_t g = dst_piece_gpu_[h];
    int32_t local = -1;
    for (int32_t c : holders) {
      if (src_piece_gpu_[c] == g) {
        local = c;
        break;
      }
    }
    // Every needing piece is written; a GPU receives what it lacks at least once.
    gpu_total_need_[g] += bytes;
    if (local < 0 && std::find(seen_gpus_.begin(), seen_gpus_.end(), g) == seen_gpus_.end()) {
      gpu_remote_need_[g] += bytes;
      seen_gpus_.push_back(g);
    }
    if (local >= 0) {
      Emit(x, local, false, h, 0);
    } else {
      remaining_.push_back(h);
    }
  }
  if (remaining_.empty()) return;

  if (node_has_it) {
    std::vector<int32_t> same_node;
    for (int32_t c : holders) {
      if (gpu_node_[src_piece_gpu_[c]] == node) same_node.push_back(c);
    }
    for (int32_t h : remaining_) Emit(x, LeastSendingSource(same_node, LinkClass::kNvlink), false, h, 0);
    return;
  }
  if (!opt_.routing) {
    for (int32_t h : remaining_) {
      Emit(x, LeastSendingSource(holders, LinkClass::kNetwork), false, h, 0);
    }
    return;
  }
  // Network once: land on the needing GPU whose NIC has received least, fan out from there.
  int32_t landing = remaining_[0];
  for (int32_t h : remaining_) {
    if (nic_recv_[gpu_nic_[dst_piece_gpu_[h]]] < nic_recv_[gpu_nic_[dst_piece_gpu_[landing]]]) {
      landing = h;
    }
  }
  Emit(x, LeastSendingSource(holders, LinkClass::kNetwork), false, landing, 0);
  for (int32_t h : remaining_) {
    if (h != landing) Emit(x, landing, true, h, 1);
  }
}

void Planner::Emit(const Box& x, int32_t from_piece, bool from_destination, int32_t to_piece,
                   uint8_t stage) {
  const Layout& from_layout = from_destination ? dst_ : src_;
  const Piece& from = from_layout.pieces[from_piece];
  const Piece& to = dst_.pieces[to_piece];
  const int32_t from_gpu =
      from_destination ? dst_piece_gpu_[from_piece] : src_piece_gpu_[from_piece];
  const int32_t to_gpu = dst_piece_gpu_[to_piece];
  const int64_t bytes = x.NumElements() * wire_elem_bytes_;
  LinkClass link = LinkClass::kLocal;
  if (gpu_node_[from_gpu] != gpu_node_[to_gpu]) {
    link = LinkClass::kNetwork;
    nic_send_[gpu_nic_[from_gpu]] += bytes;
    nic_recv_[gpu_nic_[to_gpu]] += bytes;
    plan_.stats.bytes_network += bytes;
  } else if (from_gpu != to_gpu) {
    link = LinkClass::kNvlink;
    nvl_send_[from_gpu] += bytes;
    nvl_recv_[to_gpu] += bytes;
    plan_.stats.bytes_nvlink += bytes;
  } else {
    local_[to_gpu] += bytes;
    plan_.stats.bytes_local += bytes;
  }
  if (stage == 1) plan_.stats.bytes_forwarded += bytes;
  plan_.stats.bytes_total += bytes;
  ++plan_.stats.transfers;

  const Buffer& from_buffer = from_layout.buffers[from.buffer];
  const Buffer& to_buffer = dst_.buffers[to.buffer];
  // Validated layouts: every piece has a view.
  const CopyEnd from_end{&from.tensor_box, *ViewOf(from.tensor_box, from.buffer_box, from_buffer.shape),
                         from.buffer, from_buffer.dtype};
  const CopyEnd to_end{&to.tensor_box, *ViewOf(to.tensor_box, to.buffer_box, to_buffer.shape),
                       to.buffer, to_buffer.dtype};
  const uint64_t key = (uint64_t{stage} << 62) | (uint64_t(uint32_t(from_gpu)) << 31) |
                       uint64_t(uint32_t(to_gpu));
  auto [it, added] = bucket_of_.emplace(key, static_cast<int32_t>(buckets_.size()));
  if (added) buckets_.push_back({stage, from_gpu, to_gpu, link, {}});
  LowerCopy(x, from_end, to_end, from_destination, buckets_[it->second].descriptors);
}

void Planner::BuildMessages() {
  std::sort(buckets_.begin(), buckets_.end(), [](const Bucket& a, const Bucket& b) {
    return std::tie(a.stage, a.src_gpu, a.dst_gpu) < std::tie(b.stage, b.src_gpu, b.dst_gpu);
  });
  size_t total = 0;
  for (const Bucket& b : buckets_) total += b.descriptors.size();
  plan_.descriptors.reserve(total);
  std::vector<CopyDescriptor> parts;
  for (Bucket& b : buckets_) {
    Message m{b.src_gpu, b.dst_gpu, b.stage, b.link, 0,
              static_cast<int64_t>(plan_.descriptors.size()), 0};
    auto close = [&] {
      if (m.num_descriptors == 0) return;
      if (m.stage == 1) stage1_max_bytes_ = std::max(stage1_max_bytes_, m.bytes);
      plan_.messages.push_back(m);
      m.first_descriptor = static_cast<int64_t>(plan_.descriptors.size());
      m.num_descriptors = 0;
      m.bytes = 0;
    };
    for (const CopyDescriptor& d : b.descriptors) {
      parts.clear();
      SplitDescriptor(d, opt_.max_message_bytes, parts);
      for (const CopyDescriptor& part : parts) {
        const int64_t bytes = part.WireBytes();
        if (m.bytes + bytes > opt_.max_message_bytes) close();
        plan_.descriptors.push_back(part);
        m.bytes += bytes;
        ++m.num_descriptors;
      }
    }
    close();
    std::vector<CopyDescriptor>().swap(b.descriptors);  // release as we go: bounds peak memory
  }
  plan_.stats.descriptors = static_cast<int64_t>(plan_.descriptors.size());
  plan_.stats.messages = static_cast<int64_t>(plan_.messages.size());
}

void Planner::ComputeCost() {
  const double nic = topo_.nic_gbps * 1e9, nvl = topo_.nvlink_gbps * 1e9,
               hbm = topo_.local_copy_gbps * 1e9;
  double busiest = 0;
  for (int32_t n = 0; n < num_nics_; ++n) {
    plan_.stats.max_nic_bytes = std::max({plan_.stats.max_nic_bytes, nic_send_[n], nic_recv_[n]});
    busiest = std::max(busiest, std::max(nic_send_[n], nic_recv_[n]) / nic);
  }
  for (size_t g = 0; g < plan_.gpus.size(); ++g) {
    busiest = std::max({busiest, std::max(nvl_send_[g], nvl_recv_[g]) / nvl, local_[g] / hbm});
  }
  // Links work in parallel and messages pipeline: the busiest resource sets the pace, plus one
  // message latency to fill the pipe and the last forwarded message's NVLink hop.
  double latency = 0;
  if (plan_.stats.bytes_network > 0) {
    latency = topo_.network_latency_us * 1e-6;
  } else if (plan_.stats.bytes_nvlink > 0) {
    latency = topo_.nvlink_latency_us * 1e-6;
  }
  plan_.stats.predicted_seconds = busiest + latency + stage1_max_bytes_ / nvl;

  // The lower bound: bytes a node lacks must enter through its NICs; bytes only one node holds
  // must leave through its NICs; bytes a GPU lacks must enter through its NVLink and NIC; every
  // byte a GPU needs must be written to its memory.
  // Data moves between the GPUs of the two layouts, so a node's usable NICs are its
  // participating GPUs' NICs.
  std::vector<std::vector<int32_t>> node_nics(node_net_need_.size());
  for (size_t g = 0; g < plan_.gpus.size(); ++g) {
    auto& nics = node_nics[gpu_node_[g]];
    if (std::find(nics.begin(), nics.end(), gpu_nic_[g]) == nics.end()) nics.push_back(gpu_nic_[g]);
  }
  double bound = 0;
  for (size_t n = 0; n < node_net_need_.size(); ++n) {
    const double node_nic = static_cast<double>(node_nics[n].size()) * nic;
    bound = std::max({bound, node_net_need_[n] / node_nic, node_unique_out_[n] / node_nic});
  }
  for (size_t g = 0; g < plan_.gpus.size(); ++g) {
    bound = std::max({bound, gpu_remote_need_[g] / (nvl + nic), gpu_total_need_[g] / (2 * hbm)});
  }
  double floor_latency = 0;
  for (int64_t need : node_net_need_) {
    if (need > 0) floor_latency = topo_.network_latency_us * 1e-6;
  }
  plan_.stats.lower_bound_seconds = bound + floor_latency;
}

}  // namespace

absl::StatusOr<Plan> MakePlan(const Layout& source, const Layout& destination,
                              const PlanOptions& options) {
  return Planner(source, destination, options).Run();
}

}  // namespace refit
