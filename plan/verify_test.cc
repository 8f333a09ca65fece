#include "plan/verify.h"

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "plan/host_copy.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"

namespace refit {
namespace {
using testing::AddSplitTensor;
using testing::B;
using testing::EvenSplit;

// Host memory for every buffer of a layout.
struct HostBuffers {
  explicit HostBuffers(const Layout& layout) {
    for (const Buffer& b : layout.buffers) bytes.emplace_back(static_cast<size_t>(b.NumBytes()));
    for (auto& v : bytes) memory.emplace_back(v.data(), v.size());
  }
  std::vector<std::vector<std::byte>> bytes;
  BufferMemory memory;
};

// Plans src -> dst, fills, poisons and executes on the host; the caller checks (and tampers).
struct Transferred {
  Transferred(Layout& src_layout, Layout& dst_layout)
      : src(src_layout), dst(dst_layout), spec(MakeFillSpec(src_layout, dst_layout, 7)) {
    REQUIRE(ValidateLayout(src_layout, "source").ok());
    REQUIRE(ValidateLayout(dst_layout, "destination").ok());
    auto plan = MakePlan(src_layout, dst_layout, {});
    REQUIRE(plan.ok());
    FillSources(src_layout, spec, src.memory);
    PoisonDestinations(dst.memory);
    ExecuteOnHost(*plan, src.memory, dst.memory);
  }
  HostBuffers src, dst;
  FillSpec spec;
};

// w [10, 6] bf16 in two row shards -> one destination buffer [12, 8] holding w at (1, 1): the
// border is padding that must stay poison.
void PaddedPair(Layout& src, Layout& dst) {
  AddSplitTensor(src, "w", Dims{10, 6}, DType::kBF16, 0, {0, 4, 10}, {{0, 0}, {0, 1}}, "trainer");
  const int32_t t = dst.AddTensor("w", Dims{10, 6}, DType::kBF16);
  const int32_t worker = dst.AddWorker("engine0", 0, 2);
  const int32_t buffer = dst.AddBuffer(worker, "padded", DType::kBF16, Dims{12, 8});
  dst.AddPiece(t, B({0, 0}, {10, 6}), buffer, B({1, 1}, {10, 6}));
}

TEST_CASE("a correct transfer passes, every element and padding byte counted") {
  Layout src, dst;
  PaddedPair(src, dst);
  Transferred run(src, dst);
  auto checked = CheckDestinations(src, dst, run.spec, run.dst.memory);
  INFO(checked.status().message());
  REQUIRE(checked.ok());
  CHECK(checked->elements_checked == 60);
  CHECK(checked->padding_bytes_checked == (12 * 8 - 60) * 2);
}

TEST_CASE("a wrong element is named by tensor index, worker and buffer") {
  Layout src, dst;
  PaddedPair(src, dst);
  Transferred run(src, dst);
  // Tensor element [3, 4] sits at buffer element [4, 5] = 4 * 8 + 5 = 37; its second byte.
  run.dst.memory[0][37 * 2 + 1] ^= std::byte{0x10};
  auto checked = CheckDestinations(src, dst, run.spec, run.dst.memory);
  REQUIRE(checked.status().code() == absl::StatusCode::kDataLoss);
  const std::string message(checked.status().message());
  CHECK_THAT(message, Catch::Contains("1 destination elements are wrong"));
  CHECK_THAT(message,
             Catch::Contains(
                 "tensor \"w\" element [3, 4] in worker \"engine0\" buffer \"padded\" element 37"));
}

TEST_CASE("padding that was written is caught") {
  Layout src, dst;
  PaddedPair(src, dst);
  Transferred run(src, dst);
  run.dst.memory[0][(11 * 8 + 7) * 2] = std::byte{0};  // the last element, outside every piece
  auto checked = CheckDestinations(src, dst, run.spec, run.dst.memory);
  REQUIRE(checked.status().code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(checked.status().message()),
             Catch::Contains("buffer \"padded\" element 95, which no piece covers, was written"));
}

TEST_CASE("an element never written (still poison) is caught") {
  Layout src, dst;
  PaddedPair(src, dst);
  Transferred run(src, dst);
  // Tensor row 9 = buffer row 10: poison it again, as if its transfer never happened.
  for (int c = 1; c <= 6; ++c) {
    run.dst.memory[0][(10 * 8 + c) * 2] = kPoison;
    run.dst.memory[0][(10 * 8 + c) * 2 + 1] = kPoison;
  }
  auto checked = CheckDestinations(src, dst, run.spec, run.dst.memory);
  REQUIRE(checked.status().code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(
      std::string(checked.status().message()),
      Catch::Contains("6 destination elements are wrong; first: tensor \"w\" element [9, 0]"));
}

TEST_CASE("a destination tensor the source lacks is refused") {
  Layout src, dst;
  PaddedPair(src, dst);
  Transferred run(src, dst);
  dst.tensors[0].name = "v";
  auto checked = CheckDestinations(src, dst, run.spec, run.dst.memory);
  REQUIRE(checked.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(checked.status().message()), Catch::Contains("tensor \"v\""));
}

// Big enough (48M elements) that filling and checking split the pieces over threads where the
// machine has more than one core: the totals and the first wrong element must not depend on it.
TEST_CASE("a large layout checked on several threads reports the same as one would") {
  Layout src, dst;
  constexpr int kTensors = 48;
  for (int i = 0; i < kTensors; ++i) {
    const std::string name = absl::StrCat("layers.", i, ".w");
    AddSplitTensor(src, name, Dims{1024, 1024}, DType::kBF16, 0, EvenSplit(1024, 4),
                   {{0, 0}, {0, 1}, {0, 2}, {0, 3}}, "trainer");
    AddSplitTensor(dst, name, Dims{1024, 1024}, DType::kBF16, 1, EvenSplit(1024, 2),
                   {{1, 0}, {1, 1}}, "engine");
  }
  Transferred run(src, dst);
  auto checked = CheckDestinations(src, dst, run.spec, run.dst.memory);
  INFO(checked.status().message());
  REQUIRE(checked.ok());
  CHECK(checked->elements_checked == int64_t{kTensors} * 1024 * 1024);
  CHECK(checked->padding_bytes_checked == 0);

  // Two wrong elements, in the last and the second tensor's buffers: the second is named first.
  const size_t last = dst.buffers.size() - 1;
  run.dst.memory[last][run.dst.memory[last].size() - 1] ^= std::byte{1};
  run.dst.memory[2][0] ^= std::byte{1};
  auto wrong = CheckDestinations(src, dst, run.spec, run.dst.memory);
  REQUIRE(wrong.status().code() == absl::StatusCode::kDataLoss);
  const std::string message(wrong.status().message());
  CHECK_THAT(message,
             Catch::Contains(
                 "2 destination elements are wrong; first: tensor \"layers.1.w\" element [0, 0]"));
}

}  // namespace
}  // namespace refit
