#include "plan/plan_slice.h"

#include <catch2/catch.hpp>

#include "plan/host_copy.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"
#include "plan/verify.h"

namespace refit {
namespace {
using testing::AddSplitTensor;
using testing::EvenSplit;
using testing::Placement;

// Two trainer nodes (TP4 by rows, two GPUs each) -> two engine nodes (TP2 by columns, each
// engine replica on one node, two GPUs): network messages between every pair of nodes, NVLink
// fan-out inside the engine nodes, several tensors and sizes.
void Cluster(Layout& src, Layout& dst) {
  const std::vector<Placement> trainers = {{0, 0}, {0, 1}, {1, 0}, {1, 1}};
  const std::vector<Placement> engines_a = {{2, 0}, {2, 1}}, engines_b = {{3, 0}, {3, 1}};
  for (const char* name : {"w0", "w1", "w2"}) {
    AddSplitTensor(src, name, Dims{64, 48}, DType::kBF16, 0, EvenSplit(64, 4), trainers,
                   std::string(name) + "-t");
    AddSplitTensor(dst, name, Dims{64, 48}, DType::kBF16, 1, EvenSplit(48, 2), engines_a,
                   std::string(name) + "-a");
    AddSplitTensor(dst, name, Dims{64, 48}, DType::kBF16, 1, EvenSplit(48, 2), engines_b,
                   std::string(name) + "-b");
  }
  REQUIRE(ValidateLayout(src, "source").ok());
  REQUIRE(ValidateLayout(dst, "destination").ok());
}

struct HostBuffers {
  explicit HostBuffers(const Layout& layout) {
    for (const Buffer& b : layout.buffers) bytes.emplace_back(static_cast<size_t>(b.NumBytes()));
    for (auto& v : bytes) memory.emplace_back(v.data(), v.size());
  }
  std::vector<std::vector<std::byte>> bytes;
  BufferMemory memory;
};

Plan Planned(const Layout& src, const Layout& dst, int64_t max_message_bytes) {
  PlanOptions options;
  options.topology.gpus_per_node = 2;
  options.topology.nics_per_node = 2;
  options.max_message_bytes = max_message_bytes;
  auto plan = MakePlan(src, dst, options);
  REQUIRE(plan.ok());
  return *std::move(plan);
}

TEST_CASE("each node's slice runs its messages exactly as the whole plan does") {
  Layout src, dst;
  Cluster(src, dst);
  const Plan plan = Planned(src, dst, 1024);
  REQUIRE(plan.messages.size() > 8);
  const FillSpec spec = MakeFillSpec(src, dst, 3);
  HostBuffers from(src), to(dst);
  FillSources(src, spec, from.memory);
  PoisonDestinations(to.memory);
  // Every message runs from the slice of the node that receives it, stage by stage.
  std::vector<Plan> slices;
  for (int32_t node = 0; node < 4; ++node) slices.push_back(SliceOfPlan(plan, node, 0));
  std::vector<std::byte> staging;
  for (int stage = 0; stage < kMaxStages; ++stage) {
    for (size_t i = 0; i < plan.messages.size(); ++i) {
      if (plan.messages[i].stage != stage) continue;
      const Plan& slice = slices[plan.gpus[plan.messages[i].dst_gpu].node];
      const Message& m = slice.messages[i];
      REQUIRE(m.num_descriptors == plan.messages[i].num_descriptors);
      PackMessage(slice, m, from.memory, to.memory, staging);
      UnpackMessage(slice, m, staging, to.memory);
    }
  }
  auto checked = CheckDestinations(src, dst, spec, to.memory);
  INFO(checked.status().message());
  REQUIRE(checked.ok());
  CHECK(checked->elements_checked == 2 * 3 * 64 * 48);
}

TEST_CASE("a slice keeps every header, its own descriptors, and others' only when large") {
  Layout src, dst;
  Cluster(src, dst);
  const Plan plan = Planned(src, dst, 1 << 20);
  for (int32_t node = 0; node < 4; ++node) {
    const Plan slice = SliceOfPlan(plan, node, 0);
    REQUIRE(CheckSlice(slice, node, src, dst).ok());
    REQUIRE(slice.messages.size() == plan.messages.size());
    int64_t own = 0;
    for (size_t i = 0; i < plan.messages.size(); ++i) {
      const Message& m = slice.messages[i];
      CHECK(m.bytes == plan.messages[i].bytes);
      CHECK(m.num_descriptors ==
            (TouchesNode(plan, plan.messages[i], node) ? plan.messages[i].num_descriptors : 0));
      own += m.num_descriptors;
    }
    CHECK(own < static_cast<int64_t>(plan.descriptors.size()));  // a share, not the whole
    CHECK(slice.stats.bytes_total == plan.stats.bytes_total);
  }
  // Keeping others' descriptors of at least 1 byte keeps every network descriptor.
  const Plan wide = SliceOfPlan(plan, 0, 1);
  for (size_t i = 0; i < plan.messages.size(); ++i) {
    const Message& m = plan.messages[i];
    const bool network = plan.gpus[m.src_gpu].node != plan.gpus[m.dst_gpu].node;
    if (network || TouchesNode(plan, m, 0))
      CHECK(wide.messages[i].num_descriptors == m.num_descriptors);
  }
}

TEST_CASE("a slice that reaches outside this node's buffers is refused, naming the descriptor") {
  Layout src, dst;
  Cluster(src, dst);
  const Plan plan = Planned(src, dst, 1 << 20);
  const int32_t node = 2;
  auto tampered = [&](auto change) {
    Plan slice = SliceOfPlan(plan, node, 0);
    change(slice);
    return CheckSlice(slice, node, src, dst);
  };
  // Changes the first descriptor that node 2 receives.
  auto edit_first_received = [&](Plan& slice, auto change) {
    for (const Message& m : slice.messages) {
      if (slice.gpus[m.dst_gpu].node == node && m.num_descriptors > 0) {
        CopyDescriptor d = slice.descriptors[m.first_descriptor];
        change(d);
        slice.descriptors.set(m.first_descriptor, d);
        return;
      }
    }
    FAIL("no message into node 2");
  };
  absl::Status s = tampered(
      [&](Plan& p) { edit_first_received(p, [](CopyDescriptor& d) { d.dst_offset += 1 << 20; }); });
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message().find("destination side") != std::string::npos);
  CHECK(s.message().find("reaches element") != std::string::npos);
  s = tampered([&](Plan& p) {
    edit_first_received(p, [&](CopyDescriptor& d) {
      for (size_t b = 0; b < dst.buffers.size(); ++b) {
        if (dst.workers[dst.buffers[b].worker].node == 3) d.dst_buffer = static_cast<int32_t>(b);
      }
    });
  });
  CHECK(s.message().find("is not on GPU") != std::string::npos);
  s = tampered([&](Plan& p) { edit_first_received(p, [](CopyDescriptor& d) { d.message += 1; }); });
  CHECK(s.message().find("says it belongs to message") != std::string::npos);
  s = tampered([&](Plan& p) { p.messages[0].src_gpu = 99; });
  CHECK(s.message().find("out of range") != std::string::npos);
  s = tampered([&](Plan& p) {
    edit_first_received(p, [](CopyDescriptor& d) { d.dst_stride[0] = -1, d.outer_rank = 1; });
  });
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(tampered([](Plan&) {}).ok());
}

}  // namespace
}  // namespace refit
