#include "kernels/network_schedule.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "plan/dtype.h"

namespace refit {
namespace {

constexpr int64_t kSlotAlign = 256;
constexpr size_t kMaxOpsPerStep = 256;  // NCCL bounds the operations of one group
constexpr int64_t kMinSteps = 8;        // a stage with little to move still pipelines

int64_t AlignUp(int64_t n) { return (n + kSlotAlign - 1) / kSlotAlign * kSlotAlign; }

bool Contiguous(const CopyDescriptor& d, const std::array<int32_t, kMaxOuterDims>& stride) {
  int64_t expect = d.inner;
  for (int i = d.outer_rank - 1; i >= 0; --i) {
    if (d.count[i] > 1 && stride[i] != expect) return false;
    expect *= d.count[i];
  }
  return true;
}

// One network operation before addresses: a staged part of a message (its descriptors that are
// not zero-copy) or one zero-copy descriptor.
struct Unit {
  const Message* message = nullptr;
  std::vector<int64_t> descriptors;  // indices k into the message
  bool zero_copy = false;
  int64_t bytes = 0;
};

// The operations of one local GPU with one peer in one direction, in plan order.
struct PairKey {
  int32_t peer;
  bool send;
  bool operator<(const PairKey& o) const { return std::tie(peer, send) < std::tie(o.peer, o.send); }
};

}  // namespace

// Never a quantizing descriptor (kQuantize, kScale): its wire bytes are codes or scales its pack
// step computes, not its source's bytes, even where the dtypes match (an fp32 source's fp32
// scales) and both ends look contiguous (a one-row region).
bool IsZeroCopy(const CopyDescriptor& d, int64_t min_bytes) {
  return !d.Quantizes() && d.src_dtype == d.dst_dtype && d.WireBytes() >= min_bytes &&
         Contiguous(d, d.src_stride) && Contiguous(d, d.dst_stride);
}

double PredictNetworkSeconds(const NodeSchedule& schedule, const ExecutorModel& model) {
  if (!schedule.uses_network) return 0;
  auto copy = [&](const CopyWork& w) {
    return static_cast<double>(w.bytes) / (model.pack_gbps * 1e9) +
           static_cast<double>(w.items.size()) * model.per_item_ns * 1e-9;
  };
  double total = model.fixed_us * 1e-6;
  for (const StageSchedule& stage : schedule.stages) {
    double slowest = 0;
    for (const auto& [gpu, steps] : stage.steps) {
      if (steps.empty()) continue;
      double sent = 0, received = 0, ops = 0, pack = 0, unpack = 0;
      for (const NetworkStep& step : steps) {
        for (const NetworkOp& op : step.ops)
          (op.send ? sent : received) += static_cast<double>(op.bytes), ++ops;
        pack += copy(step.pack), unpack += copy(step.unpack);
      }
      const double wire =
          std::max(sent, received) / (model.wire_gbps * 1e9) + ops * model.per_op_us * 1e-6;
      const double seconds =
          std::max({wire, pack, unpack}) + copy(steps.front().pack) + copy(steps.back().unpack);
      slowest = std::max(slowest, seconds);
    }
    total += slowest;
  }
  return total;
}

int64_t NodeSchedule::StagingBytes(int32_t gpu) const {
  auto r = region_bytes.find(gpu);
  auto d = depth.find(gpu);
  return r == region_bytes.end() || d == depth.end() ? 0 : r->second * d->second;
}

absl::StatusOr<NodeSchedule> BuildNodeSchedule(const Plan& plan, const ScheduleOptions& options,
                                               const AddressesOn& addresses_on,
                                               const StagingOn& staging_on) {
  NodeSchedule out;
  out.stages.resize(kMaxStages);
  const int32_t node = options.node;
  // Pass 1, over the whole plan (every node must derive the same steps): the units of every
  // pair of ranks between nodes, per stage, in plan order. Descriptors are kept for this node's.
  using Pair = std::pair<int32_t, int32_t>;  // (sending rank, receiving rank)
  std::vector<std::map<Pair, std::vector<Unit>>> units(kMaxStages);
  for (const Message& m : plan.messages) {
    const PlanGpu& from = plan.gpus[m.src_gpu];
    const PlanGpu& to = plan.gpus[m.dst_gpu];
    if (from.node == to.node) continue;  // direct, pass 3
    const bool local = from.node == node || to.node == node;
    out.uses_network |= local;
    Unit staged{&m, {}, false, 0};
    std::vector<Unit>& list = units[m.stage][{m.src_gpu, m.dst_gpu}];
    const size_t first_zero = list.size();
    // What is not zero-copy is staged: the message's bytes less its zero-copy descriptors'. A
    // plan slice (plan/plan_slice.h) keeps, of other nodes' messages, only the descriptors large
    // enough to be zero-copy, so this holds there too.
    int64_t zero_copy_bytes = 0;
    for (int64_t k = 0; k < m.num_descriptors; ++k) {
      const CopyDescriptor& d = plan.descriptor(m, k);
      if (IsZeroCopy(d, options.zero_copy_min_bytes)) {
        list.push_back(Unit{&m, {k}, true, d.WireBytes()});
        zero_copy_bytes += d.WireBytes();
      } else if (local) {
        staged.descriptors.push_back(k);
      }
    }
    staged.bytes = m.bytes - zero_copy_bytes;
    if (staged.bytes > 0)
      list.insert(list.begin() + static_cast<std::ptrdiff_t>(first_zero), std::move(staged));
  }
  // Pass 2: steps. Pairs in rank order, each pair's units in order, every unit into the first
  // step (not before its predecessor's) where neither end already carries step_bytes (at least
  // the plan's largest message) or kMaxOpsPerStep operations; a unit alone may exceed it. So a
  // GPU with many peers spreads them over steps, and one step's staging stays within step_bytes.
  // A stage whose busiest rank moves less than kMinSteps steps' worth gets smaller steps, so that
  // pack, wire and unpack still overlap (one step would run them one after the other).
  int64_t largest_message = 1;
  for (const Message& m : plan.messages) largest_message = std::max(largest_message, m.bytes);
  using Steps = std::vector<std::vector<Unit>>;  // by step index; empty where the pair is idle
  std::vector<std::map<int32_t, std::map<PairKey, Steps>>> grouped(kMaxStages);
  for (int stage = 0; stage < kMaxStages; ++stage) {
    std::map<int32_t, int64_t> rank_bytes;  // sent + received by each rank in this stage
    for (const auto& [pair, list] : units[stage]) {
      for (const Unit& u : list)
        rank_bytes[pair.first] += u.bytes, rank_bytes[pair.second] += u.bytes;
    }
    int64_t busiest = 0;
    for (const auto& [rank, bytes] : rank_bytes) busiest = std::max(busiest, bytes);
    const int64_t step_target = std::max(
        largest_message,
        std::min(std::max<int64_t>(1, options.step_bytes), (busiest + kMinSteps - 1) / kMinSteps));
    std::map<int32_t, std::vector<std::pair<int64_t, size_t>>>
        load;  // rank -> per step (bytes, operations)
    auto at = [&](int32_t rank, size_t k) -> std::pair<int64_t, size_t>& {
      auto& v = load[rank];
      if (v.size() <= k) v.resize(k + 1, {0, 0});
      return v[k];
    };
    for (auto& [pair, list] : units[stage]) {
      const auto [a, b] = pair;
      const bool a_here = plan.gpus[a].node == node, b_here = plan.gpus[b].node == node;
      size_t k = 0;
      for (Unit& u : list) {
        while (true) {
          auto& la = at(a, k);
          auto& lb = at(b, k);
          const bool empty = la.first == 0 && lb.first == 0;
          const bool fits = la.first + u.bytes <= step_target &&
                            lb.first + u.bytes <= step_target && la.second < kMaxOpsPerStep &&
                            lb.second < kMaxOpsPerStep;
          if (empty || fits) break;
          ++k;
        }
        at(a, k).first += u.bytes, ++at(a, k).second;
        at(b, k).first += u.bytes, ++at(b, k).second;
        for (auto [here, gpu, key] : {std::tuple{a_here, plan.gpus[a].gpu, PairKey{b, true}},
                                      std::tuple{b_here, plan.gpus[b].gpu, PairKey{a, false}}}) {
          if (!here) continue;
          Steps& steps = grouped[stage][gpu][key];
          if (steps.size() <= k) steps.resize(k + 1);
          steps[k].push_back(u);
        }
      }
    }
  }
  for (int stage = 0; stage < kMaxStages; ++stage) {
    for (const auto& [gpu, lists] : grouped[stage]) {
      size_t steps = 0;
      for (const auto& [key, list] : lists) steps = std::max(steps, list.size());
      for (size_t k = 0; k < steps; ++k) {
        int64_t region = 0;
        int32_t slots = 0;
        for (const auto& [key, list] : lists) {
          if (k >= list.size()) continue;
          for (const Unit& u : list[k]) {
            if (!u.zero_copy) region += AlignUp(u.bytes), ++slots;
          }
        }
        if (region > options.staging_budget) {
          return absl::FailedPreconditionError(absl::StrCat(
              "GPU ", gpu, " needs ", region, " bytes of staging for one step of stage ", stage,
              " (", slots, " messages at once); the staging budget is ", options.staging_budget,
              " bytes per GPU: raise --staging-bytes or lower --max-message-bytes"));
        }
        out.region_bytes[gpu] = std::max(out.region_bytes[gpu], region);
      }
    }
  }
  // Steps in flight: as many as the budget holds, at most max_depth, and no more than a stage of
  // this GPU has steps (more regions would never be used).
  std::map<int32_t, int64_t> most_steps;
  for (int stage = 0; stage < kMaxStages; ++stage) {
    for (const auto& [gpu, lists] : grouped[stage]) {
      for (const auto& [key, list] : lists)
        most_steps[gpu] = std::max<int64_t>(most_steps[gpu], list.size());
    }
  }
  std::map<int32_t, uint64_t> staging;
  for (const auto& [gpu, region] : out.region_bytes) {
    if (region == 0) continue;
    const int64_t cap = std::min<int64_t>(options.max_depth, std::max<int64_t>(1, most_steps[gpu]));
    const int32_t depth =
        static_cast<int32_t>(std::clamp<int64_t>(options.staging_budget / region, 1, cap));
    out.depth[gpu] = depth;
    auto at = staging_on(gpu, region * depth);
    if (!at.ok()) return at.status();
    staging[gpu] = *at;
  }
  // Pass 3: addresses, items and operations.
  std::map<int32_t, std::pair<BufferAddresses, BufferAddresses>> addresses;
  auto addresses_of =
      [&](int32_t gpu) -> absl::StatusOr<const std::pair<BufferAddresses, BufferAddresses>*> {
    auto it = addresses.find(gpu);
    if (it == addresses.end()) {
      auto a = addresses_on(gpu);
      if (!a.ok()) return a.status();
      it = addresses.emplace(gpu, *std::move(a)).first;
    }
    return &it->second;
  };
  for (const Message& m : plan.messages) {
    const PlanGpu& from = plan.gpus[m.src_gpu];
    const PlanGpu& to = plan.gpus[m.dst_gpu];
    if (to.node != node || from.node != node) continue;
    auto a = addresses_of(to.gpu);
    if (!a.ok()) return a.status();
    AppendWork(DirectWork(plan, m, (*a)->first, (*a)->second, options.segment_bytes),
               out.stages[m.stage].direct[to.gpu]);
    (from.gpu == to.gpu ? out.bytes_local : out.bytes_peer) += m.bytes;
  }
  for (int stage = 0; stage < kMaxStages; ++stage) {
    StageSchedule& s = out.stages[stage];
    for (const auto& [gpu, lists] : grouped[stage]) {
      auto a = addresses_of(gpu);
      if (!a.ok()) return a.status();
      const BufferAddresses& src = (*a)->first;
      const BufferAddresses& dst = (*a)->second;
      std::vector<NetworkStep>& steps = s.steps[gpu];
      for (const auto& [key, list] : lists) steps.resize(std::max(steps.size(), list.size()));
      for (size_t k = 0; k < steps.size(); ++k) {
        const uint64_t region =
            staging[gpu] + (k % std::max(1, out.depth[gpu])) * out.region_bytes[gpu];
        int64_t used = 0;
        NetworkStep& step = steps[k];
        for (const auto& [key, list] : lists) {
          if (k >= list.size()) continue;
          for (const Unit& u : list[k]) {
            NetworkOp op{key.peer, key.send, u.zero_copy, u.bytes, 0};
            if (u.zero_copy) {
              const CopyDescriptor& d = plan.descriptor(*u.message, u.descriptors[0]);
              const int size = DTypeSize(d.dst_dtype);
              op.buffer = key.send ? (d.src_is_destination ? dst : src)[d.src_buffer] +
                                         static_cast<uint64_t>(d.src_offset * size)
                                   : dst[d.dst_buffer] + static_cast<uint64_t>(d.dst_offset * size);
              out.bytes_zero_copy += u.bytes;
            } else {
              op.buffer = region + static_cast<uint64_t>(used);
              CopyWork w;  // this operation's slot, descriptors one after another
              w.unit_begin.push_back(0);
              for (int64_t index : u.descriptors) {
                const CopyDescriptor& d = plan.descriptor(*u.message, index);
                if (key.send) {
                  AppendPackItem(d, src, dst, op.buffer, options.segment_bytes, w);
                } else {
                  AppendUnpackItem(d, op.buffer, dst, options.segment_bytes, w);
                }
              }
              AppendWork(w, key.send ? step.pack : step.unpack);
              used += AlignUp(u.bytes);
            }
            (key.send ? out.bytes_sent : out.bytes_received) += u.bytes;
            ++out.network_ops;
            step.ops.push_back(op);
          }
        }
      }
      s.num_steps = std::max(s.num_steps, static_cast<int32_t>(steps.size()));
    }
  }
  return out;
}

}  // namespace refit
