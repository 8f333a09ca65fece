#include "plan/flat_range.h"

#include <catch2/catch.hpp>
#include <random>

namespace refit {
namespace {

TEST_CASE("a flat range becomes contiguous boxes that tile it in order") {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 3000; ++trial) {
    Dims shape;
    shape.rank = static_cast<int>(rng() % 5);
    for (int d = 0; d < shape.rank; ++d) shape[d] = 1 + rng() % 5;
    const int64_t n = shape.NumElements();
    int64_t a = rng() % (n + 1), b = rng() % (n + 1);
    if (a > b) std::swap(a, b);
    const std::vector<Box> boxes = FlatRangeToBoxes(shape, a, b);
    REQUIRE(boxes.size() <= static_cast<size_t>(std::max(1, 2 * shape.rank - 1)));
    int64_t next = a;
    for (const Box& box : boxes) {
      REQUIRE(IsContiguousIn(box, shape));
      REQUIRE(LinearIndex(box.origin_dims(), shape) == next);
      next += box.NumElements();
    }
    REQUIRE(next == b);
  }
}

TEST_CASE("FSDP shard starting and ending mid-row") {
  // [4, 10]: flat [7, 33) is row 0 cols 7..10, rows 1..3, row 3 cols 0..3.
  const auto boxes = FlatRangeToBoxes(Dims{4, 10}, 7, 33);
  REQUIRE(boxes.size() == 3);
  CHECK(boxes[0].ToString() == "[0:1, 7:10]");
  CHECK(boxes[1].ToString() == "[1:3, 0:10]");
  CHECK(boxes[2].ToString() == "[3:4, 0:3]");
}

}  // namespace
}  // namespace refit
