#include "plan/box.h"

#include <catch2/catch.hpp>
#include <random>

namespace refit {
namespace {

Box B(std::initializer_list<int64_t> origin, std::initializer_list<int64_t> shape) {
  return Box::FromDims(Dims(origin), Dims(shape));
}

TEST_CASE("a box counts its elements; rank 0 is one element") {
  CHECK(B({}, {}).NumElements() == 1);
  CHECK(B({2, 3}, {4, 5}).NumElements() == 20);
  CHECK(B({0}, {0}).IsEmpty());
  CHECK(B({1, 2}, {3, 4}).ToString() == "[1:4, 2:6]");
}

TEST_CASE("Make rejects what a file may hold but a box may not") {
  std::vector<int64_t> o = {0, 0}, neg = {1, -1}, big = {INT64_MAX, 1}, one = {1};
  CHECK(Box::Make(o, neg).status().message().find("negative extent") != std::string::npos);
  CHECK(Box::Make(o, one).status().message().find("rank") != std::string::npos);
  CHECK(Box::Make(big, std::vector<int64_t>{1, 1}).status().message().find("overflow") !=
        std::string::npos);
  std::vector<int64_t> seven(7, 1);
  CHECK_FALSE(Box::Make(seven, seven).ok());
  CHECK(Box::Make(o, o).ok());
}

TEST_CASE("intersection, containment") {
  const Box a = B({0, 0}, {4, 4}), b = B({2, 3}, {4, 4});
  CHECK(Intersect(a, b) == B({2, 3}, {2, 1}));
  CHECK(Intersects(a, b));
  CHECK_FALSE(Intersects(a, B({4, 0}, {1, 4})));  // touching is not overlapping
  CHECK(Contains(a, B({1, 1}, {2, 3})));
  CHECK_FALSE(Contains(a, b));
  CHECK(Contains(a, B({9, 9}, {0, 1})));  // an empty box is contained anywhere
  CHECK(Intersects(B({}, {}), B({}, {})));
}

TEST_CASE("subtraction yields disjoint boxes that tile a minus b") {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const int rank = 1 + static_cast<int>(rng() % 4);
    Box a, b;
    a.rank = b.rank = rank;
    for (int d = 0; d < rank; ++d) {
      a.origin[d] = rng() % 5, a.shape[d] = rng() % 5;
      b.origin[d] = rng() % 5, b.shape[d] = rng() % 5;
    }
    const std::vector<Box> parts = Subtract(a, b);
    int64_t volume = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      REQUIRE(Contains(a, parts[i]));
      REQUIRE_FALSE(Intersects(parts[i], b));
      for (size_t j = 0; j < i; ++j) REQUIRE_FALSE(Intersects(parts[i], parts[j]));
      volume += parts[i].NumElements();
    }
    REQUIRE(volume == a.NumElements() - Intersect(a, b).NumElements());
  }
}

TEST_CASE("row-major strides and linear indices") {
  const Dims shape{2, 3, 4};
  CHECK(RowMajorStrides(shape) == Dims{12, 4, 1});
  CHECK(LinearIndex(Dims{1, 2, 3}, shape) == 23);
  CHECK(RowMajorStrides(Dims{}) == Dims{});
}

TEST_CASE("contiguity of a box in an array") {
  const Dims shape{4, 6};
  CHECK(IsContiguousIn(B({1, 0}, {2, 6}), shape));  // whole rows
  CHECK(IsContiguousIn(B({1, 2}, {1, 3}), shape));  // part of one row
  CHECK_FALSE(IsContiguousIn(B({1, 2}, {2, 3}), shape));
  CHECK(IsContiguousIn(B({3, 0, 0}, {1, 1, 5}), Dims{4, 2, 5}));
}

TEST_CASE("UnionVolume counts every element of overlapping boxes once") {
  CHECK(UnionVolume({}) == 0);
  CHECK(UnionVolume(std::vector<Box>{B({}, {}), B({}, {})}) == 1);
  CHECK(UnionVolume(std::vector<Box>{B({0, 0}, {4, 4}), B({2, 2}, {4, 4})}) == 28);
  CHECK(UnionVolume(std::vector<Box>{B({0, 0}, {4, 4}), B({4, 0}, {4, 4}), B({0, 0}, {8, 4})}) ==
        32);
  CHECK(UnionVolume(std::vector<Box>{B({0}, {0}), B({3}, {2})}) == 2);  // an empty box adds nothing
  {
    // A tensor's row slices, each needed by 8 replicas: every slice once.
    std::vector<Box> slices;
    for (int replica = 0; replica < 8; ++replica) {
      for (int64_t row = 0; row < 2048; row += 16) slices.push_back(B({row, 0}, {16, 7168}));
    }
    CHECK(UnionVolume(slices) == int64_t{2048} * 7168);
  }
  // Against counting the elements of a small grid, for random boxes of rank 1 to 3, some of them
  // repeated.
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int rank = 1 + trial % 3;
    std::vector<Box> boxes(1 + rng() % 10);
    for (size_t i = 0; i < boxes.size(); ++i) {
      Box& b = boxes[i];
      if (i > 0 && rng() % 3 == 0) {
        b = boxes[rng() % i];
        continue;
      }
      b.rank = rank;
      for (int d = 0; d < rank; ++d) {
        b.origin[d] = rng() % 6;
        b.shape[d] = rng() % 4;
      }
    }
    int64_t counted = 0;
    for (int x = 0; x < 10; ++x) {
      for (int y = 0; y < (rank > 1 ? 10 : 1); ++y) {
        for (int z = 0; z < (rank > 2 ? 10 : 1); ++z) {
          const int64_t p[3] = {x, y, z};
          bool in = false;
          for (const Box& b : boxes) {
            bool inside = true;
            for (int d = 0; d < rank; ++d) inside &= p[d] >= b.origin[d] && p[d] < b.end(d);
            in |= inside;
          }
          counted += in;
        }
      }
    }
    REQUIRE(UnionVolume(boxes) == counted);
  }
}

}  // namespace
}  // namespace refit
