// Disjoint regions of one tensor, each with the pieces that hold (or need) all of it, and an index
// that finds the regions overlapping a box without scanning them all.
//
// Given boxes b_i with owners o_i, a RegionSet is a set of pairwise disjoint boxes r_j whose union
// is the union of the b_i, where each r_j lists every owner whose box contains it. When the input
// boxes are already pairwise disjoint or identical (tensor, data and expert parallelism) the
// regions are the distinct boxes; overlapping boxes (two replicas split differently) are refined.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "plan/box.h"

namespace refit {

class RegionSet {
 public:
  // Replaces the contents. Reuses its storage, so one RegionSet serves many tensors.
  void Build(std::span<const std::pair<Box, int32_t>> boxes_and_owners);

  size_t size() const { return boxes_.size(); }
  const Box& box(size_t region) const { return boxes_[region]; }
  std::span<const int32_t> owners(size_t region) const {
    return {owners_.data() + owner_begin_[region],
            static_cast<size_t>(owner_begin_[region + 1] - owner_begin_[region])};
  }

  // Calls fn(region) for every region that intersects `query`.
  template <typename Fn>
  void ForEachIntersecting(const Box& query, Fn&& fn) const;

 private:
  void BuildIndex();
  void Refine(const std::vector<std::pair<Box, int32_t>>& sorted);

  std::vector<Box> boxes_;
  std::vector<int32_t> owner_begin_;  // size() + 1 entries
  std::vector<int32_t> owners_;

  // Index: regions ordered by origin along `axis_`; a region starting before `query.origin - max
  // extent` cannot reach the query.
  int axis_ = 0;
  int64_t max_extent_ = 0;
  std::vector<int32_t> order_;
  std::vector<int64_t> order_origin_;

  // Scratch, kept to avoid allocating per tensor.
  std::vector<std::pair<Box, int32_t>> sorted_;
  std::vector<int64_t> origins_;
};

template <typename Fn>
void RegionSet::ForEachIntersecting(const Box& query, Fn&& fn) const {
  if (boxes_.empty()) return;
  if (query.rank == 0) {
    for (size_t r = 0; r < boxes_.size(); ++r) {
      if (Intersects(boxes_[r], query)) fn(r);
    }
    return;
  }
  const int64_t lo = query.origin[axis_] - max_extent_ + 1;
  const int64_t hi = query.end(axis_);
  auto first = std::lower_bound(order_origin_.begin(), order_origin_.end(), lo);
  auto last = std::lower_bound(first, order_origin_.end(), hi);
  for (auto it = first; it != last; ++it) {
    const int32_t r = order_[it - order_origin_.begin()];
    if (Intersects(boxes_[r], query)) fn(static_cast<size_t>(r));
  }
}

}  // namespace refit
