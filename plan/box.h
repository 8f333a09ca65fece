// n-dimensional boxes of int64 indices and their algebra.
//
// A Box is the set { x : origin[d] <= x[d] < origin[d] + shape[d] for every d < rank }. Rank 0 is
// a single element (a scalar). Boxes are values, fixed in size (no heap), so millions of them
// fit in a plan: rank is bounded by kMaxRank.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace refit {

inline constexpr int kMaxRank = 6;

// A shape or an index vector of up to kMaxRank dimensions.
struct Dims {
  int rank = 0;
  std::array<int64_t, kMaxRank> v{};

  Dims() = default;
  Dims(std::initializer_list<int64_t> values);  // unchecked: at most kMaxRank values
  static absl::StatusOr<Dims> FromSpan(std::span<const int64_t> values);

  int64_t operator[](int d) const { return v[d]; }
  int64_t& operator[](int d) { return v[d]; }
  // Product; 1 for rank 0. Inline: the planner asks it per transfer, millions of times.
  int64_t NumElements() const {
    int64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= v[d];
    return n;
  }
  std::span<const int64_t> span() const { return {v.data(), static_cast<size_t>(rank)}; }
  std::string ToString() const;  // "[4096, 128]"
  friend bool operator==(const Dims& a, const Dims& b);
};

// Row-major (C order) strides, in elements, of a dense array of `shape`.
Dims RowMajorStrides(const Dims& shape);

struct Box {
  int rank = 0;
  std::array<int64_t, kMaxRank> origin{};
  std::array<int64_t, kMaxRank> shape{};

  Box() = default;
  // The whole of a shape: origin 0.
  static Box Whole(const Dims& shape);
  // Unchecked: origin and shape must have equal rank <= kMaxRank and shape >= 0.
  static Box FromDims(const Dims& origin, const Dims& shape);
  // Checked: rank, non-negative shape, no int64 overflow of origin + shape.
  static absl::StatusOr<Box> Make(std::span<const int64_t> origin, std::span<const int64_t> shape);

  int64_t end(int d) const { return origin[d] + shape[d]; }
  Dims origin_dims() const;
  Dims shape_dims() const;
  int64_t NumElements() const {  // inline: asked per transfer, millions of times
    int64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= shape[d];
    return n;
  }
  bool IsEmpty() const { return NumElements() == 0; }
  std::string ToString() const;  // "[0:4096, 128:256]" (half-open per dimension)
  friend bool operator==(const Box& a, const Box& b);
};

// Elementwise intersection; empty (some shape 0) when the boxes are disjoint. Ranks must match.
Box Intersect(const Box& a, const Box& b);
bool Intersects(const Box& a, const Box& b);
// True when every element of `inner` is in `outer` (an empty inner is contained anywhere).
bool Contains(const Box& outer, const Box& inner);
// a \ b as disjoint boxes (at most 2 * rank of them).
std::vector<Box> Subtract(const Box& a, const Box& b);
// Elements in the union of `boxes` (equal ranks), each counted once. A sweep over the distinct
// coordinates of one dimension at a time: no box algebra and no allocation per box, so a few
// dozen overlapping boxes cost microseconds (the planner's lower bound asks it per region).
int64_t UnionVolume(std::span<const Box> boxes);
// Position of `index` in a row-major array of `shape`.
int64_t LinearIndex(const Dims& index, const Dims& shape);

// True when a box of a row-major array of `array_shape` occupies one contiguous range of it.
bool IsContiguousIn(const Box& box, const Dims& array_shape);

struct BoxHash {
  size_t operator()(const Box& b) const;
};

}  // namespace refit
