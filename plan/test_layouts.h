// Small helpers that build layouts for tests.
#pragma once

#include <string>
#include <vector>

#include "plan/layout.h"

namespace refit::testing {

Box B(std::initializer_list<int64_t> origin, std::initializer_list<int64_t> shape);

// Splits `extent` into `parts` contiguous ranges as evenly as possible (the first ones larger):
// returns the parts + 1 boundaries.
std::vector<int64_t> EvenSplit(int64_t extent, int parts);

// Adds one worker per shard of tensor `tensor` split along `dim` into `parts` uneven or even
// ranges, each shard in its own buffer, worker i on (node, gpu) = placement(i).
struct Placement {
  int32_t node;
  int32_t gpu;
};
void AddSplitTensor(Layout& layout, const std::string& tensor, Dims shape, DType dtype, int dim,
                    const std::vector<int64_t>& boundaries,
                    const std::vector<Placement>& placement, const std::string& worker_prefix);

}  // namespace refit::testing
