// The network schedule executed on the CPU in the order the GPU pipeline allows (packs of the
// next steps ahead, each step's sends matched with its peers' receives, unpacks after): every
// node's schedule together must give the CPU reference's destinations, byte for byte, at every
// staging depth, with and without zero-copy; and a budget too small for one step is refused.
#include "kernels/network_schedule.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <deque>
#include <set>

#include "kernels/test_plans.h"
#include "plan/plan_slice.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"
#include "plan/verify.h"

namespace refit {
namespace {

struct Cluster {
  std::vector<NodeSchedule> nodes;
  std::vector<std::vector<std::byte>> staging;  // kept alive for the schedules' addresses
  std::deque<Plan> slices;                      // each node's slice, when built from slices
};

int32_t RankOf(const Plan& plan, int32_t node, int32_t gpu) {
  for (size_t r = 0; r < plan.gpus.size(); ++r) {
    if (plan.gpus[r].node == node && plan.gpus[r].gpu == gpu) return static_cast<int32_t>(r);
  }
  return -1;
}

// `sliced`: each node builds its schedule from its own slice of the plan (plan/plan_slice.h), as
// refitd does, instead of the whole plan.
absl::StatusOr<Cluster> Build(const Plan& plan, const BufferAddresses& src,
                              const BufferAddresses& dst, int64_t budget, int64_t zero_copy_min,
                              int32_t max_depth, int64_t step_bytes = 0, bool sliced = false) {
  Cluster c;
  std::set<int32_t> nodes;
  for (const PlanGpu& g : plan.gpus) nodes.insert(g.node);
  c.staging.reserve(64);
  for (int32_t node : nodes) {
    ScheduleOptions options;
    options.node = node;
    options.staging_budget = budget;
    options.zero_copy_min_bytes = zero_copy_min;
    options.max_depth = max_depth;
    options.segment_bytes = 64;
    options.step_bytes = step_bytes;
    const Plan& own = sliced ? c.slices.emplace_back(SliceOfPlan(plan, node, zero_copy_min)) : plan;
    auto s = BuildNodeSchedule(
        own, options,
        [&](int32_t) -> absl::StatusOr<std::pair<BufferAddresses, BufferAddresses>> {
          return std::make_pair(src, dst);
        },
        [&](int32_t, int64_t bytes) -> absl::StatusOr<uint64_t> {
          REQUIRE(bytes <= budget);
          c.staging.emplace_back(static_cast<size_t>(bytes));
          return reinterpret_cast<uint64_t>(c.staging.back().data());
        });
    if (!s.ok()) return s.status();
    c.nodes.resize(std::max<size_t>(c.nodes.size(), node + 1));
    c.nodes[node] = *std::move(s);
  }
  return c;
}

absl::StatusOr<Cluster> Build(TestRun& run, int64_t budget, int64_t zero_copy_min,
                              int32_t max_depth, int64_t step_bytes = 0, bool sliced = false) {
  return Build(run.t.plan, run.src.addresses(), run.got.addresses(), budget, zero_copy_min,
               max_depth, step_bytes, sliced);
}

void Execute(const Plan& plan, Cluster& c) {
  for (int stage = 0; stage < kMaxStages; ++stage) {
    int32_t steps = 0;
    for (auto& n : c.nodes) {
      for (auto& [gpu, w] : n.stages[stage].direct) RunCopyWorkOnHost(w);
      steps = std::max(steps, n.stages[stage].num_steps);
    }
    auto each_gpu = [&](auto&& f) {
      for (size_t node = 0; node < c.nodes.size(); ++node) {
        for (auto& [gpu, list] : c.nodes[node].stages[stage].steps)
          f(static_cast<int32_t>(node), gpu, list);
      }
    };
    each_gpu([&](int32_t node, int32_t gpu, std::vector<NetworkStep>& list) {
      const int32_t depth = c.nodes[node].depth[gpu];
      for (int32_t j = 0; j < depth && j < static_cast<int32_t>(list.size()); ++j)
        RunCopyWorkOnHost(list[j].pack);
    });
    for (int32_t k = 0; k < steps; ++k) {
      // NCCL matches a pair's sends and receives of one group in the order they were posted.
      std::map<std::pair<int32_t, int32_t>, std::vector<const NetworkOp*>> sends;  // (from, to)
      size_t posted = 0;
      each_gpu([&](int32_t node, int32_t gpu, std::vector<NetworkStep>& list) {
        if (k >= static_cast<int32_t>(list.size())) return;
        for (const NetworkOp& op : list[k].ops) {
          if (op.send) sends[{RankOf(plan, node, gpu), op.peer}].push_back(&op), ++posted;
        }
      });
      std::map<std::pair<int32_t, int32_t>, size_t> next;
      size_t matched = 0;
      each_gpu([&](int32_t node, int32_t gpu, std::vector<NetworkStep>& list) {
        if (k >= static_cast<int32_t>(list.size())) return;
        for (const NetworkOp& op : list[k].ops) {
          if (op.send) continue;
          const std::pair<int32_t, int32_t> pair{op.peer, RankOf(plan, node, gpu)};
          auto& in_order = sends[pair];
          const size_t i = next[pair]++;
          REQUIRE(i < in_order.size());  // a receive without its send in the same step would hang
          REQUIRE(in_order[i]->bytes == op.bytes);
          std::memcpy(reinterpret_cast<void*>(op.buffer),
                      reinterpret_cast<const void*>(in_order[i]->buffer),
                      static_cast<size_t>(op.bytes));
          ++matched;
        }
      });
      REQUIRE(matched == posted);  // and no send without its receive
      each_gpu([&](int32_t node, int32_t gpu, std::vector<NetworkStep>& list) {
        if (k >= static_cast<int32_t>(list.size())) return;
        RunCopyWorkOnHost(list[k].unpack);
        const int32_t next = k + c.nodes[node].depth[gpu];
        if (next < static_cast<int32_t>(list.size())) RunCopyWorkOnHost(list[next].pack);
      });
    }
  }
}

TEST_CASE("every node's schedule together lands every byte, at every depth, with zero-copy") {
  int64_t zero_copied = 0, staged = 0;
  size_t most_steps_of_1g_target = 0;  // steps of one GPU when steps may hold 1 GiB
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    for (int64_t zero_copy_min : {int64_t{1} << 40, int64_t{8}, int64_t{512}}) {
      for (int32_t depth : {1, 2, 4}) {
        TestRun run(seed);
        // Steps of one message, of several, or of everything between a pair.
        const int64_t step_bytes = seed % 3 == 0 ? 0 : seed % 3 == 1 ? 3000 : int64_t{1} << 30;
        auto wide = Build(run, int64_t{1} << 30, zero_copy_min, depth, step_bytes);
        REQUIRE(wide.ok());
        int64_t region = 0;
        for (const auto& n : wide->nodes) {
          for (const auto& [gpu, r] : n.region_bytes) region = std::max(region, r);
        }
        // A budget of exactly `depth` of the largest step: slots are reused as soon as allowed.
        // Every other run from the nodes' slices: the same steps must come out (or the pairs'
        // sends and receives would not match).
        const bool sliced = (seed + depth) % 2 == 0;
        auto c = Build(run, std::max<int64_t>(region, 1) * depth, zero_copy_min, depth, step_bytes,
                       sliced);
        REQUIRE(c.ok());
        Execute(run.t.plan, *c);
        ExecuteOnHost(run.t.plan, run.src.memory, run.ref.memory);
        INFO("seed " << seed << " zero-copy from " << zero_copy_min << " depth " << depth
                     << " sliced " << sliced);
        for (size_t b = 0; b < run.t.dst.buffers.size(); ++b)
          REQUIRE(run.ref.storage[b] == run.got.storage[b]);
        auto checked = CheckDestinations(run.t.src, run.t.dst, run.spec, run.got.memory);
        INFO(checked.status().message());
        REQUIRE(checked.ok());
        for (const auto& n : c->nodes)
          zero_copied += n.bytes_zero_copy, staged += n.bytes_sent + n.bytes_received;
        // No GPU carries more than a step's bytes in one step, however many peers it has (a unit
        // larger than that travels alone).
        int64_t target = std::max<int64_t>(1, step_bytes);
        for (const Message& m : run.t.plan.messages) target = std::max(target, m.bytes);
        for (const auto& n : c->nodes) {
          for (const StageSchedule& st : n.stages) {
            for (const auto& [gpu, steps] : st.steps) {
              for (const NetworkStep& step : steps) {
                int64_t sent = 0, received = 0;
                for (const NetworkOp& op : step.ops) (op.send ? sent : received) += op.bytes;
                INFO("GPU " << gpu << " step of " << step.ops.size() << " operations");
                CHECK((step.ops.size() <= 1 || (sent <= target && received <= target)));
              }
              if (step_bytes == int64_t{1} << 30)
                most_steps_of_1g_target = std::max(most_steps_of_1g_target, steps.size());
            }
          }
        }
      }
    }
  }
  CHECK(zero_copied > 0);  // the zero-copy path was exercised
  CHECK(staged > zero_copied);
  // These plans move far less than 1 GiB, yet their stages are still cut into several steps, so
  // that pack, wire and unpack overlap.
  CHECK(most_steps_of_1g_target > 1);
}

TEST_CASE("a staging budget below one step is refused with what to change") {
  TestRun run(7);
  auto wide = Build(run, int64_t{1} << 30, int64_t{1} << 40, 4);
  REQUIRE(wide.ok());
  int64_t region = 0;
  for (const auto& n : wide->nodes) {
    for (const auto& [gpu, r] : n.region_bytes) region = std::max(region, r);
  }
  REQUIRE(region > 0);
  auto c = Build(run, region - 1, int64_t{1} << 40, 4);
  REQUIRE(c.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(c.status().message()), Catch::Contains("--staging-bytes"));
}

TEST_CASE(
    "a quantizing descriptor is never zero-copy, though its dtypes match and its ends are "
    "contiguous") {
  CopyDescriptor d;  // the scales of a one-row fp32 region: fp32 to fp32, contiguous at both ends
  d.op = CopyOp::kScale;
  d.quant_format = static_cast<uint8_t>(QuantFormat::kBlockFp8);
  d.block_rows = d.block_cols = 128;
  d.src_dtype = d.dst_dtype = DType::kF32;
  d.outer_rank = 1;
  d.count[0] = 1;
  d.inner = 4096;
  d.src_stride[0] = 4096;
  d.dst_stride[0] = 32;
  CHECK_FALSE(IsZeroCopy(d, 1));
  d.op = CopyOp::kCopy;
  CHECK(IsZeroCopy(d, 1));  // the same geometry copied is
  d.op = CopyOp::kQuantize;
  d.dst_dtype = DType::kF8E4M3;
  CHECK_FALSE(IsZeroCopy(d, 1));
}

// fp32 weights into block fp8 across nodes, every descriptor large enough for zero-copy: the
// one-row tensor's scales (fp32 to fp32, contiguous) must still be computed by the pack step.
TEST_CASE("fp8 destinations across nodes: quantizing descriptors are packed, the rest zero-copy") {
  Layout src, dst;
  testing::AddSplitTensor(src, "row", Dims{1, 4096}, DType::kF32, 1, {0, 4096}, {{0, 0}}, "t");
  testing::AddSplitTensor(src, "w", Dims{256, 1024}, DType::kF32, 0, {0, 128, 256},
                          {{0, 0}, {0, 1}}, "t");
  testing::AddSplitTensor(src, "b", Dims{64, 512}, DType::kF32, 0, {0, 64}, {{0, 1}}, "t");
  for (const std::string name : {"row", "w"}) {
    const Quantization q = Quantization::Of(QuantFormat::kBlockFp8, name);
    const Dims shape = name == "row" ? Dims{1, 4096} : Dims{256, 1024};
    const int32_t w = dst.AddTensor(name, shape, DType::kF8E4M3);
    dst.tensors[w].quant = q;
    const Dims grid{(shape[0] + 127) / 128, shape[1] / 128};
    const int32_t s = dst.AddTensor(q.scale, grid, DType::kF32);
    const int32_t worker = dst.workers.empty() ? dst.AddWorker("e0", 1, 0) : 0;
    const int32_t codes = dst.AddBuffer(worker, name, DType::kF8E4M3, shape);
    dst.AddPiece(w, Box::Whole(shape), codes, Box::Whole(shape));
    const int32_t scales = dst.AddBuffer(worker, q.scale, DType::kF32, grid);
    dst.AddPiece(s, Box::Whole(grid), scales, Box::Whole(grid));
  }
  testing::AddSplitTensor(dst, "b", Dims{64, 512}, DType::kF32, 0, {0, 64}, {{1, 0}}, "e");
  REQUIRE(ValidateLayout(src, "source").ok());
  REQUIRE(ValidateLayout(dst, "destination").ok());
  auto plan = MakePlan(src, dst, PlanOptions{});
  INFO(plan.status().message());
  REQUIRE(plan.ok());
  int64_t quantizing = 0, same_dtype_contiguous_scales = 0;
  for (const CopyDescriptor& d : plan->descriptors) {
    quantizing += d.Quantizes();
    CopyDescriptor as_copy = d;
    as_copy.op = CopyOp::kCopy;
    same_dtype_contiguous_scales += d.op == CopyOp::kScale && IsZeroCopy(as_copy, 8);
    CHECK_FALSE((d.Quantizes() && IsZeroCopy(d, 1)));
  }
  REQUIRE(quantizing > 0);
  REQUIRE(same_dtype_contiguous_scales > 0);  // the case that used to travel zero-copy
  HostBuffers in(src), ref(dst), got(dst);
  const auto ref_scratch = AllocateScratch(*plan, ref.memory);
  const auto got_scratch = AllocateScratch(*plan, got.memory);
  const FillSpec spec = MakeFillSpec(src, dst, 3);
  FillSources(src, spec, in.memory);
  PoisonDestinations(ref.memory);
  PoisonDestinations(got.memory);
  ExecuteOnHost(*plan, in.memory, ref.memory);
  for (int32_t depth : {1, 2}) {
    auto c = Build(*plan, in.addresses(), got.addresses(), int64_t{1} << 30, 8, depth);
    REQUIRE(c.ok());
    int64_t zero_copied = 0;
    for (const auto& n : c->nodes) zero_copied += n.bytes_zero_copy;
    CHECK(zero_copied > 0);  // "b" and nothing quantizing
    Execute(*plan, *c);
    for (size_t b = 0; b < dst.buffers.size(); ++b) REQUIRE(ref.storage[b] == got.storage[b]);
    auto checked = CheckDestinations(src, dst, spec, got.memory);
    INFO(checked.status().message());
    REQUIRE(checked.ok());
    PoisonDestinations(got.memory);
  }
}

TEST_CASE("contiguous same-dtype descriptors are zero-copy; strided or cast ones are not") {
  CopyDescriptor d;
  d.inner = 1024;
  d.src_dtype = d.dst_dtype = DType::kBF16;
  CHECK(IsZeroCopy(d, 2048));
  CHECK_FALSE(IsZeroCopy(d, 2049));
  d.outer_rank = 1;
  d.count[0] = 4;
  d.src_stride[0] = 1024;
  d.dst_stride[0] = 1024;
  CHECK(IsZeroCopy(d, 1));
  d.dst_stride[0] = 2048;  // a column block of a wider destination
  CHECK_FALSE(IsZeroCopy(d, 1));
  d.dst_stride[0] = 1024;
  d.dst_dtype = DType::kF32;
  CHECK_FALSE(IsZeroCopy(d, 1));
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST_CASE("the executor model: the slowest of wire, packs and unpacks, plus the pipeline's fill") {
  NodeSchedule s;
  s.stages.resize(kMaxStages);
  s.uses_network = true;
  auto& steps = s.stages[0].steps[0];
  steps.resize(2);
  steps[0].ops = {NetworkOp{1, true, false, 1000, 0},
                  NetworkOp{1, true, true, 3000, 0}};  // staged, zero-copy
  steps[0].pack.bytes = 1000;
  steps[0].pack.items.resize(1);
  steps[1].ops = {NetworkOp{1, true, false, 2000, 0}, NetworkOp{1, false, false, 500, 0}};
  steps[1].pack.bytes = 2000;
  steps[1].pack.items.resize(1);
  steps[1].unpack.bytes = 500;
  steps[1].unpack.items.resize(1);
  // 1 GB/s wire, 2 us per operation, 10 GB/s pack, 100 ns per item, 5 us fixed.
  ExecutorModel m{1.0, 2.0, 10.0, 100.0, 5.0};
  // Wire-bound: max(6000 sent, 500 received) bytes at 1 GB/s = 6 us + 4 operations = 14 us (packs
  // 0.5 us, unpacks 0.15 us); the first pack (0.1 + 0.1 us) and the last unpack (0.05 + 0.1 us)
  // are not overlapped; fixed 5 us.
  CHECK(PredictNetworkSeconds(s, m) == Approx((14.0 + 0.2 + 0.15 + 5.0) * 1e-6));
  // Pack-bound when each item costs 20 us: packs 0.3 + 40 us, then the same fill terms.
  m.per_item_ns = 20000.0;
  CHECK(PredictNetworkSeconds(s, m) == Approx((40.3 + 20.1 + 20.05 + 5.0) * 1e-6));
  // A second stage on another GPU adds its own slowest GPU's time.
  m.per_item_ns = 100.0;
  s.stages[1].steps[3].push_back(NetworkStep{{NetworkOp{0, false, true, 4000, 0}}, {}, {}});
  CHECK(PredictNetworkSeconds(s, m) == Approx((14.0 + 0.2 + 0.15 + 5.0 + 4.0 + 2.0) * 1e-6));
  s.uses_network = false;
  CHECK(PredictNetworkSeconds(s, m) == 0.0);
}

}  // namespace
}  // namespace refit
