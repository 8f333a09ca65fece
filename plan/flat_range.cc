#include "plan/flat_range.h"

namespace refit {
namespace {

// Appends the boxes of [begin, end) within dimensions [dim, rank) of `shape`, with the outer
// dimensions fixed by `prefix` (extent 1 each).
void Append(const Dims& shape, int dim, Box prefix, int64_t begin, int64_t end,
            std::vector<Box>& out) {
  if (begin >= end) return;
  if (dim == shape.rank) {
    out.push_back(prefix);
    return;
  }
  int64_t inner = 1;
  for (int d = dim + 1; d < shape.rank; ++d) inner *= shape[d];
  auto row_box = [&](int64_t first, int64_t count) {
    Box b = prefix;
    b.origin[dim] = first;
    b.shape[dim] = count;
    for (int d = dim + 1; d < shape.rank; ++d) b.origin[d] = 0, b.shape[d] = shape[d];
    return b;
  };
  int64_t row = begin / inner;
  const int64_t last_row = end / inner;
  if (row == last_row) {  // inside one row
    Append(shape, dim + 1, row_box(row, 1), begin - row * inner, end - row * inner, out);
    return;
  }
  if (begin % inner != 0) {  // the partial first row
    Append(shape, dim + 1, row_box(row, 1), begin % inner, inner, out);
    ++row;
  }
  if (last_row > row) out.push_back(row_box(row, last_row - row));  // whole rows
  if (end % inner != 0) Append(shape, dim + 1, row_box(last_row, 1), 0, end % inner, out);
}

}  // namespace

std::vector<Box> FlatRangeToBoxes(const Dims& shape, int64_t begin, int64_t end) {
  std::vector<Box> out;
  Box prefix;
  prefix.rank = shape.rank;
  if (shape.rank == 0) {
    if (begin < end) out.push_back(prefix);
    return out;
  }
  Append(shape, 0, prefix, begin, end, out);
  return out;
}

}  // namespace refit
