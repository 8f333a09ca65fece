#include "plan/region_set.h"

#include <catch2/catch.hpp>
#include <random>

#include "plan/test_layouts.h"

namespace refit {
namespace {
using testing::B;

TEST_CASE("identical boxes become one region with every owner") {
  RegionSet set;
  std::vector<std::pair<Box, int32_t>> in = {
      {B({0, 0}, {4, 8}), 3}, {B({4, 0}, {4, 8}), 1}, {B({0, 0}, {4, 8}), 2}};
  set.Build(in);
  REQUIRE(set.size() == 2);
  CHECK(set.box(0) == B({0, 0}, {4, 8}));
  CHECK(std::vector<int32_t>(set.owners(0).begin(), set.owners(0).end()) ==
        std::vector<int32_t>{2, 3});
}

TEST_CASE("overlapping boxes are refined into disjoint regions that keep their owners") {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<std::pair<Box, int32_t>> in;
    const int n = 1 + static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      Box b;
      b.rank = 2;
      for (int d = 0; d < 2; ++d) b.origin[d] = rng() % 6, b.shape[d] = 1 + rng() % 5;
      in.push_back({b, i});
    }
    RegionSet set;
    set.Build(in);
    // Every element of every input box lies in exactly one region, and that region lists
    // exactly the inputs that contain the element.
    for (int64_t x = 0; x < 12; ++x) {
      for (int64_t y = 0; y < 12; ++y) {
        const Box e = B({x, y}, {1, 1});
        std::vector<int32_t> want;
        for (const auto& [b, o] : in) {
          if (Contains(b, e)) want.push_back(o);
        }
        int found = 0;
        std::vector<int32_t> got;
        set.ForEachIntersecting(e, [&](size_t r) {
          ++found;
          got.assign(set.owners(r).begin(), set.owners(r).end());
        });
        REQUIRE(found == (want.empty() ? 0 : 1));
        REQUIRE(got == want);
      }
    }
  }
}

TEST_CASE("the index finds exactly the intersecting regions") {
  RegionSet set;
  std::vector<std::pair<Box, int32_t>> in;
  for (int i = 0; i < 64; ++i) in.push_back({B({0, i * 10}, {100, 10}), i});  // column shards
  set.Build(in);
  std::vector<size_t> hit;
  set.ForEachIntersecting(B({5, 95}, {1, 20}), [&](size_t r) { hit.push_back(r); });
  REQUIRE(hit.size() == 3);
  for (size_t r : hit) CHECK(Intersects(set.box(r), B({5, 95}, {1, 20})));
}

}  // namespace
}  // namespace refit
