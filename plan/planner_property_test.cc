// Seeded property tests: thousands of random layout pairs (uneven grids, replicas, FSDP flat
// shards that start mid-tensor, fused and padded buffers, casts, ranks 0 to 4, every dtype, up to
// 3 nodes of 4 GPUs) are planned and executed on the host. Every destination element must be
// written exactly once, with the right bytes, and padding must stay untouched.
#include <catch2/catch.hpp>
#include <random>

#include "absl/strings/str_cat.h"
#include "plan/flat_range.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"
#include "plan/verify.h"

namespace refit {
namespace {

struct Spec {
  std::string name;
  Dims shape;
  DType dtype;
};

class Generator {
 public:
  explicit Generator(uint64_t seed) : rng_(seed) {}

  int64_t Uniform(int64_t lo, int64_t hi) {  // inclusive
    return lo + static_cast<int64_t>(rng_() % static_cast<uint64_t>(hi - lo + 1));
  }
  bool Coin(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

  std::vector<Spec> Tensors() {
    std::vector<Spec> specs;
    const int n = static_cast<int>(Uniform(1, 5));
    for (int i = 0; i < n; ++i) {
      Spec s{absl::StrCat("t", i), Dims(), static_cast<DType>(Uniform(0, kNumDTypes - 1))};
      s.shape.rank = static_cast<int>(Uniform(0, 4));
      for (int d = 0; d < s.shape.rank; ++d) s.shape[d] = Uniform(1, s.shape.rank > 2 ? 4 : 9);
      specs.push_back(s);
    }
    return specs;
  }

  // Uneven boundaries of [0, extent) into `parts` ranges (some possibly empty).
  std::vector<int64_t> Boundaries(int64_t extent, int parts) {
    std::vector<int64_t> b = {0, extent};
    for (int i = 1; i < parts; ++i) b.push_back(Uniform(0, extent));
    std::sort(b.begin(), b.end());
    return b;
  }

  int32_t Worker(Layout& l, int32_t node, int32_t gpu) {
    const std::string name = absl::StrCat("w", node, "_", gpu);
    auto it = std::find_if(l.workers.begin(), l.workers.end(),
                           [&](const ::refit::Worker& w) { return w.name == name; });
    if (it != l.workers.end()) return static_cast<int32_t>(it - l.workers.begin());
    return l.AddWorker(name, node, gpu);
  }

  // A grid partition per tensor, with replicas; pieces in their own (maybe padded) buffers or
  // fused into one flat buffer per worker.
  void GridSide(Layout& l, const std::vector<Spec>& specs, int nodes, int gpus) {
    const bool fuse = Coin(0.3);
    std::vector<std::vector<std::pair<int32_t, Box>>> fused_pieces(nodes * gpus);
    for (const Spec& s : specs) {
      const int32_t t = l.AddTensor(s.name, s.shape, s.dtype);
      std::vector<std::vector<int64_t>> cuts(s.shape.rank);
      int64_t cells = 1;
      for (int d = 0; d < s.shape.rank; ++d) {
        cuts[d] = Boundaries(s.shape[d], static_cast<int>(Uniform(1, 3)));
        cells *= static_cast<int64_t>(cuts[d].size() - 1);
      }
      const int replicas = static_cast<int>(Uniform(1, 3));
      for (int r = 0; r < replicas; ++r) {
        for (int64_t c = 0; c < cells; ++c) {
          Box box;
          box.rank = s.shape.rank;
          int64_t rest = c;
          for (int d = 0; d < s.shape.rank; ++d) {
            const int64_t k = rest % static_cast<int64_t>(cuts[d].size() - 1);
            rest /= static_cast<int64_t>(cuts[d].size() - 1);
            box.origin[d] = cuts[d][k];
            box.shape[d] = cuts[d][k + 1] - cuts[d][k];
          }
          if (box.IsEmpty()) continue;
          const int slot = static_cast<int>(Uniform(0, nodes * gpus - 1));
          if (fuse) {
            fused_pieces[slot].push_back({t, box});
            continue;
          }
          const int32_t w = Worker(l, slot / gpus, slot % gpus);
          Dims bshape = box.shape_dims();
          Box bbox = Box::Whole(bshape);
          if (box.rank > 0 && Coin(0.3)) {  // padded: buffer larger than the piece
            bshape[0] += Uniform(1, 3);
            bbox.origin[0] = Uniform(0, bshape[0] - box.shape[0]);
          }
          const int32_t b = l.AddBuffer(w, absl::StrCat(s.name, "_", r, "_", c), s.dtype, bshape);
          l.AddPiece(t, box, b, bbox);
        }
      }
    }
    // Fused: one flat buffer per worker and dtype, pieces laid one after another with gaps.
    for (int slot = 0; slot < nodes * gpus; ++slot) {
      for (int dt = 0; dt < kNumDTypes; ++dt) {
        std::vector<std::pair<int32_t, Box>> mine;
        for (const auto& tp : fused_pieces[slot]) {
          if (static_cast<int>(l.tensors[tp.first].dtype) == dt) mine.push_back(tp);
        }
        if (mine.empty()) continue;
        int64_t size = 0;
        std::vector<int64_t> at;
        for (const auto& tp : mine) {
          size += Uniform(0, 2);
          at.push_back(size);
          size += tp.second.NumElements();
        }
        const int32_t w = Worker(l, slot / gpus, slot % gpus);
        const int32_t b = l.AddBuffer(w, absl::StrCat("fused", dt), static_cast<DType>(dt),
                                      Dims{size + Uniform(0, 2)});
        for (size_t i = 0; i < mine.size(); ++i) {
          l.AddPiece(mine[i].first, mine[i].second, b,
                     Box::FromDims(Dims{at[i]}, Dims{mine[i].second.NumElements()}));
        }
      }
    }
  }

  // FSDP: every tensor of one dtype concatenated, flattened, cut into shards at arbitrary
  // element boundaries (mid-tensor, mid-row), each shard a flat buffer on its own GPU.
  void FlatSide(Layout& l, const std::vector<Spec>& specs, int nodes, int gpus) {
    for (const Spec& s : specs) l.AddTensor(s.name, s.shape, s.dtype);
    for (int dt = 0; dt < kNumDTypes; ++dt) {
      std::vector<int32_t> group;
      int64_t total = 0;
      for (size_t t = 0; t < specs.size(); ++t) {
        if (static_cast<int>(specs[t].dtype) == dt) {
          group.push_back(static_cast<int32_t>(t));
          total += specs[t].shape.NumElements();
        }
      }
      if (group.empty()) continue;
      const int shards = static_cast<int>(Uniform(1, nodes * gpus));
      const std::vector<int64_t> cuts = Boundaries(total, shards);
      for (int k = 0; k < shards; ++k) {
        const int64_t lo = cuts[k], hi = cuts[k + 1];
        const int32_t w = Worker(l, k / gpus % nodes, k % gpus);
        const int32_t b = l.AddBuffer(w, absl::StrCat("flat", dt, "_", k), static_cast<DType>(dt),
                                      Dims{std::max<int64_t>(hi - lo, 1)});
        int64_t start = 0;
        for (int32_t t : group) {
          const int64_t n = specs[t].shape.NumElements();
          const int64_t a = std::max(lo, start), e = std::min(hi, start + n);
          for (const Box& box : FlatRangeToBoxes(specs[t].shape, a - start, e - start)) {
            const int64_t flat = LinearIndex(box.origin_dims(), specs[t].shape) + start - lo;
            l.AddPiece(t, box, b, Box::FromDims(Dims{flat}, Dims{box.NumElements()}));
          }
          start += n;
        }
      }
    }
  }

 private:
  std::mt19937_64 rng_;
};

// Counts, for every destination element, how many descriptors write it.
std::vector<std::vector<int>> WriteCounts(const Plan& plan, const Layout& dst) {
  std::vector<std::vector<int>> counts(dst.buffers.size());
  for (size_t b = 0; b < dst.buffers.size(); ++b)
    counts[b].assign(dst.buffers[b].shape.NumElements(), 0);
  for (const CopyDescriptor& d : plan.descriptors) {
    std::array<int64_t, kMaxOuterDims> i{};
    const int64_t runs = d.NumElements() / std::max<int64_t>(d.inner, 1);
    for (int64_t r = 0; r < runs; ++r) {
      int64_t off = d.dst_offset;
      for (int k = 0; k < d.outer_rank; ++k) off += i[k] * d.dst_stride[k];
      for (int64_t e = 0; e < d.inner; ++e) ++counts[d.dst_buffer][off + e];
      for (int k = d.outer_rank - 1; k >= 0; --k) {
        if (++i[k] < d.count[k]) break;
        i[k] = 0;
      }
    }
  }
  return counts;
}

TEST_CASE("random layout pairs: every destination element written exactly once, right bytes") {
  int planned = 0;
  for (uint64_t seed = 1; seed <= 3000; ++seed) {
    Generator gen(seed);
    const std::vector<Spec> specs = gen.Tensors();
    std::vector<Spec> dst_specs = specs;
    for (Spec& s : dst_specs) {
      const bool is_float =
          s.dtype == DType::kBF16 || s.dtype == DType::kF16 || s.dtype == DType::kF32;
      if (is_float && gen.Coin(0.25)) s.dtype = static_cast<DType>(gen.Uniform(0, 2));
    }
    const int nodes = static_cast<int>(gen.Uniform(1, 3)),
              gpus = static_cast<int>(gen.Uniform(1, 4));
    Layout src, dst;
    if (gen.Coin(0.35))
      gen.FlatSide(src, specs, nodes, gpus);
    else
      gen.GridSide(src, specs, nodes, gpus);
    if (gen.Coin(0.2))
      gen.FlatSide(dst, dst_specs, nodes, gpus);
    else
      gen.GridSide(dst, dst_specs, nodes, gpus);
    INFO("seed " << seed);
    REQUIRE(ValidateLayout(src, "source").ok());
    auto dst_ok = ValidateLayout(dst, "destination");
    INFO(dst_ok.message());
    REQUIRE(dst_ok.ok());
    PlanOptions options;
    options.topology.gpus_per_node = 4;
    options.topology.nics_per_node = static_cast<int32_t>(gen.Uniform(1, 4));
    options.routing = gen.Coin(0.7);
    options.max_relay_depth = static_cast<int32_t>(gen.Uniform(0, 3));
    options.max_message_bytes = gen.Coin(0.5) ? gen.Uniform(1, 64) : int64_t{1} << 20;
    options.threads = 1;
    auto plan = MakePlan(src, dst, options);
    INFO(plan.status().message());
    REQUIRE(plan.ok());
    // Lowering on a thread of its own changes nothing.
    options.threads = 2;
    auto threaded = MakePlan(src, dst, options);
    REQUIRE(threaded.ok());
    REQUIRE(testing::PlanDifference(*plan, *threaded) == "");
    auto verified = VerifyOnHost(*plan, src, dst, seed, int64_t{1} << 30);
    INFO(verified.status().message());
    REQUIRE(verified.ok());
    // Exactly once: replicas on the destination side each get one write per element.
    const auto counts = WriteCounts(*plan, dst);
    std::vector<std::vector<bool>> covered(dst.buffers.size());
    for (size_t b = 0; b < dst.buffers.size(); ++b) covered[b].assign(counts[b].size(), false);
    int64_t needed = 0;
    for (const Piece& p : dst.pieces) needed += dst.tensor_box(p).NumElements();
    int64_t written = 0;
    for (const auto& c : counts) {
      for (int n : c) {
        REQUIRE(n <= 1);
        written += n;
      }
    }
    REQUIRE(written == needed);
    int64_t next_descriptor = 0;
    for (size_t i = 0; i < plan->messages.size(); ++i) {
      const Message& m = plan->messages[i];
      REQUIRE(m.bytes <= std::max<int64_t>(options.max_message_bytes, 8));
      REQUIRE(m.first_descriptor == next_descriptor);  // messages tile the index in order
      int64_t bytes = 0;
      for (int64_t k = 0; k < m.num_descriptors; ++k) {
        const CopyDescriptor& d = plan->descriptor(m, k);
        REQUIRE(d.message == static_cast<int32_t>(i));
        REQUIRE(d.src_is_destination == (m.stage > 0));
        bytes += d.WireBytes();
      }
      REQUIRE(bytes == m.bytes);
      next_descriptor += m.num_descriptors;
    }
    REQUIRE(next_descriptor == static_cast<int64_t>(plan->descriptors.size()));
    std::vector<int32_t> index = plan->message_descriptors;  // a permutation of the descriptors
    std::sort(index.begin(), index.end());
    for (size_t k = 0; k < index.size(); ++k) REQUIRE(index[k] == static_cast<int64_t>(k));
    REQUIRE(plan->stats.predicted_seconds >= plan->stats.lower_bound_seconds);
    REQUIRE(plan->stats.bytes_total ==
            plan->stats.bytes_network + plan->stats.bytes_nvlink + plan->stats.bytes_local);
    ++planned;
  }
  CHECK(planned == 3000);
}

}  // namespace
}  // namespace refit
