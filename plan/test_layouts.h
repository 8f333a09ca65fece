// Small helpers that build layouts for tests.
#pragma once

#include <string>
#include <vector>

#include "plan/layout.h"
#include "plan/plan.h"

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
                    const std::vector<int64_t>& boundaries, const std::vector<Placement>& placement,
                    const std::string& worker_prefix);

// A quantized destination tensor (LogicalTensor::quant) split along `dim` at `boundaries` (block
// multiples): part i on worker prefix+i holds its codes and the scales of its blocks, each in a
// buffer of its own, as engines keep them.
void AddQuantized(Layout& layout, const std::string& name, Dims shape, QuantFormat format,
                  int64_t block_rows, int64_t block_cols, int dim,
                  const std::vector<int64_t>& boundaries, const std::vector<Placement>& placement,
                  const std::string& prefix);

// An FSDP flat shard: tensor elements [begin, end) in row-major order, in one flat buffer of
// worker `worker`.
void AddFlatShard(Layout& layout, int32_t tensor, int32_t worker, int64_t begin, int64_t end);

// Every field of a descriptor, as text: equal texts, equal descriptors.
std::string DescriptorFields(const CopyDescriptor& d);

// "" when the plans are the same (descriptors in the same order, messages, scratch, statistics
// other than the planning time), else the first difference.
std::string PlanDifference(const Plan& a, const Plan& b);

}  // namespace refit::testing
