#include "proto/plan_codec.h"

#include <catch2/catch.hpp>
#include <cstring>

#include "plan/plan_slice.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {
using testing::AddQuantized;
using testing::AddSplitTensor;
using testing::EvenSplit;

// Trainers on nodes 0 and 1 -> engines on nodes 2 and 3, a bf16 tensor and an fp8 one.
struct Pair {
  Layout src, dst;
  Plan plan;
  Pair() {
    AddSplitTensor(src, "w", Dims{64, 48}, DType::kBF16, 0, EvenSplit(64, 4),
                   {{0, 0}, {0, 1}, {1, 0}, {1, 1}}, "t");
    AddSplitTensor(dst, "w", Dims{64, 48}, DType::kBF16, 1, EvenSplit(48, 2), {{2, 0}, {3, 1}},
                   "e");
    AddSplitTensor(src, "q", Dims{256, 256}, DType::kBF16, 0, {0, 100, 256}, {{0, 0}, {1, 0}},
                   "tq");
    AddQuantized(dst, "q", Dims{256, 256}, QuantFormat::kBlockFp8, 128, 128, 0, {0, 128, 256},
                 {{2, 0}, {3, 1}}, "eq");
    REQUIRE(ValidateLayout(src, "source").ok());
    REQUIRE(ValidateLayout(dst, "destination").ok());
    PlanOptions options;
    options.topology.gpus_per_node = 2;
    options.topology.nics_per_node = 2;
    auto p = MakePlan(src, dst, options);
    REQUIRE(p.ok());
    plan = *std::move(p);
  }
};

bool SameDescriptor(const CopyDescriptor& a, const CopyDescriptor& b) {
  return a.src_buffer == b.src_buffer && a.dst_buffer == b.dst_buffer &&
         a.src_offset == b.src_offset && a.dst_offset == b.dst_offset && a.inner == b.inner &&
         a.outer_rank == b.outer_rank &&
         std::equal(a.count.begin(), a.count.begin() + a.outer_rank, b.count.begin()) &&
         std::equal(a.src_stride.begin(), a.src_stride.begin() + a.outer_rank,
                    b.src_stride.begin()) &&
         std::equal(a.dst_stride.begin(), a.dst_stride.begin() + a.outer_rank,
                    b.dst_stride.begin()) &&
         a.src_dtype == b.src_dtype && a.dst_dtype == b.dst_dtype &&
         a.src_is_destination == b.src_is_destination && a.op == b.op &&
         a.quant_format == b.quant_format && a.block_rows == b.block_rows &&
         a.block_cols == b.block_cols && a.message == b.message;
}

TEST_CASE("a slice survives the wire: messages, descriptors, scratch, this node's buffers") {
  Pair p;
  REQUIRE(!p.plan.scratch.empty());  // the fp8 blocks cut between trainers are gathered
  for (int32_t node = 0; node < 4; ++node) {
    const Plan slice = SliceOfPlan(p.plan, node, 0);
    auto decoded = SliceFromWire(SliceToWire(slice, node, p.src, p.dst), node);
    INFO(decoded.status().message());
    REQUIRE(decoded.ok());
    REQUIRE(decoded->plan.messages.size() == slice.messages.size());
    REQUIRE(decoded->plan.descriptors.size() == slice.descriptors.size());
    for (size_t i = 0; i < slice.descriptors.size(); ++i) {
      REQUIRE(SameDescriptor(decoded->plan.descriptors[i], slice.descriptors[i]));
    }
    for (size_t i = 0; i < slice.messages.size(); ++i) {
      const Message &a = decoded->plan.messages[i], &b = slice.messages[i];
      REQUIRE((a.src_gpu == b.src_gpu && a.dst_gpu == b.dst_gpu && a.stage == b.stage &&
               a.link == b.link && a.bytes == b.bytes && a.num_descriptors == b.num_descriptors));
    }
    CHECK(decoded->plan.scratch.size() == p.plan.scratch.size());
    CHECK(decoded->plan.stats.bytes_total == p.plan.stats.bytes_total);
    CHECK(decoded->plan.stats.stages == p.plan.stats.stages);
    REQUIRE(decoded->dst.buffers.size() == p.dst.buffers.size());
    REQUIRE(decoded->dst.workers.size() == p.dst.workers.size());
    for (size_t b = 0; b < p.dst.buffers.size(); ++b) {
      const bool here = p.dst.workers[p.dst.buffers[b].worker].node == node;
      const Buffer& got = decoded->dst.buffers[b];
      CHECK(got.worker == (here ? p.dst.buffers[b].worker : -1));
      if (here) CHECK((got.name == p.dst.buffers[b].name && got.shape == p.dst.buffers[b].shape));
    }
  }
}

TEST_CASE("a slice for another node, or damaged, is refused with what is wrong") {
  Pair p;
  const std::string wire = SliceToWire(SliceOfPlan(p.plan, 2, 0), 2, p.src, p.dst);
  CHECK(SliceFromWire(wire, 3).status().message().find("made for node 2, not node 3") !=
        std::string::npos);
  CHECK_FALSE(SliceFromWire(wire.substr(0, wire.size() / 2), 2).ok());
  v1::PlanSlice proto;
  REQUIRE(proto.ParseFromString(wire));
  proto.mutable_dst_offset()->Set(0, int64_t{1} << 40);
  CHECK(SliceFromWire(proto.SerializeAsString(), 2).status().message().find("reaches element") !=
        std::string::npos);
  REQUIRE(proto.ParseFromString(wire));
  proto.add_inner(5);
  CHECK(SliceFromWire(proto.SerializeAsString(), 2).status().message().find("differ in length") !=
        std::string::npos);
  REQUIRE(proto.ParseFromString(wire));
  REQUIRE(proto.count_size() > 0);  // the column split's strided loops
  proto.mutable_src_stride()->Set(0, int64_t{1} << 33);
  CHECK(SliceFromWire(proto.SerializeAsString(), 2)
            .status()
            .message()
            .find("past a descriptor's 32-bit loops") != std::string::npos);
  REQUIRE(proto.ParseFromString(wire));
  proto.mutable_destination()->set_buffer_count(1);
  CHECK(SliceFromWire(proto.SerializeAsString(), 2).status().message().find("out of range") !=
        std::string::npos);
}

TEST_CASE("the plan's digest changes with what determines the plan, and only with that") {
  Pair p;
  const v1::Layout src = CompactLayoutToProto(p.src), dst = CompactLayoutToProto(p.dst);
  PlanOptions options;
  const std::string digest = PlanInputsDigest(src, dst, options);
  CHECK(digest.size() == 32);
  CHECK(PlanInputsDigest(CompactLayoutToProto(p.src), CompactLayoutToProto(p.dst), options) ==
        digest);
  PlanOptions other = options;
  other.max_message_bytes /= 2;
  CHECK(PlanInputsDigest(src, dst, other) != digest);
  other = options;
  other.topology.gpus_per_node = 4;
  CHECK(PlanInputsDigest(src, dst, other) != digest);
  CHECK(PlanInputsDigest(dst, src, options) != digest);
  Layout moved = p.dst;
  moved.workers[0].gpu = 1;
  CHECK(PlanInputsDigest(src, CompactLayoutToProto(moved), options) != digest);
  CHECK(ShortHex(digest).size() == 12);
}

}  // namespace
}  // namespace refit
