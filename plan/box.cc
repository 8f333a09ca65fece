#include "plan/box.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace refit {

Dims::Dims(std::initializer_list<int64_t> values) {
  for (int64_t x : values) v[rank++] = x;
}

absl::StatusOr<Dims> Dims::FromSpan(std::span<const int64_t> values) {
  if (values.size() > static_cast<size_t>(kMaxRank)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", values.size(), " exceeds the maximum of ", kMaxRank));
  }
  Dims d;
  for (int64_t x : values) d.v[d.rank++] = x;
  return d;
}

std::string Dims::ToString() const { return absl::StrCat("[", absl::StrJoin(span(), ", "), "]"); }

bool operator==(const Dims& a, const Dims& b) {
  return a.rank == b.rank && std::equal(a.v.begin(), a.v.begin() + a.rank, b.v.begin());
}

Dims RowMajorStrides(const Dims& shape) {
  Dims s;
  s.rank = shape.rank;
  int64_t stride = 1;
  for (int d = shape.rank - 1; d >= 0; --d) {
    s.v[d] = stride;
    stride *= shape.v[d];
  }
  return s;
}

Box Box::Whole(const Dims& shape) {
  Box b;
  b.rank = shape.rank;
  b.shape = shape.v;
  return b;
}

Box Box::FromDims(const Dims& origin, const Dims& shape) {
  Box b;
  b.rank = shape.rank;
  b.origin = origin.v;
  b.shape = shape.v;
  return b;
}

absl::StatusOr<Box> Box::Make(std::span<const int64_t> origin, std::span<const int64_t> shape) {
  if (origin.size() != shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat("box origin has rank ", origin.size(),
                                                   " but its shape has rank ", shape.size()));
  }
  if (shape.size() > static_cast<size_t>(kMaxRank)) {
    return absl::InvalidArgumentError(
        absl::StrCat("box rank ", shape.size(), " exceeds the maximum of ", kMaxRank));
  }
  Box b;
  b.rank = static_cast<int>(shape.size());
  for (int d = 0; d < b.rank; ++d) {
    if (shape[d] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("box shape has a negative extent ", shape[d], " in dimension ", d));
    }
    if (origin[d] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("box origin has a negative index ", origin[d], " in dimension ", d));
    }
    if (origin[d] > INT64_MAX - shape[d]) {
      return absl::InvalidArgumentError(absl::StrCat("box end overflows int64 in dimension ", d));
    }
    b.origin[d] = origin[d];
    b.shape[d] = shape[d];
  }
  return b;
}

Dims Box::origin_dims() const {
  Dims d;
  d.rank = rank;
  d.v = origin;
  return d;
}

Dims Box::shape_dims() const {
  Dims d;
  d.rank = rank;
  d.v = shape;
  return d;
}

std::string Box::ToString() const {
  std::string s = "[";
  for (int d = 0; d < rank; ++d) {
    absl::StrAppend(&s, d ? ", " : "", origin[d], ":", origin[d] + shape[d]);
  }
  return s + "]";
}

bool operator==(const Box& a, const Box& b) {
  if (a.rank != b.rank) return false;
  for (int d = 0; d < a.rank; ++d) {
    if (a.origin[d] != b.origin[d] || a.shape[d] != b.shape[d]) return false;
  }
  return true;
}

Box Intersect(const Box& a, const Box& b) {
  Box r;
  r.rank = a.rank;
  for (int d = 0; d < a.rank; ++d) {
    int64_t lo = std::max(a.origin[d], b.origin[d]);
    int64_t hi = std::min(a.end(d), b.end(d));
    r.origin[d] = lo;
    r.shape[d] = hi > lo ? hi - lo : 0;
  }
  return r;
}

bool Intersects(const Box& a, const Box& b) {
  for (int d = 0; d < a.rank; ++d) {
    if (std::max(a.origin[d], b.origin[d]) >= std::min(a.end(d), b.end(d))) return false;
  }
  return !a.IsEmpty() && !b.IsEmpty();
}

bool Contains(const Box& outer, const Box& inner) {
  if (inner.IsEmpty()) return true;
  for (int d = 0; d < outer.rank; ++d) {
    if (inner.origin[d] < outer.origin[d] || inner.end(d) > outer.end(d)) return false;
  }
  return true;
}

std::vector<Box> Subtract(const Box& a, const Box& b) {
  if (!Intersects(a, b)) {
    if (a.IsEmpty()) return {};
    return {a};
  }
  // Peel slabs off `rest` one dimension at a time: below b, then above b; what stays is a ∩ b.
  std::vector<Box> out;
  Box rest = a;
  for (int d = 0; d < a.rank; ++d) {
    if (rest.origin[d] < b.origin[d]) {
      Box lo = rest;
      lo.shape[d] = b.origin[d] - rest.origin[d];
      out.push_back(lo);
      rest.shape[d] -= lo.shape[d];
      rest.origin[d] = b.origin[d];
    }
    if (rest.end(d) > b.end(d)) {
      Box hi = rest;
      hi.origin[d] = b.end(d);
      hi.shape[d] = rest.end(d) - b.end(d);
      out.push_back(hi);
      rest.shape[d] -= hi.shape[d];
    }
  }
  return out;
}

int64_t LinearIndex(const Dims& index, const Dims& shape) {
  int64_t linear = 0;
  for (int d = 0; d < shape.rank; ++d) linear = linear * shape[d] + index[d];
  return linear;
}

bool IsContiguousIn(const Box& box, const Dims& array_shape) {
  if (box.IsEmpty()) return true;
  // Skip leading dimensions of extent 1; from the first longer one on, every inner dimension must
  // be whole.
  int d = 0;
  while (d < box.rank && box.shape[d] == 1) ++d;
  for (int inner = d + 1; inner < box.rank; ++inner) {
    if (box.origin[inner] != 0 || box.shape[inner] != array_shape[inner]) return false;
  }
  return true;
}

size_t BoxHash::operator()(const Box& b) const {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(b.rank);
  for (int d = 0; d < b.rank; ++d) {
    h = (h ^ static_cast<uint64_t>(b.origin[d])) * 0x100000001B3ull;
    h = (h ^ static_cast<uint64_t>(b.shape[d])) * 0x100000001B3ull;
    h ^= h >> 29;
  }
  return static_cast<size_t>(h);
}

namespace {

// Union volume of boxes[ids] restricted to dimensions d and after (the earlier dimensions are
// the caller's slab). The last dimension is an interval union.
int64_t UnionVolumeFrom(std::span<const Box> boxes, std::vector<int32_t>& ids, int d) {
  const int rank = boxes[ids[0]].rank;
  if (d == rank) return 1;
  if (d == rank - 1) {
    std::sort(ids.begin(), ids.end(),
              [&](int32_t a, int32_t b) { return boxes[a].origin[d] < boxes[b].origin[d]; });
    int64_t volume = 0, lo = boxes[ids[0]].origin[d], hi = lo;
    for (int32_t i : ids) {
      const Box& b = boxes[i];
      if (b.origin[d] > hi) {
        volume += hi - lo;
        lo = b.origin[d];
        hi = lo;
      }
      hi = std::max(hi, b.end(d));
    }
    return volume + (hi - lo);
  }
  // A dimension every box spans alike is a factor, not a sweep.
  bool alike = true;
  for (int32_t i : ids) {
    alike &= boxes[i].origin[d] == boxes[ids[0]].origin[d] &&
             boxes[i].shape[d] == boxes[ids[0]].shape[d];
  }
  if (alike) return boxes[ids[0]].shape[d] * UnionVolumeFrom(boxes, ids, d + 1);
  std::vector<int64_t> cuts;
  cuts.reserve(2 * ids.size());
  for (int32_t i : ids) cuts.push_back(boxes[i].origin[d]), cuts.push_back(boxes[i].end(d));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  // Cuts include every origin and end, so a box covers a slab whole or misses it. Sweep: boxes
  // join the active list at their origin and leave it at their end, so a slab costs its own
  // boxes, not all of them (128 disjoint slices of a tensor cost 128 steps, not 128^2).
  std::sort(ids.begin(), ids.end(),
            [&](int32_t a, int32_t b) { return boxes[a].origin[d] < boxes[b].origin[d]; });
  int64_t volume = 0;
  std::vector<int32_t> active, slab;
  size_t joined = 0;
  for (size_t c = 0; c + 1 < cuts.size(); ++c) {
    std::erase_if(active, [&](int32_t i) { return boxes[i].end(d) <= cuts[c]; });
    while (joined < ids.size() && boxes[ids[joined]].origin[d] <= cuts[c])
      active.push_back(ids[joined++]);
    if (active.empty()) continue;
    slab = active;  // the next dimension reorders its list
    volume += (cuts[c + 1] - cuts[c]) * UnionVolumeFrom(boxes, slab, d + 1);
  }
  return volume;
}

}  // namespace

int64_t UnionVolume(std::span<const Box> boxes) {
  std::vector<int32_t> ids;
  ids.reserve(boxes.size());
  for (size_t i = 0; i < boxes.size(); ++i) {
    if (!boxes[i].IsEmpty()) ids.push_back(static_cast<int32_t>(i));
  }
  if (ids.empty()) return 0;
  if (ids.size() == 1) return boxes[ids[0]].NumElements();
  // Equal boxes count once: replicas make many (the same slice needed by every engine replica),
  // and the sweep's cost grows with the number of boxes, not of distinct ones.
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    const Box& x = boxes[a];
    const Box& y = boxes[b];
    for (int d = 0; d < x.rank; ++d) {
      if (x.origin[d] != y.origin[d]) return x.origin[d] < y.origin[d];
      if (x.shape[d] != y.shape[d]) return x.shape[d] < y.shape[d];
    }
    return false;
  });
  ids.erase(std::unique(ids.begin(), ids.end(),
                        [&](int32_t a, int32_t b) { return boxes[a] == boxes[b]; }),
            ids.end());
  if (ids.size() == 1) return boxes[ids[0]].NumElements();
  return UnionVolumeFrom(boxes, ids, 0);
}

}  // namespace refit
