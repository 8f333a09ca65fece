// The planner's block rule for fp8 destinations: every plan here is executed on the host
// and every code and scale compared with the CPU reference quantizing the whole tensor
// (VerifyOnHost); the destination is poisoned first, so a code or scale written twice, misplaced
// or left out shows.
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
using testing::AddFlatShard;
using testing::AddQuantized;
using testing::AddSplitTensor;
using testing::EvenSplit;
using testing::Placement;
using testing::PlanDifference;

constexpr int64_t kGiB = int64_t{1} << 30;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

Plan PlanAndVerify(Layout& src, Layout& dst, PlanOptions options = {}) {
  auto s = ValidateLayout(src, "source");
  INFO(s.message());
  REQUIRE(s.ok());
  s = ValidateLayout(dst, "destination");
  INFO(s.message());
  REQUIRE(s.ok());
  auto plan = MakePlan(src, dst, options);
  INFO(plan.status().message());
  REQUIRE(plan.ok());
  auto verified = VerifyOnHost(*plan, src, dst, 42, kGiB);
  INFO(verified.status().message());
  REQUIRE(verified.ok());
  CHECK(plan->stats.predicted_seconds >= plan->stats.lower_bound_seconds);
  return *std::move(plan);
}

TEST_CASE("fp8: trainers holding whole blocks quantize in the pack step; fp8 on the wire") {
  Layout src, dst;
  AddSplitTensor(src, "w", Dims{256, 384}, DType::kBF16, 0, {0, 128, 256}, {{0, 0}, {0, 1}},
                 "trainer");
  AddQuantized(dst, "w", Dims{256, 384}, QuantFormat::kBlockFp8, 128, 128, 1, {0, 256, 384},
               {{1, 0}, {1, 1}}, "engine");
  const Plan plan = PlanAndVerify(src, dst);
  CHECK(plan.scratch.empty());
  CHECK(plan.stats.bytes_gathered == 0);
  // Every code once, every scale once, nothing at bf16.
  CHECK(plan.stats.bytes_network == 256 * 384 + 2 * 3 * 4);
  CHECK(plan.stats.bytes_before_conversion == 256 * 384 * 2);
  CHECK(plan.stats.tensors == 2);
}

TEST_CASE("fp8: partial edge blocks, fp32 and fp16 sources") {
  for (DType from : {DType::kF32, DType::kF16, DType::kBF16}) {
    Layout src, dst;
    AddSplitTensor(src, "w", Dims{300, 200}, from, 0, {0, 128, 300}, {{0, 0}, {0, 1}}, "t");
    AddQuantized(dst, "w", Dims{300, 200}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 256, 300},
                 {{1, 0}, {1, 1}}, "e");
    const Plan plan = PlanAndVerify(src, dst);
    CHECK(plan.stats.bytes_gathered == 0);
  }
}

TEST_CASE("fp8: shards cut inside a block are gathered into scratch and quantized there") {
  // FSDP2 over 4 ranks of a 256-row weight: 64 rows each, every block split in two.
  Layout src, dst;
  AddSplitTensor(src, "w", Dims{256, 256}, DType::kBF16, 0, EvenSplit(256, 4),
                 {{0, 0}, {0, 1}, {0, 2}, {0, 3}}, "fsdp");
  AddQuantized(dst, "w", Dims{256, 256}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 128, 256},
               {{1, 0}, {1, 1}}, "tp");
  const Plan plan = PlanAndVerify(src, dst);
  CHECK(plan.stats.bytes_gathered == 256 * 256 * 2);
  CHECK(plan.stats.bytes_before_conversion == 256 * 256 * 2);  // each element once, at bf16
  CHECK(plan.stats.scratch_bytes == 256 * 256 * 2);
  CHECK(plan.scratch.size() == 2);
  // The gathered bf16 crosses the network; codes and scales are made on the engine's GPU.
  CHECK(plan.stats.bytes_network == 256 * 256 * 2);
  CHECK(plan.stats.bytes_local == 256 * 256 + 4 * 4);
}

TEST_CASE("fp8: FSDP flat ranges mix whole and cut blocks") {
  Layout src, dst;
  const Dims shape{384, 256};
  const int32_t t = src.AddTensor("w", shape, DType::kBF16);
  const std::vector<int64_t> cuts = {0, 40000, 70001, 384 * 256};
  for (size_t r = 0; r + 1 < cuts.size(); ++r) {
    const int32_t worker = src.AddWorker(absl::StrCat("fsdp", r), 0, static_cast<int32_t>(r));
    AddFlatShard(src, t, worker, cuts[r], cuts[r + 1]);
  }
  AddQuantized(dst, "w", shape, QuantFormat::kBlockFp8, 128, 128, 1, {0, 128, 256},
               {{1, 0}, {1, 1}}, "tp");
  const Plan plan = PlanAndVerify(src, dst);
  CHECK(plan.stats.bytes_gathered > 0);
  CHECK(plan.stats.bytes_gathered < 384 * 256 * 2);
}

TEST_CASE("fp8: replicas on one node get the codes over the network once, then NVLink") {
  Layout src, dst;
  AddSplitTensor(src, "w", Dims{256, 256}, DType::kBF16, 0, {0, 256}, {{0, 0}}, "t");
  AddQuantized(dst, "w", Dims{256, 256}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 256}, {{1, 0}},
               "a");
  AddQuantized(dst, "w", Dims{256, 256}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 256}, {{1, 1}},
               "b");
  const Plan plan = PlanAndVerify(src, dst);
  CHECK(plan.stats.bytes_network == 256 * 256 + 4 * 4);
  CHECK(plan.stats.bytes_nvlink == 256 * 256 + 4 * 4);
}

TEST_CASE("fp8: colocated on one GPU, the pack step quantizes locally") {
  Layout src, dst;
  AddSplitTensor(src, "w", Dims{128, 512}, DType::kBF16, 1, {0, 256, 512}, {{0, 0}, {0, 1}}, "t");
  AddQuantized(dst, "w", Dims{128, 512}, QuantFormat::kBlockFp8, 128, 128, 1, {0, 256, 512},
               {{0, 0}, {0, 1}}, "e");
  const Plan plan = PlanAndVerify(src, dst);
  CHECK(plan.stats.bytes_local == 128 * 512 + 4 * 4);
  CHECK(plan.stats.bytes_nvlink == 0);
}

TEST_CASE("MXFP8: 1x32 blocks, a column split inside a block, small messages") {
  Layout src, dst;
  AddSplitTensor(src, "w", Dims{64, 100}, DType::kBF16, 1, {0, 50, 100}, {{0, 0}, {0, 1}}, "t");
  AddQuantized(dst, "w", Dims{64, 100}, QuantFormat::kMxfp8, 1, 32, 1, {0, 64, 100},
               {{1, 0}, {1, 1}}, "e");
  PlanOptions options;
  options.max_message_bytes = 300;  // cut at block boundaries into many parts
  const Plan plan = PlanAndVerify(src, dst, options);
  CHECK(plan.stats.bytes_gathered == 64 * 32 * 2);  // columns 32..64 straddle the cut at 50
}

TEST_CASE("fp8: a source already fp8 with its scales is copied, not quantized again") {
  Layout src, dst;
  AddQuantized(src, "w", Dims{256, 128}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 128, 256},
               {{0, 0}, {0, 1}}, "t");
  AddQuantized(dst, "w", Dims{256, 128}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 256}, {{1, 0}},
               "e");
  const Plan plan = PlanAndVerify(src, dst);
  for (const CopyDescriptor& d : plan.descriptors) CHECK(d.op == CopyOp::kCopy);
}

TEST_CASE("fp8: random shapes, blocks, splits and placements verify") {
  std::mt19937_64 rng(17);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 120; ++trial) {
    const bool mx = uniform(0, 3) == 0;
    const int64_t br = mx ? 1 : uniform(1, 3) * 4, bc = mx ? 32 : uniform(1, 3) * 4;
    const Dims shape{uniform(1, 40), uniform(1, 70)};
    INFO("trial " << trial << " shape " << shape.ToString() << " block " << br << "x" << bc);
    Layout src, dst;
    const DType from = static_cast<DType>(uniform(0, 2));
    const int32_t t = src.AddTensor("w", shape, from);
    // Two source replicas, each cut at random flat offsets or along a random dimension.
    for (int replica = 0; replica < 2; ++replica) {
      const int parts = static_cast<int>(uniform(1, 4));
      std::vector<int64_t> cuts = {0, shape[0] * shape[1]};
      for (int k = 1; k < parts; ++k) cuts.push_back(uniform(0, shape[0] * shape[1]));
      std::sort(cuts.begin(), cuts.end());
      for (size_t k = 0; k + 1 < cuts.size(); ++k) {
        if (cuts[k] == cuts[k + 1]) continue;
        const int32_t worker =
            src.AddWorker(absl::StrCat("r", replica, "_", k), static_cast<int32_t>(uniform(0, 2)),
                          static_cast<int32_t>(uniform(0, 3)));
        AddFlatShard(src, t, worker, cuts[k], cuts[k + 1]);
      }
    }
    // Destinations: one or two replicas, TP along a dimension at block multiples.
    const int replicas = static_cast<int>(uniform(1, 2));
    for (int replica = 0; replica < replicas; ++replica) {
      const int dim = static_cast<int>(uniform(0, 1));
      const int64_t block = dim == 0 ? br : bc;
      const int64_t blocks = CeilDiv(shape[dim], block);
      std::vector<int64_t> b = {0};
      const int64_t cut = uniform(0, blocks);
      if (cut > 0 && cut < blocks) b.push_back(cut * block);
      b.push_back(shape[dim]);
      std::vector<Placement> at;
      for (size_t k = 0; k + 1 < b.size(); ++k) {
        at.push_back({static_cast<int32_t>(uniform(0, 2)), static_cast<int32_t>(uniform(0, 3))});
      }
      AddQuantized(dst, "w", shape, mx ? QuantFormat::kMxfp8 : QuantFormat::kBlockFp8, br, bc, dim,
                   b, at, absl::StrCat("e", replica, "_"));
    }
    PlanOptions options;
    options.max_message_bytes = uniform(0, 1) ? 64 : int64_t{1} << 20;
    options.threads = 1;
    const Plan plan = PlanAndVerify(src, dst, options);
    // Gathering into scratch lowers on the routing thread, after what the lowering thread holds.
    options.threads = 2;
    auto threaded = MakePlan(src, dst, options);
    REQUIRE(threaded.ok());
    REQUIRE(PlanDifference(plan, *threaded) == "");
  }
}

TEST_CASE("fp8 layouts: what is refused, and how it is named") {
  auto refusal = [](Layout& dst) {
    Layout src;
    AddSplitTensor(src, "w", Dims{256, 256}, DType::kBF16, 0, {0, 256}, {{0, 0}}, "t");
    REQUIRE(ValidateLayout(src, "source").ok());
    absl::Status s = ValidateLayout(dst, "destination");
    if (s.ok()) s = MakePlan(src, dst, {}).status();
    return std::string(s.message());
  };
  SECTION("a piece that cuts a block") {
    Layout dst;
    AddQuantized(dst, "w", Dims{256, 256}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 100, 256},
                 {{0, 0}, {0, 1}}, "e");
    CHECK_THAT(refusal(dst), Catch::Contains("cuts a 128x128 block") && Catch::Contains("\"w\""));
  }
  SECTION("no scale tensor") {
    Layout dst;
    AddQuantized(dst, "w", Dims{256, 256}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 256}, {{0, 0}},
                 "e");
    dst.tensors[0].quant.scale = "w_scales";
    CHECK_THAT(refusal(dst), Catch::Contains("\"w_scales\", which the layout does not declare"));
  }
  SECTION("a scale tensor of the wrong shape") {
    Layout dst;
    AddQuantized(dst, "w", Dims{256, 256}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 256}, {{0, 0}},
                 "e");
    dst.tensors[0].quant.block_rows = 64;
    CHECK_THAT(refusal(dst), Catch::Contains("expected fp32 [4, 2]"));
  }
  SECTION("bf16 into fp8 without a declared quantization") {
    Layout dst;
    AddSplitTensor(dst, "w", Dims{256, 256}, DType::kF8E4M3, 0, {0, 256}, {{0, 0}}, "e");
    CHECK_THAT(refusal(dst), Catch::Contains("declare the destination tensor's quantization"));
  }
  SECTION("a cut block whose parts the source does not all hold") {
    // Rows 0:64 and 100:256 only: the block of rows 0:128 is cut and partly missing.
    Layout src, dst;
    AddSplitTensor(src, "w", Dims{256, 256}, DType::kBF16, 0, {0, 64}, {{0, 0}}, "t");
    AddSplitTensor(src, "w", Dims{256, 256}, DType::kBF16, 0, {100, 256}, {{0, 1}}, "u");
    AddQuantized(dst, "w", Dims{256, 256}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 256}, {{1, 0}},
                 "e");
    REQUIRE(ValidateLayout(src, "source").ok());
    REQUIRE(ValidateLayout(dst, "destination").ok());
    auto plan = MakePlan(src, dst, {});
    REQUIRE(!plan.ok());
    CHECK_THAT(std::string(plan.status().message()),
               Catch::Contains("have no source") && Catch::Contains("\"w\""));
  }
  SECTION("two weights sharing one scale tensor") {
    Layout src, dst;
    AddSplitTensor(src, "w", Dims{256, 256}, DType::kBF16, 0, {0, 256}, {{0, 0}}, "t");
    AddSplitTensor(src, "v", Dims{256, 256}, DType::kBF16, 0, {0, 256}, {{0, 0}}, "t");
    AddQuantized(dst, "w", Dims{256, 256}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 256}, {{1, 0}},
                 "e");
    const int32_t v = dst.AddTensor("v", Dims{256, 256}, DType::kF8E4M3);
    dst.tensors[v].quant = Quantization::Of(QuantFormat::kBlockFp8, "w");  // w's scale
    const int32_t b = dst.AddBuffer(0, "v", DType::kF8E4M3, Dims{256, 256});
    dst.AddPiece(v, Box::Whole(Dims{256, 256}), b, Box::Whole(Dims{256, 256}));
    auto s = ValidateLayout(dst, "destination");
    REQUIRE(!s.ok());
    CHECK_THAT(std::string(s.message()),
               Catch::Contains("name the same scale tensor \"w_scale_inv\""));
  }
  SECTION("scales without their codes, of blocks cut between sources") {
    Layout src, dst;
    AddSplitTensor(src, "w", Dims{256, 256}, DType::kBF16, 0, {0, 64, 256}, {{0, 0}, {0, 1}}, "t");
    AddQuantized(dst, "w", Dims{256, 256}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 256}, {{1, 0}},
                 "e");
    // Another worker, on another GPU, holds only the scale of block (0, 0).
    const int32_t worker = dst.AddWorker("scales-only", 1, 1);
    const int32_t b = dst.AddBuffer(worker, "s", DType::kF32, Dims{1, 1});
    dst.AddPiece(dst.tensor_index.contains("w_scale_inv") ? dst.tensor_index.at("w_scale_inv") : 1,
                 Box::FromDims(Dims{0, 0}, Dims{1, 1}), b, Box::Whole(Dims{1, 1}));
    REQUIRE(ValidateLayout(src, "source").ok());
    REQUIRE(ValidateLayout(dst, "destination").ok());
    auto plan = MakePlan(src, dst, {});
    REQUIRE(!plan.ok());
    CHECK_THAT(std::string(plan.status().message()), Catch::Contains("without their codes"));
  }
  SECTION("MXFP8 with another block") {
    Layout dst;
    AddQuantized(dst, "w", Dims{256, 256}, QuantFormat::kMxfp8, 1, 32, 0, {0, 256}, {{0, 0}}, "e");
    dst.tensors[0].quant.block_cols = 16;
    CHECK_THAT(refusal(dst), Catch::Contains("MXFP8 blocks are 1x32"));
  }
}

}  // namespace
}  // namespace refit
