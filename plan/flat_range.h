// A range of a tensor's row-major (flattened) elements as boxes: how an FSDP flat shard, which
// may start and end in the middle of a tensor, becomes pieces.
#pragma once

#include <vector>

#include "plan/box.h"

namespace refit {

// Boxes, in row-major order, whose elements are exactly the flat indices [begin, end) of an array
// of `shape`; each box is contiguous in that array. At most 2 * rank - 1 boxes (1 for rank 0).
std::vector<Box> FlatRangeToBoxes(const Dims& shape, int64_t begin, int64_t end);

}  // namespace refit
