#include "plan/planner.h"

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"
#include "plan/verify.h"

namespace refit {
namespace {
using testing::AddSplitTensor;
using testing::B;
using testing::EvenSplit;
using testing::Placement;

constexpr int64_t kGiB = int64_t{1} << 30;

Plan PlanAndVerify(Layout& src, Layout& dst, PlanOptions options = {}) {
  REQUIRE(ValidateLayout(src, "source").ok());
  REQUIRE(ValidateLayout(dst, "destination").ok());
  auto plan = MakePlan(src, dst, options);
  INFO(plan.status().message());
  REQUIRE(plan.ok());
  auto verified = VerifyOnHost(*plan, src, dst, 42, kGiB);
  INFO(verified.status().message());
  REQUIRE(verified.ok());
  CHECK(plan->stats.predicted_seconds >= plan->stats.lower_bound_seconds);
  return *std::move(plan);
}

TEST_CASE("uneven TP4 on rows to TP2 on columns, one node") {
  Layout src, dst;
  AddSplitTensor(src, "w", Dims{10, 6}, DType::kBF16, 0, {0, 4, 7, 9, 10},
                 {{0, 0}, {0, 1}, {0, 2}, {0, 3}}, "trainer");
  AddSplitTensor(dst, "w", Dims{10, 6}, DType::kBF16, 1, {0, 5, 6}, {{0, 4}, {0, 5}}, "engine");
  const Plan plan = PlanAndVerify(src, dst);
  CHECK(plan.stats.bytes_total == 10 * 6 * 2);
  CHECK(plan.stats.bytes_nvlink == plan.stats.bytes_total);
  CHECK(plan.stats.transfers == 8);
}

TEST_CASE("colocated, same split: every byte stays on its GPU") {
  Layout src, dst;
  AddSplitTensor(src, "w", Dims{8, 8}, DType::kF32, 0, EvenSplit(8, 2), {{0, 0}, {0, 1}}, "fsdp");
  AddSplitTensor(dst, "w", Dims{8, 8}, DType::kF32, 0, EvenSplit(8, 2), {{0, 0}, {0, 1}}, "vllm");
  const Plan plan = PlanAndVerify(src, dst);
  CHECK(plan.stats.bytes_local == 8 * 8 * 4);
  CHECK(plan.stats.bytes_network == 0);
  CHECK(plan.stats.bytes_nvlink == 0);
}

TEST_CASE("a replica on the destination's node is preferred over the network") {
  Layout src, dst;
  // Two data-parallel replicas: node 0 and node 1.
  AddSplitTensor(src, "w", Dims{4, 4}, DType::kBF16, 0, {0, 4}, {{0, 0}}, "dp0_");
  AddSplitTensor(src, "w", Dims{4, 4}, DType::kBF16, 0, {0, 4}, {{1, 0}}, "dp1_");
  AddSplitTensor(dst, "w", Dims{4, 4}, DType::kBF16, 0, {0, 4}, {{1, 3}}, "engine");
  const Plan plan = PlanAndVerify(src, dst);
  CHECK(plan.stats.bytes_network == 0);
  CHECK(plan.stats.bytes_nvlink == 32);
}

TEST_CASE("topology routing: a region two GPUs of a node need crosses the network once") {
  Layout src, dst;
  AddSplitTensor(src, "w", Dims{64, 64}, DType::kBF16, 0, {0, 64}, {{0, 0}}, "trainer");
  AddSplitTensor(dst, "w", Dims{64, 64}, DType::kBF16, 0, {0, 64}, {{1, 0}}, "replica0_");
  AddSplitTensor(dst, "w", Dims{64, 64}, DType::kBF16, 0, {0, 64}, {{1, 1}}, "replica1_");
  const int64_t bytes = 64 * 64 * 2;
  SECTION("routing on") {
    const Plan plan = PlanAndVerify(src, dst);
    CHECK(plan.stats.bytes_network == bytes);
    CHECK(plan.stats.bytes_nvlink == bytes);
    CHECK(plan.stats.bytes_forwarded == bytes);
    bool has_stage1 = false;
    for (const Message& m : plan.messages) has_stage1 |= m.stage == 1;
    CHECK(has_stage1);
  }
  SECTION("routing off") {
    PlanOptions options;
    options.routing = false;
    const Plan plan = PlanAndVerify(src, dst, options);
    CHECK(plan.stats.bytes_network == 2 * bytes);
    CHECK(plan.stats.bytes_nvlink == 0);
  }
}

TEST_CASE("a source that holds the only copy is relieved by relays between destination nodes") {
  Layout src, dst;
  // One trainer GPU holds 8 tensors; 4 engine nodes each need all of them.
  for (int t = 0; t < 8; ++t) {
    const std::string name = absl::StrCat("w", t);
    AddSplitTensor(src, name, Dims{512, 512}, DType::kBF16, 0, {0, 512}, {{0, 0}}, "trainer");
    for (int n = 1; n <= 4; ++n) {
      AddSplitTensor(dst, name, Dims{512, 512}, DType::kBF16, 0, {0, 512}, {{n, 0}},
                     absl::StrCat("engine", n, "_"));
    }
  }
  const int64_t total = 8 * 512 * 512 * 2;  // 4 MiB, in messages of 64 KiB
  PlanOptions direct;
  direct.max_message_bytes = 64 << 10;
  direct.max_relay_depth = 0;
  const Plan without = PlanAndVerify(src, dst, direct);
  CHECK(without.stats.max_nic_bytes == 4 * total);  // the source's NIC sends every copy
  CHECK(without.stats.stages == 1);
  PlanOptions relayed = direct;
  relayed.max_relay_depth = 3;
  const Plan with = PlanAndVerify(src, dst, relayed);
  CHECK(with.stats.bytes_network == 4 * total);  // still one copy into each node
  CHECK(with.stats.max_nic_bytes <= 2 * total);
  CHECK(with.stats.stages > 1);
  CHECK(with.stats.predicted_seconds < without.stats.predicted_seconds);
}

TEST_CASE("sources are balanced across replicas' NICs") {
  Layout src, dst;
  // Four data-parallel replicas on node 0, GPUs 0..3; eight tensors needed on node 1.
  for (int t = 0; t < 8; ++t) {
    const std::string name = absl::StrCat("layer", t);
    for (int r = 0; r < 4; ++r) {
      AddSplitTensor(src, name, Dims{256, 256}, DType::kBF16, 0, {0, 256}, {{0, r}},
                     absl::StrCat("dp", r, "_"));
    }
    AddSplitTensor(dst, name, Dims{256, 256}, DType::kBF16, 1, EvenSplit(256, 4),
                   {{1, 0}, {1, 1}, {1, 2}, {1, 3}}, "tp");
  }
  const Plan plan = PlanAndVerify(src, dst);
  const int64_t total = 8 * 256 * 256 * 2;
  CHECK(plan.stats.bytes_network == total);
  CHECK(plan.stats.max_nic_bytes == total / 4);  // perfectly balanced senders and receivers
  CHECK(plan.stats.predicted_seconds <= 1.05 * plan.stats.lower_bound_seconds);
}

TEST_CASE(
    "experts split alike: each routed by the loads it meets, the same plan on any thread count") {
  // 1024 experts, each whole on one of 32 trainer GPUs (4 nodes); two engine replicas, each TP16
  // over two nodes: every engine GPU needs a slice of every expert, 32768 transfers, more than
  // one of the lowering's batches.
  Layout src, dst;
  std::vector<Placement> replica0, replica1;
  for (int g = 0; g < 16; ++g) {
    replica0.push_back({4 + g / 8, g % 8});
    replica1.push_back({6 + g / 8, g % 8});
  }
  for (int e = 0; e < 1024; ++e) {
    const std::string name = absl::StrCat("expert", e);
    const int trainer = e % 32;
    AddSplitTensor(src, name, Dims{64, 16}, DType::kBF16, 0, {0, 64}, {{trainer / 8, trainer % 8}},
                   absl::StrCat("trainer", trainer, "_"));
    AddSplitTensor(dst, name, Dims{64, 16}, DType::kBF16, 0, EvenSplit(64, 16), replica0, "r0_");
    AddSplitTensor(dst, name, Dims{64, 16}, DType::kBF16, 0, EvenSplit(64, 16), replica1, "r1_");
  }
  PlanOptions options;
  options.max_message_bytes = 4096;
  options.threads = 1;
  const Plan one = PlanAndVerify(src, dst, options);
  CHECK(one.stats.transfers == 1024 * 32);
  // Each replica's slices cross the network once (from the owner, or relayed from the other).
  CHECK(one.stats.bytes_network == 2 * 1024 * 64 * 16 * 2);
  CHECK(one.stats.predicted_seconds <= 1.05 * one.stats.lower_bound_seconds);
  for (int32_t threads : {2, 3}) {
    options.threads = threads;
    auto other = MakePlan(src, dst, options);
    REQUIRE(other.ok());
    INFO("threads " << threads);
    CHECK(testing::PlanDifference(one, *other) == "");
  }
}

// Lowering on a second thread, with many more descriptors than the planner reserves (each
// destination row block gathers eight column blocks): the vector moves while the threads work
// (and the router stops faulting in its pages ahead of the lowering), and the plan must not change.
TEST_CASE("threads make the same plan when the descriptors outgrow their reserve") {
  Layout src, dst;
  std::vector<Placement> trainers, engines;
  for (int g = 0; g < 8; ++g) {
    trainers.push_back({0, g});
    engines.push_back({1 + g / 4, g % 4});
  }
  for (int t = 0; t < 4096; ++t) {
    const std::string name = absl::StrCat("w", t);
    AddSplitTensor(src, name, Dims{64, 64}, DType::kBF16, 1, EvenSplit(64, 8), trainers, "trainer");
    AddSplitTensor(dst, name, Dims{64, 64}, DType::kBF16, 0, EvenSplit(64, 8), engines, "engine");
  }
  PlanOptions options;
  options.threads = 1;
  const Plan one = PlanAndVerify(src, dst, options);
  REQUIRE(one.stats.descriptors > 4 * static_cast<int64_t>(dst.pieces.size()));
  options.threads = 2;
  auto two = MakePlan(src, dst, options);
  REQUIRE(two.ok());
  CHECK(testing::PlanDifference(one, *two) == "");
}

TEST_CASE("a destination element with no source is refused, saying how much is missing") {
  Layout src, dst;
  AddSplitTensor(src, "w", Dims{8, 4}, DType::kBF16, 0, {0, 3, 6}, {{0, 0}, {0, 1}}, "trainer");
  AddSplitTensor(dst, "w", Dims{8, 4}, DType::kBF16, 0, {0, 8}, {{1, 0}}, "engine");
  REQUIRE(ValidateLayout(src, "source").ok());
  REQUIRE(ValidateLayout(dst, "destination").ok());
  auto plan = MakePlan(src, dst, {});
  REQUIRE_FALSE(plan.ok());
  const std::string e(plan.status().message());
  INFO(e);
  CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(e.find("8 of 32 elements") != std::string::npos);
  CHECK(e.find("[6:8, 0:4]") != std::string::npos);
  CHECK(e.find("\"engine0\"") != std::string::npos);
}

TEST_CASE("bf16 trained, fp32 and fp16 served: cast on the way, checked exactly") {
  Layout src, dst;
  AddSplitTensor(src, "a", Dims{6, 6}, DType::kBF16, 0, EvenSplit(6, 2), {{0, 0}, {0, 1}}, "t");
  AddSplitTensor(src, "b", Dims{6, 6}, DType::kF32, 0, EvenSplit(6, 2), {{0, 0}, {0, 1}}, "t");
  AddSplitTensor(dst, "a", Dims{6, 6}, DType::kF32, 1, EvenSplit(6, 3), {{1, 0}, {1, 1}, {1, 2}},
                 "e");
  AddSplitTensor(dst, "b", Dims{6, 6}, DType::kF16, 1, EvenSplit(6, 3), {{1, 0}, {1, 1}, {1, 2}},
                 "e");
  const Plan plan = PlanAndVerify(src, dst);
  CHECK(plan.stats.bytes_network == 36 * 2 + 36 * 2);  // the narrower dtype travels
}

TEST_CASE("scalars and rank-6 tensors") {
  Layout src, dst;
  AddSplitTensor(src, "scale", Dims{}, DType::kF32, 0, {}, {}, "unused");
  {
    const int32_t t = src.tensors.size() - 1;
    const int32_t w = src.AddWorker("t0", 0, 0);
    src.AddPiece(t, Box(), src.AddBuffer(w, "scale", DType::kF32, Dims{}), Box());
  }
  AddSplitTensor(src, "six", Dims{2, 3, 2, 3, 2, 3}, DType::kI64, 3, EvenSplit(3, 3),
                 {{0, 0}, {0, 1}, {0, 2}}, "t");
  {
    const int32_t t = dst.AddTensor("scale", Dims{}, DType::kF32);
    const int32_t w = dst.AddWorker("e0", 1, 0);
    dst.AddPiece(t, Box(), dst.AddBuffer(w, "scale", DType::kF32, Dims{1}), B({0}, {1}));
  }
  AddSplitTensor(dst, "six", Dims{2, 3, 2, 3, 2, 3}, DType::kI64, 5, EvenSplit(3, 2),
                 {{1, 0}, {1, 1}}, "e");
  PlanAndVerify(src, dst);
}

TEST_CASE("many small tensors travel in few messages; messages respect their bound") {
  Layout src, dst;
  const int32_t sw = src.AddWorker("trainer", 0, 0);
  const int32_t dw = dst.AddWorker("engine", 1, 0);
  for (int i = 0; i < 1000; ++i) {
    const std::string name = absl::StrCat("t", i);
    const int32_t st = src.AddTensor(name, Dims{100}, DType::kBF16);
    src.AddPiece(st, B({0}, {100}), src.AddBuffer(sw, name, DType::kBF16, Dims{100}),
                 B({0}, {100}));
    const int32_t dt = dst.AddTensor(name, Dims{100}, DType::kBF16);
    dst.AddPiece(dt, B({0}, {100}), dst.AddBuffer(dw, name, DType::kBF16, Dims{100}),
                 B({0}, {100}));
  }
  const Plan one = PlanAndVerify(src, dst);
  CHECK(one.stats.messages == 1);
  CHECK(one.stats.descriptors == 1000);
  PlanOptions small;
  small.max_message_bytes = 4096 + 100;
  const Plan many = PlanAndVerify(src, dst, small);
  CHECK(many.stats.messages == (1000 * 200 + 4095) / 4096 + 1);  // ~4 KiB each, tensors split
  for (const Message& m : many.messages) CHECK(m.bytes <= small.max_message_bytes);
}

}  // namespace
}  // namespace refit
