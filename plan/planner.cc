#include "plan/planner.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <numeric>
#include <optional>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "plan/huge_pages.h"
#include "plan/lower.h"
#include "plan/message_cutter.h"
#include "plan/region_set.h"
#include "plan/status_macros.h"
#include "plan/transfer_lowering.h"
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

// Disjoint boxes covering the union of `boxes` (small lists: quadratic).
std::vector<Box> Disjoint(const std::vector<Box>& boxes) {
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
  return disjoint;
}

// One tensor's network landings (relay candidates), by box: each box's latest landing, chained to
// its earlier ones. Boxes are named by small ids (the tensor's distinct intersections), so
// routing looks a landing up without hashing a box.
class Landings {
 public:
  struct Landing {
    int32_t piece;  // destination piece that holds the region
    int32_t node;
    uint8_t stage;  // stage of the transfer that lands it
    int32_t next;   // the previous landing of the same box, or -1
  };

  void Clear(size_t boxes) {
    landings_.clear();
    latest_.assign(boxes, -1);
  }
  // The latest landing of box `id`, or -1.
  int32_t Latest(int32_t id) const {
    return id < static_cast<int32_t>(latest_.size()) ? latest_[id] : -1;
  }
  void Add(int32_t id, int32_t piece, int32_t node, uint8_t stage) {
    if (id >= static_cast<int32_t>(latest_.size())) latest_.resize(id + 1, -1);
    landings_.push_back({piece, node, stage, latest_[id]});
    latest_[id] = static_cast<int32_t>(landings_.size() - 1);
  }
  const Landing& operator[](int32_t landing) const { return landings_[landing]; }

 private:
  std::vector<Landing> landings_;
  std::vector<int32_t> latest_;
};

// The lower bound's unions repeat: the experts of a model are sliced alike, so the boxes other
// nodes need of one expert are the same list as of the previous expert of that kind. Remembers
// the last few lists and their volumes (UnionVolume sorts and sweeps every time).
class UnionVolumeMemo {
 public:
  int64_t Volume(const std::vector<Box>& boxes) {
    for (const Entry& e : entries_) {
      if (e.boxes == boxes) return e.volume;
    }
    Entry& e = entries_[next_++ % entries_.size()];
    e.boxes = boxes;
    e.volume = UnionVolume(boxes);
    return e.volume;
  }

 private:
  struct Entry {
    std::vector<Box> boxes;
    int64_t volume = 0;
  };
  std::array<Entry, 8> entries_;  // a model's few kinds of matrices
  size_t next_ = 0;
};

// How one tensor's pieces match: its source regions, and in order, every (need region, source
// region) intersection routing visits. Pieces are named by position (the k-th source or
// destination piece of the tensor), not by id: tensors whose pieces have the same boxes on the
// same destination nodes (a model's experts, layer after layer) match alike, so the match is made
// once per kind and only the routing, which depends on the links' loads, runs per tensor. Piece
// ids grow with positions, so ordering by either is the same and the plan does not change.
struct TensorMatch {
  std::vector<int32_t> key;  // source pieces' boxes; destination pieces' boxes and nodes
  std::vector<int32_t> region_owner_begin, region_owners;  // source regions: source positions
  std::vector<int32_t> needers;  // destination positions, a run per need region
  struct Step {
    Box x;         // need region ∩ source region
    int32_t x_id;  // equal boxes, equal ids: dense from 0
    int32_t node;
    int32_t region;
    int32_t needers_begin, needers_end;
  };
  std::vector<Step> steps;
  int32_t distinct_boxes = 0;
  // Steps by source region: steps[region_steps[i]] for i in [region_step_begin[s], ..[s + 1]).
  std::vector<int32_t> region_step_begin, region_steps;
  // Per source region, for the lower bound: the union of its steps' boxes, and their nodes.
  std::vector<int64_t> needed_volume;
  std::vector<std::vector<int32_t>> needed_nodes;
};

class Planner {
 public:
  Planner(const Layout& src, const Layout& dst, const PlanOptions& options)
      : src_(src), dst_(dst), opt_(options), topo_(options.topology) {}

  absl::StatusOr<Plan> Run();

 private:
  absl::Status RouteTensors();
  int32_t GpuId(const Worker& w);
  int32_t NodeId(int32_t node);
  absl::Status PlanTensor(int32_t dst_tensor, int32_t src_tensor,
                          const PiecesByTensor& src_by_tensor, const PiecesByTensor& dst_by_tensor);
  // The match of a tensor whose pieces are `src_pieces` and `dst_pieces`: a kept one when an
  // earlier tensor's pieces had the same boxes and nodes. A coverage error names the tensor.
  absl::StatusOr<const TensorMatch*> MatchOf(int32_t dst_tensor,
                                             std::span<const int32_t> src_pieces,
                                             std::span<const int32_t> dst_pieces);
  absl::Status BuildMatch(int32_t dst_tensor, std::span<const int32_t> src_pieces,
                          std::span<const int32_t> dst_pieces, TensorMatch& match);
  void RouteMatch(const TensorMatch& match, std::span<const int32_t> src_pieces,
                  std::span<const int32_t> dst_pieces);
  // A destination part no source region covers: in quantizing modes, a part of blocks that no
  // source piece holds whole (the block rule's gathering), else a coverage error.
  struct Missing {
    Box box;        // element coordinates of the quantized tensor
    int32_t piece;  // the destination piece that needs it
  };
  // The matching loop of PlanTensor over the sources in items_: routes every destination piece
  // of `dst_tensor`; uncovered parts go to `missing` (nullptr: an error).
  absl::Status PlanNeeds(int32_t dst_tensor, std::span<const int32_t> dst_pieces,
                         std::vector<Missing>* missing);
  void IndexSources();
  void CountUniqueOut();
  absl::Status PlanQuantized(int32_t dst_tensor, const PiecesByTensor& src_by_tensor,
                             const PiecesByTensor& dst_by_tensor);
  absl::Status GatherAndQuantize(int32_t w, std::span<const int32_t> src_pieces,
                                 const std::vector<Missing>& missing);
  absl::Status CoverageError(int32_t dst_tensor, const Box& need, int32_t dst_piece,
                             int64_t covered) const;
  // Routes `x` (id `x_id` among this tensor's boxes) from `holders` to `needers` on `node`.
  void Route(const Box& x, int32_t x_id, std::span<const int32_t> needers,
             std::span<const int32_t> holders, int32_t node);
  // This tensor's id of `box` (box_ids_).
  int32_t BoxId(const Box& box) {
    return box_ids_.try_emplace(box, static_cast<int32_t>(box_ids_.size())).first->second;
  }
  absl::flat_hash_map<Box, int32_t, BoxHash> box_ids_;
  int32_t LeastSendingSource(std::span<const int32_t> holders, LinkClass link) const;
  // Accounts the transfer of `x` (the lowerer's box `x_box`) and hands it to the lowerer.
  void Emit(const Box& x, int32_t x_box, int32_t from_piece, bool from_destination,
            int32_t to_piece, uint8_t stage);
  // Counts `bytes` on the link from_gpu -> to_gpu and returns the descriptors' group.
  int32_t Account(int32_t from_gpu, int32_t to_gpu, int64_t bytes, int64_t before_bytes,
                  uint8_t stage);
  // lowered_ into plan_.descriptors, cut to fit messages: for what is lowered here, not by the
  // lowerer (which must be drained first, to keep the descriptors in order).
  void Append(int32_t group);
  void BuildMessages();
  void ComputeCost();

  const Layout& src_;
  const Layout& dst_;
  const PlanOptions& opt_;
  const Topology& topo_;
  Plan plan_;
  std::optional<TransferLowerer> lowerer_;  // appends to plan_.descriptors: declared after it
  int32_t threads_ = 1;

  absl::flat_hash_map<int64_t, int32_t> gpu_ids_;
  absl::flat_hash_map<int32_t, int32_t> node_ids_;
  std::vector<int32_t> gpu_node_;  // dense node id of each GPU
  std::vector<int32_t> gpu_nic_;   // dense NIC id of each GPU
  std::vector<int32_t> src_buffer_gpu_, dst_buffer_gpu_;
  int32_t SrcGpu(int32_t piece) const { return src_buffer_gpu_[src_.pieces[piece].buffer]; }
  int32_t DstGpu(int32_t piece) const { return dst_buffer_gpu_[dst_.pieces[piece].buffer]; }
  int32_t num_nics_ = 0;

  // Loads, in wire bytes.
  std::vector<int64_t> nic_send_, nic_recv_, nvl_send_, nvl_recv_, local_;
  // Lower-bound accounting.
  std::vector<int64_t> node_net_need_, node_unique_out_, gpu_remote_need_, gpu_total_need_;

  // Descriptors are appended as they are made, tagged with their (stage, src, dst) group, and
  // indexed by group at the end (BuildMessages).
  struct Group {
    uint8_t stage;
    int32_t src_gpu, dst_gpu;
    LinkClass link;
  };
  absl::flat_hash_map<uint64_t, int32_t> group_of_;  // when there are too many GPUs for the table
  std::vector<int32_t> group_table_;                 // [stage][src gpu][dst gpu] -> group
  std::vector<Group> groups_;
  std::vector<CopyDescriptor> lowered_, split_;
  std::optional<MessageCutter> cutter_;  // every descriptor's message, as it is made

  // Scratch reused across tensors.
  RegionSet src_regions_, need_regions_;
  std::vector<std::pair<Box, int32_t>> items_;
  std::vector<int32_t> remaining_, by_node_, seen_gpus_, same_node_, holder_gpus_;
  std::vector<char> region_single_node_;
  std::vector<int32_t> region_node_;
  std::vector<std::vector<Box>> region_needed_elsewhere_;
  int64_t wire_elem_bytes_ = 0;
  int64_t source_elem_bytes_ = 0;  // of the tensor being planned, at its source dtype
  // What Emit lowers from a source piece: copies, or (PlanQuantized) the codes of a quantized
  // tensor, or its scales (regions then in block coordinates).
  CopyOp mode_ = CopyOp::kCopy;
  const Quantization* quant_ = nullptr;
  Dims quant_shape_;
  Box ToElements(const Box& blocks) const;
  Box ToBlocks(const Box& elements) const;
  Box WholeBlocksOf(const Box& elements) const;
  // Per stage: the longest time one message of it takes on its link (a pipeline's fill).
  std::array<double, kMaxStages> stage_tail_{};
  double LinkBytesPerSecond(LinkClass link) const {
    const double gbps = link == LinkClass::kNetwork  ? topo_.nic_gbps
                        : link == LinkClass::kNvlink ? topo_.nvlink_gbps
                                                     : topo_.local_copy_gbps;
    return gbps * 1e9;
  }

  // Regions that crossed the network into a destination node, this tensor: relay candidates.
  Landings landings_;
  // The matches of the last few kinds of tensor, most recently made last.
  std::array<TensorMatch, 16> matches_;
  size_t next_match_ = 0;
  std::vector<int32_t> match_key_, holder_ids_, needer_ids_;
  std::vector<Box> elsewhere_;
  UnionVolumeMemo union_volumes_;

  // The view of the piece used last, per side: consecutive copies often share their source.
  struct CachedView {
    const Layout* layout = nullptr;
    int32_t piece = -1;
    PieceView view;
  };
  CachedView view_cache_[2];
  const PieceView& ViewOfPiece(const Layout& layout, int32_t piece, int side);
};

const PieceView& Planner::ViewOfPiece(const Layout& layout, int32_t piece, int side) {
  CachedView& c = view_cache_[side];
  if (c.layout != &layout || c.piece != piece) {
    const Piece& p = layout.pieces[piece];
    c.layout = &layout;
    c.piece = piece;
    // Validated layouts: every piece has a view.
    c.view = *ViewOf(layout.tensor_box(p), layout.buffer_box(p), layout.buffers[p.buffer].shape);
  }
  return c.view;
}

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

  for (const Buffer& b : src_.buffers) src_buffer_gpu_.push_back(GpuId(src_.workers[b.worker]));
  for (const Buffer& b : dst_.buffers) dst_buffer_gpu_.push_back(GpuId(dst_.workers[b.worker]));
  // One descriptor per destination piece is typical; reserving avoids regrowing a vector of
  // hundreds of MB.
  plan_.descriptors.reserve(dst_.pieces.size() + dst_.pieces.size() / 8 + 16);
  AdviseHugePages(plan_.descriptors.data(),
                  plan_.descriptors.capacity() * DescriptorTable::kBytesPerDescriptor);
  absl::flat_hash_map<int64_t, int32_t> nic_ids;
  for (const PlanGpu& g : plan_.gpus) {
    const int64_t key = (int64_t{g.node} << 32) | static_cast<uint32_t>(topo_.NicOf(g.gpu));
    gpu_nic_.push_back(nic_ids.emplace(key, static_cast<int32_t>(nic_ids.size())).first->second);
  }
  num_nics_ = static_cast<int32_t>(nic_ids.size());
  const size_t G = plan_.gpus.size();
  if (G <= 1024) group_table_.assign(kMaxStages * G * G, -1);
  if (opt_.max_relay_depth < 0 || opt_.max_relay_depth > kMaxStages - 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_relay_depth must be in [0, ", kMaxStages - 2, "]"));
  }
  nic_send_.assign(num_nics_, 0);
  nic_recv_.assign(num_nics_, 0);
  nvl_send_.assign(G, 0);
  nvl_recv_.assign(G, 0);
  local_.assign(G, 0);
  gpu_remote_need_.assign(G, 0);
  gpu_total_need_.assign(G, 0);
  node_net_need_.assign(node_ids_.size(), 0);
  node_unique_out_.assign(node_ids_.size(), 0);

  plan_.first_scratch_buffer = static_cast<int32_t>(dst_.buffers.size());
  threads_ =
      opt_.threads > 0 ? opt_.threads : std::max<int32_t>(1, std::thread::hardware_concurrency());
  cutter_.emplace(opt_.max_message_bytes);
  // Halfway through the descriptors (about one per destination piece), for the final pass.
  if (threads_ > 1) cutter_->MarkAfter(dst_.pieces.size() / 2);
  lowerer_.emplace(src_, dst_, opt_.max_message_bytes, plan_.descriptors, *cutter_, threads_ > 1);
  const absl::Status routed = RouteTensors();
  // A lowering error was made by a transfer routed before whatever stopped the routing.
  REFIT_RETURN_IF_ERROR(lowerer_->Drain());
  REFIT_RETURN_IF_ERROR(routed);
  lowerer_.reset();
  if (plan_.descriptors.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the plan needs ", plan_.descriptors.size(),
                     " copy descriptors, more than a plan can index (2^31 - 1)"));
  }
  for (const ScratchBuffer& b : plan_.scratch) plan_.stats.scratch_bytes += b.NumBytes();
  plan_.stats.pieces = static_cast<int64_t>(src_.pieces.size() + dst_.pieces.size());
  BuildMessages();
  ComputeCost();
  plan_.stats.planning_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return std::move(plan_);
}

absl::Status Planner::RouteTensors() {
  // Each a pass over a layout's millions of pieces: the two at once.
  std::optional<PiecesByTensor> dst_index;
  std::thread indexing;
  if (threads_ > 1) indexing = std::thread([&] { dst_index.emplace(dst_); });
  const PiecesByTensor src_by_tensor(src_);
  if (indexing.joinable()) {
    indexing.join();
  } else {
    dst_index.emplace(dst_);
  }
  const PiecesByTensor& dst_by_tensor = *dst_index;
  // The source tensor of the same name, looked up by name only where the layouts' orders differ:
  // both usually list a model's tensors in one order, and 70 k lookups of long names in a hash
  // table cost a cache miss or more each.
  int32_t next_source = 0;
  for (size_t t = 0; t < dst_.tensors.size(); ++t) {
    // A tensor's destination pieces lie far apart (each worker's pieces are together), a cache
    // miss each: fetch the next tensor's while this one is planned.
    if (t + 1 < dst_.tensors.size()) {
      for (int32_t p : dst_by_tensor.of(static_cast<int32_t>(t + 1))) {
        __builtin_prefetch(&dst_.pieces[p]);
      }
    }
    const LogicalTensor& dt = dst_.tensors[t];
    int32_t source = -1;
    if (next_source < static_cast<int32_t>(src_.tensors.size()) &&
        src_.tensors[next_source].name == dt.name) {
      source = next_source;
    } else if (auto it = src_.tensor_index.find(dt.name); it != src_.tensor_index.end()) {
      source = it->second;
    }
    if (source < 0) continue;  // a scale the data plane computes
    next_source = source + 1;
    if (dt.quant.format != QuantFormat::kNone && CanQuantizeFrom(src_.tensors[source].dtype)) {
      const bool needed = !dst_by_tensor.of(static_cast<int32_t>(t)).empty() ||
                          !dst_by_tensor.of(dst_.tensor_index.at(dt.quant.scale)).empty();
      if (!needed) continue;
      REFIT_RETURN_IF_ERROR(PlanQuantized(static_cast<int32_t>(t), src_by_tensor, dst_by_tensor));
      plan_.stats.tensors += 2;
      continue;
    }
    if (dst_by_tensor.of(static_cast<int32_t>(t)).empty()) continue;
    REFIT_RETURN_IF_ERROR(
        PlanTensor(static_cast<int32_t>(t), source, src_by_tensor, dst_by_tensor));
    ++plan_.stats.tensors;
  }
  return absl::OkStatus();
}

absl::Status Planner::PlanTensor(int32_t dst_tensor, int32_t src_tensor,
                                 const PiecesByTensor& src_by_tensor,
                                 const PiecesByTensor& dst_by_tensor) {
  const LogicalTensor& dt = dst_.tensors[dst_tensor];
  source_elem_bytes_ = DTypeSize(src_.tensors[src_tensor].dtype);
  wire_elem_bytes_ = std::min<int64_t>(DTypeSize(dt.dtype), source_elem_bytes_);
  mode_ = CopyOp::kCopy;

  const std::span<const int32_t> src_pieces = src_by_tensor.of(src_tensor);
  const std::span<const int32_t> dst_pieces = dst_by_tensor.of(dst_tensor);
  REFIT_ASSIGN_OR_RETURN(const TensorMatch* match, MatchOf(dst_tensor, src_pieces, dst_pieces));
  RouteMatch(*match, src_pieces, dst_pieces);
  return absl::OkStatus();
}

absl::StatusOr<const TensorMatch*> Planner::MatchOf(int32_t dst_tensor,
                                                    std::span<const int32_t> src_pieces,
                                                    std::span<const int32_t> dst_pieces) {
  match_key_.clear();
  match_key_.push_back(static_cast<int32_t>(src_pieces.size()));
  for (int32_t p : src_pieces) match_key_.push_back(src_.pieces[p].tensor_box);
  for (int32_t p : dst_pieces) {
    match_key_.push_back(dst_.pieces[p].tensor_box);
    match_key_.push_back(gpu_node_[DstGpu(p)]);
  }
  for (const TensorMatch& m : matches_) {
    if (m.key == match_key_) return &m;
  }
  TensorMatch& m = matches_[next_match_++ % matches_.size()];
  m.key.clear();  // unusable until built
  REFIT_RETURN_IF_ERROR(BuildMatch(dst_tensor, src_pieces, dst_pieces, m));
  m.key = match_key_;
  return &m;
}

absl::Status Planner::BuildMatch(int32_t dst_tensor, std::span<const int32_t> src_pieces,
                                 std::span<const int32_t> dst_pieces, TensorMatch& match) {
  items_.clear();
  for (size_t k = 0; k < src_pieces.size(); ++k) {
    items_.push_back({src_.tensor_box(src_.pieces[src_pieces[k]]), static_cast<int32_t>(k)});
  }
  src_regions_.Build(items_);
  match.region_owner_begin.assign(1, 0);
  match.region_owners.clear();
  for (size_t s = 0; s < src_regions_.size(); ++s) {
    for (int32_t k : src_regions_.owners(s)) match.region_owners.push_back(k);
    match.region_owner_begin.push_back(static_cast<int32_t>(match.region_owners.size()));
  }
  match.needers.clear();
  match.steps.clear();
  box_ids_.clear();
  // Destination pieces node by node (usually so already: pieces come worker by worker).
  by_node_.resize(dst_pieces.size());
  std::iota(by_node_.begin(), by_node_.end(), 0);
  auto node_of = [&](int32_t k) { return gpu_node_[DstGpu(dst_pieces[k])]; };
  auto node_less = [&](int32_t a, int32_t b) { return node_of(a) < node_of(b); };
  if (!std::is_sorted(by_node_.begin(), by_node_.end(), node_less)) {
    std::stable_sort(by_node_.begin(), by_node_.end(), node_less);
  }
  for (size_t i = 0; i < by_node_.size();) {
    const int32_t node = node_of(by_node_[i]);
    items_.clear();
    for (; i < by_node_.size() && node_of(by_node_[i]) == node; ++i) {
      items_.push_back({dst_.tensor_box(dst_.pieces[dst_pieces[by_node_[i]]]), by_node_[i]});
    }
    need_regions_.Build(items_);
    for (size_t r = 0; r < need_regions_.size(); ++r) {
      const Box& need = need_regions_.box(r);
      const int32_t needers_begin = static_cast<int32_t>(match.needers.size());
      for (int32_t k : need_regions_.owners(r)) match.needers.push_back(k);
      const int32_t needers_end = static_cast<int32_t>(match.needers.size());
      int64_t covered = 0;
      src_regions_.ForEachIntersecting(need, [&](size_t s) {
        const Box x = Intersect(need, src_regions_.box(s));
        covered += x.NumElements();
        match.steps.push_back(
            {x, BoxId(x), node, static_cast<int32_t>(s), needers_begin, needers_end});
      });
      if (covered != need.NumElements()) {
        return CoverageError(dst_tensor, need, dst_pieces[need_regions_.owners(r)[0]], covered);
      }
    }
  }
  match.distinct_boxes = static_cast<int32_t>(box_ids_.size());
  const size_t regions = src_regions_.size();
  match.region_step_begin.assign(regions + 1, 0);
  for (const TensorMatch::Step& step : match.steps) ++match.region_step_begin[step.region + 1];
  std::partial_sum(match.region_step_begin.begin(), match.region_step_begin.end(),
                   match.region_step_begin.begin());
  match.region_steps.resize(match.steps.size());
  {
    std::vector<int32_t> next(match.region_step_begin.begin(), match.region_step_begin.end() - 1);
    for (size_t i = 0; i < match.steps.size(); ++i) {
      match.region_steps[next[match.steps[i].region]++] = static_cast<int32_t>(i);
    }
  }
  match.needed_volume.assign(regions, 0);
  match.needed_nodes.resize(regions);
  for (size_t s = 0; s < regions; ++s) {
    elsewhere_.clear();
    std::vector<int32_t>& nodes = match.needed_nodes[s];
    nodes.clear();
    for (int32_t i = match.region_step_begin[s]; i < match.region_step_begin[s + 1]; ++i) {
      const TensorMatch::Step& step = match.steps[match.region_steps[i]];
      elsewhere_.push_back(step.x);
      nodes.push_back(step.node);
    }
    std::sort(nodes.begin(), nodes.end());
    nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
    match.needed_volume[s] = UnionVolume(elsewhere_);
  }
  return absl::OkStatus();
}

void Planner::RouteMatch(const TensorMatch& match, std::span<const int32_t> src_pieces,
                         std::span<const int32_t> dst_pieces) {
  const size_t regions = match.region_owner_begin.size() - 1;
  holder_ids_.clear();
  for (int32_t k : match.region_owners) holder_ids_.push_back(src_pieces[k]);
  needer_ids_.clear();
  for (int32_t k : match.needers) needer_ids_.push_back(dst_pieces[k]);
  region_single_node_.assign(regions, 1);
  region_node_.assign(regions, -1);
  for (size_t s = 0; s < regions; ++s) {
    for (int32_t i = match.region_owner_begin[s]; i < match.region_owner_begin[s + 1]; ++i) {
      const int32_t node = gpu_node_[SrcGpu(holder_ids_[i])];
      if (region_node_[s] == -1) region_node_[s] = node;
      if (region_node_[s] != node) region_single_node_[s] = 0;
    }
  }
  landings_.Clear(match.distinct_boxes);
  lowerer_->ForgetBoxKeys();  // box ids are this match's
  for (const TensorMatch::Step& step : match.steps) {
    const int32_t* holders = holder_ids_.data() + match.region_owner_begin[step.region];
    Route(step.x, step.x_id,
          {needer_ids_.data() + step.needers_begin, needer_ids_.data() + step.needers_end},
          {holders, holder_ids_.data() + match.region_owner_begin[step.region + 1]}, step.node);
  }
  // Lower bound: what only one node holds and other nodes need, each element once.
  for (size_t s = 0; s < regions; ++s) {
    if (!region_single_node_[s]) continue;
    const int32_t home = region_node_[s];
    const std::vector<int32_t>& nodes = match.needed_nodes[s];
    if (!std::binary_search(nodes.begin(), nodes.end(), home)) {
      node_unique_out_[home] += match.needed_volume[s] * wire_elem_bytes_;
      continue;
    }
    elsewhere_.clear();
    for (int32_t i = match.region_step_begin[s]; i < match.region_step_begin[s + 1]; ++i) {
      const TensorMatch::Step& step = match.steps[match.region_steps[i]];
      if (step.node != home) elsewhere_.push_back(step.x);
    }
    if (!elsewhere_.empty())
      node_unique_out_[home] += union_volumes_.Volume(elsewhere_) * wire_elem_bytes_;
  }
}

void Planner::IndexSources() {
  src_regions_.Build(items_);
  region_single_node_.assign(src_regions_.size(), 1);
  region_node_.assign(src_regions_.size(), -1);
  if (region_needed_elsewhere_.size() < src_regions_.size()) {
    region_needed_elsewhere_.resize(src_regions_.size());
  }
  for (size_t s = 0; s < src_regions_.size(); ++s) {
    region_needed_elsewhere_[s].clear();
    for (int32_t p : src_regions_.owners(s)) {
      const int32_t node = gpu_node_[SrcGpu(p)];
      if (region_node_[s] == -1) region_node_[s] = node;
      if (region_node_[s] != node) region_single_node_[s] = 0;
    }
  }
}

void Planner::CountUniqueOut() {
  for (size_t s = 0; s < src_regions_.size(); ++s) {
    if (!region_single_node_[s] || region_needed_elsewhere_[s].empty()) continue;
    node_unique_out_[region_node_[s]] +=
        union_volumes_.Volume(region_needed_elsewhere_[s]) * wire_elem_bytes_;
  }
}

absl::Status Planner::PlanNeeds(int32_t dst_tensor, std::span<const int32_t> dst_pieces,
                                std::vector<Missing>* missing) {
  landings_.Clear(0);
  lowerer_->ForgetBoxKeys();
  box_ids_.clear();
  // Destination pieces of this tensor, node by node.
  by_node_.assign(dst_pieces.begin(), dst_pieces.end());
  auto node_less = [&](int32_t a, int32_t b) {
    return gpu_node_[DstGpu(a)] < gpu_node_[DstGpu(b)];
  };
  // Pieces usually come worker by worker, already in node order.
  if (!std::is_sorted(by_node_.begin(), by_node_.end(), node_less)) {
    std::stable_sort(by_node_.begin(), by_node_.end(), node_less);
  }
  for (size_t i = 0; i < by_node_.size();) {
    const int32_t node = gpu_node_[DstGpu(by_node_[i])];
    size_t j = i;
    items_.clear();
    for (; j < by_node_.size() && gpu_node_[DstGpu(by_node_[j])] == node; ++j) {
      items_.push_back({dst_.tensor_box(dst_.pieces[by_node_[j]]), by_node_[j]});
    }
    i = j;
    need_regions_.Build(items_);
    for (size_t r = 0; r < need_regions_.size(); ++r) {
      const Box& need = need_regions_.box(r);
      int64_t covered = 0;
      src_regions_.ForEachIntersecting(need, [&](size_t s) {
        const Box x = Intersect(need, src_regions_.box(s));
        covered += x.NumElements();
        Route(x, BoxId(x), need_regions_.owners(r), src_regions_.owners(s), node);
        if (region_single_node_[s] && region_node_[s] != node) {
          region_needed_elsewhere_[s].push_back(x);
        }
      });
      if (covered == need.NumElements()) continue;
      if (missing == nullptr)
        return CoverageError(dst_tensor, need, need_regions_.owners(r)[0], covered);
      std::vector<Box> rest = {need};
      src_regions_.ForEachIntersecting(need, [&](size_t s) {
        std::vector<Box> next;
        for (const Box& m : rest) {
          for (const Box& part : Subtract(m, src_regions_.box(s))) next.push_back(part);
        }
        rest = std::move(next);
      });
      for (const Box& m : rest) {
        const Box elements = mode_ == CopyOp::kScale ? ToElements(m) : m;
        for (int32_t h : need_regions_.owners(r)) missing->push_back({elements, h});
      }
    }
  }
  return absl::OkStatus();
}

Box Planner::ToElements(const Box& blocks) const {
  Box e = blocks;
  const int64_t block[2] = {quant_->block_rows, quant_->block_cols};
  for (int d = 0; d < 2; ++d) {
    e.origin[d] = blocks.origin[d] * block[d];
    e.shape[d] =
        std::min((blocks.origin[d] + blocks.shape[d]) * block[d], quant_shape_[d]) - e.origin[d];
  }
  return e;
}

Box Planner::ToBlocks(const Box& elements) const {
  Box b = elements;
  const int64_t block[2] = {quant_->block_rows, quant_->block_cols};
  for (int d = 0; d < 2; ++d) {
    b.origin[d] = elements.origin[d] / block[d];
    b.shape[d] = (elements.origin[d] + elements.shape[d] + block[d] - 1) / block[d] - b.origin[d];
  }
  return b;
}

Box Planner::WholeBlocksOf(const Box& elements) const {
  Box w = elements;
  const int64_t block[2] = {quant_->block_rows, quant_->block_cols};
  for (int d = 0; d < 2; ++d) {
    const int64_t end = elements.origin[d] + elements.shape[d];
    const int64_t lo = (elements.origin[d] + block[d] - 1) / block[d] * block[d];
    const int64_t hi = end == quant_shape_[d] ? end : end / block[d] * block[d];
    w.origin[d] = lo;
    w.shape[d] = std::max<int64_t>(0, hi - lo);
  }
  return w;
}

// The block rule (docs/PLANNING.md, "Quantizing on the way"). A block's scale needs every element
// of the block. Where one source piece holds a block whole, its GPU quantizes it in the pack step
// and the codes and the scale travel (routed like any region: one network crossing per node,
// NVLink fan-out of the codes). Blocks no source piece holds whole (FSDP flat ranges, shards cut
// inside a block) are gathered, at the source dtype, into plan scratch on each destination GPU
// that needs them (its codes or its scale), and quantized there in a stage-1 local step. The
// result is the same bits either way: the scale is a function of the block's values only.
absl::Status Planner::PlanQuantized(int32_t w, const PiecesByTensor& src_by_tensor,
                                    const PiecesByTensor& dst_by_tensor) {
  const LogicalTensor& wt = dst_.tensors[w];
  const int32_t src_w = src_.tensor_index.at(wt.name);
  const int32_t s = dst_.tensor_index.at(wt.quant.scale);
  quant_ = &wt.quant;
  quant_shape_ = wt.shape;
  source_elem_bytes_ = DTypeSize(src_.tensors[src_w].dtype);
  std::vector<Missing> missing;

  // The codes, from the whole blocks of each source piece.
  mode_ = CopyOp::kQuantize;
  wire_elem_bytes_ = 1;
  items_.clear();
  for (int32_t p : src_by_tensor.of(src_w)) {
    const Box whole = WholeBlocksOf(src_.tensor_box(src_.pieces[p]));
    if (!whole.IsEmpty()) items_.push_back({whole, p});
  }
  std::vector<std::pair<Box, int32_t>> whole_items = items_;
  IndexSources();
  REFIT_RETURN_IF_ERROR(PlanNeeds(w, dst_by_tensor.of(w), &missing));
  CountUniqueOut();

  // The scales, in block coordinates, from the same blocks.
  mode_ = CopyOp::kScale;
  wire_elem_bytes_ = DTypeSize(wt.quant.ScaleDType());
  items_.clear();
  for (const auto& [box, p] : whole_items) items_.push_back({ToBlocks(box), p});
  IndexSources();
  REFIT_RETURN_IF_ERROR(PlanNeeds(s, dst_by_tensor.of(s), &missing));
  CountUniqueOut();

  if (!missing.empty()) {
    REFIT_RETURN_IF_ERROR(GatherAndQuantize(w, src_by_tensor.of(src_w), missing));
  }
  mode_ = CopyOp::kCopy;
  quant_ = nullptr;
  return absl::OkStatus();
}

absl::Status Planner::GatherAndQuantize(int32_t w, std::span<const int32_t> src_pieces,
                                        const std::vector<Missing>& missing) {
  // What follows lowers here, after what the lowerer holds.
  REFIT_RETURN_IF_ERROR(lowerer_->Drain());
  const LogicalTensor& wt = dst_.tensors[w];
  const DType src_dtype = src_.tensors[src_.tensor_index.at(wt.name)].dtype;
  // Every source element, for the gathering.
  mode_ = CopyOp::kCopy;
  wire_elem_bytes_ = source_elem_bytes_;
  items_.clear();
  for (int32_t p : src_pieces) items_.push_back({src_.tensor_box(src_.pieces[p]), p});
  IndexSources();

  // Per destination GPU: the boxes it needs (made disjoint) and the pieces that need them.
  absl::flat_hash_map<int32_t, std::pair<std::vector<Box>, std::vector<int32_t>>> by_gpu;
  std::vector<int32_t> gpus;
  for (const Missing& m : missing) {
    const int32_t g = DstGpu(m.piece);
    auto [it, added] = by_gpu.try_emplace(g);
    if (added) gpus.push_back(g);
    it->second.first.push_back(m.box);
    auto& pieces = it->second.second;
    if (std::find(pieces.begin(), pieces.end(), m.piece) == pieces.end()) pieces.push_back(m.piece);
  }
  for (int32_t g : gpus) {
    auto& [boxes, pieces] = by_gpu[g];
    // A GPU that needs cut blocks for their scales alone would gather whole blocks (up to 64 MiB)
    // for 4 bytes each: refused; engines keep a weight's scales with its codes.
    {
      std::vector<Box> code_boxes, scale_boxes;
      for (const Missing& m : missing) {
        if (DstGpu(m.piece) != g) continue;
        (dst_.pieces[m.piece].tensor == w ? code_boxes : scale_boxes).push_back(m.box);
      }
      for (const Box& b : scale_boxes) {
        std::vector<Box> rest = {b};
        for (const Box& c : code_boxes) {
          std::vector<Box> next;
          for (const Box& r : rest) {
            for (const Box& q : Subtract(r, c)) next.push_back(q);
          }
          rest = std::move(next);
        }
        if (!rest.empty()) {
          int32_t scale_piece = pieces[0];
          for (int32_t h : pieces) {
            if (dst_.pieces[h].tensor != w) scale_piece = h;
          }
          return absl::InvalidArgumentError(absl::StrCat(
              "destination ", DescribePiece(dst_, scale_piece), " holds the scales of blocks ",
              rest[0].ToString(), " of quantized tensor \"", wt.name,
              "\" without their codes, and no source holds those blocks whole: ",
              "their scales would need each whole block gathered on that GPU; keep a weight's "
              "scales with its codes ",
              "(as engines do)"));
        }
      }
    }
    const std::vector<Box> disjoint = Disjoint(boxes);
    const int32_t worker = dst_.buffers[dst_.pieces[pieces[0]].buffer].worker;
    for (const Box& u : disjoint) {
      const int32_t buffer =
          plan_.first_scratch_buffer + static_cast<int32_t>(plan_.scratch.size());
      plan_.scratch.push_back({g, worker, src_dtype, u.NumElements()});
      PieceView row_major{0, Dims{u.shape[1], 1}};
      const CopyEnd scratch{&u, row_major, buffer, src_dtype};
      // Stage 0: the block's parts, from the nearest holder of each.
      int64_t covered = 0;
      src_regions_.ForEachIntersecting(u, [&](size_t r) {
        const Box x = Intersect(u, src_regions_.box(r));
        covered += x.NumElements();
        std::span<const int32_t> holders = src_regions_.owners(r);
        int32_t from = -1;
        for (int32_t c : holders) {
          if (SrcGpu(c) == g) from = c;
        }
        if (from < 0) {
          for (int32_t c : holders) {
            if (gpu_node_[SrcGpu(c)] == gpu_node_[g]) from = c;
          }
        }
        if (from < 0) from = LeastSendingSource(holders, LinkClass::kNetwork);
        const int64_t bytes = x.NumElements() * source_elem_bytes_;
        plan_.stats.bytes_gathered += bytes;
        const int32_t group = Account(SrcGpu(from), g, bytes, bytes, 0);
        const Piece& fp = src_.pieces[from];
        const CopyEnd from_end{&src_.tensor_box(fp), ViewOfPiece(src_, from, 0), fp.buffer,
                               src_.buffers[fp.buffer].dtype};
        lowered_.clear();
        LowerCopy(x, from_end, scratch, false, lowered_);
        Append(group);
      });
      if (covered != u.NumElements()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "destination ", DescribePiece(dst_, pieces[0]), ": ", u.NumElements() - covered, " of ",
            u.NumElements(), " elements of blocks ", u.ToString(), " of quantized tensor \"",
            wt.name, "\" have no source in the source layout"));
      }
      // Stage 1, on this GPU: the codes and scales of every piece here that needs them.
      for (int32_t h : pieces) {
        const Piece& hp = dst_.pieces[h];
        const bool codes = hp.tensor == w;
        const Box x = codes ? Intersect(u, dst_.tensor_box(hp))
                            : Intersect(u, ToElements(dst_.tensor_box(hp)));
        if (x.IsEmpty()) continue;
        const int64_t wire =
            codes ? x.NumElements() : ToBlocks(x).NumElements() * DTypeSize(wt.quant.ScaleDType());
        // The gathering counted these elements at the source dtype already.
        const int32_t group = Account(g, g, wire, 0, 1);
        const CopyEnd to_end{&dst_.tensor_box(hp), ViewOfPiece(dst_, h, 1), hp.buffer,
                             dst_.buffers[hp.buffer].dtype};
        lowered_.clear();
        REFIT_RETURN_IF_ERROR(LowerQuantize(codes ? CopyOp::kQuantize : CopyOp::kScale, x, wt.quant,
                                            scratch, to_end, true, opt_.max_message_bytes,
                                            lowered_));
        Append(group);
      }
    }
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
    const int32_t g = SrcGpu(c);
    const int64_t load = link == LinkClass::kNetwork ? nic_send_[gpu_nic_[g]] : nvl_send_[g];
    if (load < best_load) best = c, best_load = load;
  }
  return best;
}

void Planner::Route(const Box& x, int32_t x_id, std::span<const int32_t> needers,
                    std::span<const int32_t> holders, int32_t node) {
  const int64_t bytes = x.NumElements() * wire_elem_bytes_;
  lowerer_->SubmitIfFull();
  const int32_t x_box = lowerer_->AddBox(x, x_id);
  holder_gpus_.clear();
  bool node_has_it = false;
  for (int32_t c : holders) {
    holder_gpus_.push_back(SrcGpu(c));
    node_has_it |= gpu_node_[holder_gpus_.back()] == node;
  }
  // Lower-bound accounting: what this node and each of its GPUs must receive.
  if (!node_has_it) node_net_need_[node] += bytes;

  remaining_.clear();
  seen_gpus_.clear();
  for (int32_t h : needers) {
    const int32_t g = DstGpu(h);
    int32_t local = -1;
    if (node_has_it) {
      for (size_t k = 0; k < holders.size(); ++k) {
        if (holder_gpus_[k] == g) {
          local = holders[k];
          break;
        }
      }
    }
    // Every needing piece is written; a GPU receives what it lacks at least once.
    gpu_total_need_[g] += bytes;
    if (local < 0 && std::find(seen_gpus_.begin(), seen_gpus_.end(), g) == seen_gpus_.end()) {
      gpu_remote_need_[g] += bytes;
      seen_gpus_.push_back(g);
    }
    if (local >= 0) {
      Emit(x, x_box, local, false, h, 0);
    } else {
      remaining_.push_back(h);
    }
  }
  if (remaining_.empty()) return;

  if (node_has_it) {
    same_node_.clear();
    for (int32_t c : holders) {
      if (gpu_node_[SrcGpu(c)] == node) same_node_.push_back(c);
    }
    for (int32_t h : remaining_) {
      Emit(x, x_box, LeastSendingSource(same_node_, LinkClass::kNvlink), false, h, 0);
    }
    return;
  }
  if (!opt_.routing) {
    for (int32_t h : remaining_) {
      Emit(x, x_box, LeastSendingSource(holders, LinkClass::kNetwork), false, h, 0);
    }
    return;
  }
  // Network once: land on the needing GPU whose NIC has received least, fan out from there.
  int32_t landing = remaining_[0];
  for (int32_t h : remaining_) {
    if (nic_recv_[gpu_nic_[DstGpu(h)]] < nic_recv_[gpu_nic_[DstGpu(landing)]]) landing = h;
  }
  // From the least-loaded sending NIC: a source, or a node that already received this region.
  const int32_t source = LeastSendingSource(holders, LinkClass::kNetwork);
  int64_t best_load = nic_send_[gpu_nic_[SrcGpu(source)]];
  int32_t relay = -1;
  for (int32_t l = landings_.Latest(x_id); l >= 0; l = landings_[l].next) {
    const Landings::Landing& candidate = landings_[l];
    if (candidate.node == node || candidate.stage >= opt_.max_relay_depth) continue;
    // A relay adds a stage, whose pipeline fill costs about one message: take it only when
    // it saves more than that on the busier NIC.
    const int64_t load = nic_send_[gpu_nic_[DstGpu(candidate.piece)]] + opt_.max_message_bytes;
    if (load < best_load) best_load = load, relay = l;
  }
  uint8_t landed_stage = 0;
  if (relay >= 0) {
    landed_stage = landings_[relay].stage + 1;
    Emit(x, x_box, landings_[relay].piece, true, landing, landed_stage);
  } else {
    Emit(x, x_box, source, false, landing, 0);
  }
  landings_.Add(x_id, landing, node, landed_stage);
  for (int32_t h : remaining_) {
    if (h != landing) Emit(x, x_box, landing, true, h, landed_stage + 1);
  }
}

void Planner::Emit(const Box& x, int32_t x_box, int32_t from_piece, bool from_destination,
                   int32_t to_piece, uint8_t stage) {
  const int32_t from_gpu = from_destination ? DstGpu(from_piece) : SrcGpu(from_piece);
  const int64_t bytes = x.NumElements() * wire_elem_bytes_;
  const int64_t before = mode_ == CopyOp::kScale ? 0 : x.NumElements() * source_elem_bytes_;
  const int32_t group = Account(from_gpu, DstGpu(to_piece), bytes, before, stage);
  RoutedTransfer t{x_box, from_piece, to_piece, group, mode_, from_destination, quant_};
  if (mode_ == CopyOp::kScale && !from_destination) {
    t.box = lowerer_->AddBox(ToElements(x));  // a sender reads the blocks' elements
  }
  lowerer_->Add(t);
}

int32_t Planner::Account(int32_t from_gpu, int32_t to_gpu, int64_t bytes, int64_t before_bytes,
                         uint8_t stage) {
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
  if (stage > 0) plan_.stats.bytes_forwarded += bytes;
  plan_.stats.bytes_total += bytes;
  plan_.stats.bytes_before_conversion += before_bytes;
  ++plan_.stats.transfers;

  const uint64_t key =
      (uint64_t{stage} << 62) | (uint64_t(uint32_t(from_gpu)) << 31) | uint64_t(uint32_t(to_gpu));
  if (!group_table_.empty()) {  // dense table: no hashing on the hot path
    int32_t& slot =
        group_table_[(size_t{stage} * plan_.gpus.size() + from_gpu) * plan_.gpus.size() + to_gpu];
    if (slot < 0) {
      slot = static_cast<int32_t>(groups_.size());
      groups_.push_back({stage, from_gpu, to_gpu, link});
    }
    return slot;
  }
  auto [it, added] = group_of_.emplace(key, static_cast<int32_t>(groups_.size()));
  if (added) groups_.push_back({stage, from_gpu, to_gpu, link});
  return it->second;
}

void Planner::Append(int32_t group) {
  split_.clear();
  for (CopyDescriptor& d : lowered_) {
    d.message = group;
    if (d.Quantizes() || d.WireBytes() <= opt_.max_message_bytes) {
      split_.push_back(d);  // quantizing ops were cut at block boundaries already
    } else {
      SplitDescriptor(d, opt_.max_message_bytes, split_);
    }
  }
  cutter_->CutInto(split_, plan_.descriptors);
}

void Planner::BuildMessages() {
  // Groups in execution order: stage, then sending GPU, then receiving GPU.
  const size_t G = groups_.size();
  std::vector<int32_t> order(G), rank(G);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return std::tie(groups_[a].stage, groups_[a].src_gpu, groups_[a].dst_gpu) <
           std::tie(groups_[b].stage, groups_[b].src_gpu, groups_[b].dst_gpu);
  });
  for (size_t r = 0; r < G; ++r) rank[order[r]] = static_cast<int32_t>(r);
  // The messages were cut as the descriptors were made (MessageCutter): here they are put in
  // execution order, and each descriptor's message renumbered, in one pass over the descriptors.
  const std::vector<MessageCutter::Cut>& cuts = cutter_->messages();
  const std::vector<int32_t> in_order = cutter_->ExecutionOrder(rank);
  std::vector<int32_t> final_id(cuts.size());
  std::vector<int64_t> next(cuts.size());
  plan_.messages.reserve(cuts.size());
  int64_t first = 0;
  for (size_t r = 0; r < in_order.size(); ++r) {
    const MessageCutter::Cut& c = cuts[in_order[r]];
    const Group& g = groups_[c.group];
    const Message m{g.src_gpu, g.dst_gpu, g.stage, g.link, c.bytes, first, c.descriptors};
    stage_tail_[m.stage] = std::max(stage_tail_[m.stage], m.bytes / LinkBytesPerSecond(m.link));
    plan_.stats.stages = std::max<int32_t>(plan_.stats.stages, m.stage + 1);
    plan_.messages.push_back(m);
    final_id[in_order[r]] = static_cast<int32_t>(r);
    next[r] = first;
    first += c.descriptors;
  }
  DescriptorTable& desc = plan_.descriptors;
  std::vector<int32_t>& index = plan_.message_descriptors;
  index.reserve(desc.size());
  AdviseHugePages(index.data(), index.capacity() * sizeof(int32_t));
  index.resize(desc.size());
  auto renumber = [&](size_t begin, size_t end, std::vector<int64_t>& slot) {
    for (size_t i = begin; i < end; ++i) {
      const int32_t m = final_id[desc.message(i)];
      desc.set_message(i, m);
      index[slot[m]++] = static_cast<int32_t>(i);
    }
  };
  // A pass over every descriptor (hundreds of MB), on the critical path: in two parts at once
  // where the cutter marked what each message held partway, the second part's descriptors of a
  // message going after the first part's.
  const std::optional<MessageCutter::Mark>& mark = cutter_->mark();
  if (threads_ > 1 && mark.has_value() && mark->descriptors < desc.size()) {
    std::vector<int64_t> later = next;
    for (size_t c = 0; c < mark->per_message.size(); ++c)
      later[final_id[c]] += mark->per_message[c];
    std::thread second([&] { renumber(mark->descriptors, desc.size(), later); });
    renumber(0, mark->descriptors, next);
    second.join();
  } else {
    renumber(0, desc.size(), next);
  }
  plan_.stats.descriptors = static_cast<int64_t>(desc.size());
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
  // message latency to fill the pipe, plus, for every later stage, the time of its longest
  // message: a stage can start on a region only once the message that lands it is complete.
  double latency = 0;
  if (plan_.stats.bytes_network > 0) {
    latency = topo_.network_latency_us * 1e-6;
  } else if (plan_.stats.bytes_nvlink > 0) {
    latency = topo_.nvlink_latency_us * 1e-6;
  }
  double tails = 0;
  for (int s = 1; s < kMaxStages; ++s) tails += stage_tail_[s];
  plan_.stats.predicted_seconds = busiest + latency + tails;

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
