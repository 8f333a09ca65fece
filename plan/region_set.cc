#include "plan/region_set.h"

#include <algorithm>
#include <numeric>

namespace refit {
namespace {

bool BoxLess(const Box& a, const Box& b) {
  for (int d = 0; d < a.rank; ++d) {
    if (a.origin[d] != b.origin[d]) return a.origin[d] < b.origin[d];
    if (a.shape[d] != b.shape[d]) return a.shape[d] < b.shape[d];
  }
  return false;
}

// True when the distinct boxes (sorted, empty ones removed) are pairwise disjoint.
bool PairwiseDisjoint(const std::vector<Box>& boxes) {
  if (boxes.size() < 2 || boxes[0].rank == 0) return boxes.size() < 2;
  // Sweep along dimension 0 in the sorted order (sorted by origin[0] first).
  std::vector<const Box*> active;
  for (const Box& b : boxes) {
    std::erase_if(active, [&](const Box* a) { return a->end(0) <= b.origin[0]; });
    for (const Box* a : active) {
      if (Intersects(*a, b)) return false;
    }
    active.push_back(&b);
  }
  return true;
}

}  // namespace

void RegionSet::Build(std::span<const std::pair<Box, int32_t>> boxes_and_owners) {
  boxes_.clear();
  owner_begin_.clear();
  owners_.clear();
  std::vector<std::pair<Box, int32_t>>& sorted = sorted_;
  sorted.clear();
  for (const auto& bo : boxes_and_owners) {
    if (!bo.first.IsEmpty()) sorted.push_back(bo);
  }
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    if (BoxLess(a.first, b.first)) return true;
    if (BoxLess(b.first, a.first)) return false;
    return a.second < b.second;
  });
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (i == 0 || !(sorted[i].first == sorted[i - 1].first)) {
      boxes_.push_back(sorted[i].first);
      owner_begin_.push_back(static_cast<int32_t>(owners_.size()));
    }
    owners_.push_back(sorted[i].second);
  }
  owner_begin_.push_back(static_cast<int32_t>(owners_.size()));
  if (!PairwiseDisjoint(boxes_)) Refine(sorted);
  BuildIndex();
}

// The general case: split overlapping boxes until the regions are disjoint. Quadratic in the
// number of overlapping boxes, which real layouts keep small (a few differently split replicas).
void RegionSet::Refine(const std::vector<std::pair<Box, int32_t>>& sorted) {
  struct Region {
    Box box;
    std::vector<int32_t> owners;
  };
  std::vector<Region> regions;
  for (const auto& [box, owner] : sorted) {
    std::vector<Box> uncovered = {box};
    std::vector<Region> next;
    next.reserve(regions.size() + 4);
    for (Region& r : regions) {
      if (!Intersects(r.box, box)) {
        next.push_back(std::move(r));
        continue;
      }
      const Box common = Intersect(r.box, box);
      for (const Box& rest : Subtract(r.box, box)) next.push_back({rest, r.owners});
      r.owners.push_back(owner);
      next.push_back({common, std::move(r.owners)});
      std::vector<Box> still;
      for (const Box& u : uncovered) {
        for (const Box& part : Subtract(u, common)) still.push_back(part);
      }
      uncovered = std::move(still);
    }
    for (const Box& u : uncovered) next.push_back({u, {owner}});
    regions = std::move(next);
  }
  boxes_.clear();
  owner_begin_.clear();
  owners_.clear();
  for (Region& r : regions) {
    boxes_.push_back(r.box);
    owner_begin_.push_back(static_cast<int32_t>(owners_.size()));
    std::sort(r.owners.begin(), r.owners.end());
    r.owners.erase(std::unique(r.owners.begin(), r.owners.end()), r.owners.end());
    owners_.insert(owners_.end(), r.owners.begin(), r.owners.end());
  }
  owner_begin_.push_back(static_cast<int32_t>(owners_.size()));
}

void RegionSet::BuildIndex() {
  order_.resize(boxes_.size());
  order_origin_.resize(boxes_.size());
  if (boxes_.empty()) return;
  const int rank = boxes_[0].rank;
  axis_ = 0;
  if (rank > 1 && boxes_.size() > 1) {
    // Index along the dimension that separates the regions best (most distinct origins).
    size_t best = 0;
    for (int d = 0; d < rank; ++d) {
      origins_.clear();
      for (const Box& b : boxes_) origins_.push_back(b.origin[d]);
      std::sort(origins_.begin(), origins_.end());
      const size_t distinct = std::unique(origins_.begin(), origins_.end()) - origins_.begin();
      if (distinct > best) best = distinct, axis_ = d;
    }
  }
  std::iota(order_.begin(), order_.end(), 0);
  max_extent_ = 0;
  if (rank == 0) return;
  std::sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
    return boxes_[a].origin[axis_] < boxes_[b].origin[axis_];
  });
  for (size_t i = 0; i < order_.size(); ++i) {
    const Box& b = boxes_[order_[i]];
    order_origin_[i] = b.origin[axis_];
    max_extent_ = std::max(max_extent_, b.shape[axis_]);
  }
}

}  // namespace refit
