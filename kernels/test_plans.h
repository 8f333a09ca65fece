// Plans for kernel tests: random layout pairs with casts, ranks up to 4, uneven splits, replicas
// on several nodes (so stages > 0 exist), and host buffers for them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/copy_items.h"
#include "plan/layout.h"
#include "plan/plan.h"
#include "plan/verify.h"

namespace refit {

struct TestPlan {
  Layout src, dst;
  Plan plan;
};
TestPlan MakeTestPlan(uint64_t seed);

struct HostBuffers {
  std::vector<std::vector<std::byte>> storage;
  BufferMemory memory;
  explicit HostBuffers(const Layout& l);
  BufferAddresses addresses() const;
};

// A test plan with host memory: sources filled, two destination copies poisoned (one for the
// CPU reference, one for the code under test).
struct TestRun {
  TestPlan t;
  HostBuffers src, ref, got;
  FillSpec spec;
  explicit TestRun(uint64_t seed);
};

// Plain copy items built by hand, without a plan, for what plans rarely make: short runs of odd
// widths at odd byte offsets, thousands of tiny items, conversions of short rows, 3-loop strides
// (transposed too), long runs whose ends differ in alignment, tiles that end inside an item with
// the next item's bytes right after. Offsets are from two buffers' bases (256-aligned, as
// cudaMalloc gives), so that host and device items take the same paths.
struct ItemSpec {
  DType src_dtype = DType::kBF16, dst_dtype = DType::kBF16;
  int64_t inner = 0;
  int64_t count[kMaxOuterDims] = {1, 1, 1};
  int64_t src_stride[kMaxOuterDims] = {0, 0, 0};  // elements
  int64_t dst_stride[kMaxOuterDims] = {0, 0, 0};
  int64_t src_offset = 0, dst_offset = 0;  // bytes from the bases
};

struct ItemCase {
  std::string name;
  std::vector<ItemSpec> items;
  std::vector<std::byte> src;  // the source buffer (finite values at each item's dtype)
  int64_t dst_bytes = 0;
  int64_t segment_bytes = 16384;
};

// Named cases, then `random` random ones.
std::vector<ItemCase> MakeItemCases(int random, uint64_t seed = 1);
// The work of a case with its buffers at `src` and `dst` (CutIntoUnits for each item).
CopyWork ItemCaseWork(const ItemCase& c, uint64_t src, uint64_t dst);
// The destination buffer a plain loop writes: kPoison, then every element of every item.
std::vector<std::byte> ReferenceCopy(const ItemCase& c);

// A host buffer whose data starts 256-aligned.
struct AlignedBytes {
  std::vector<std::byte> storage;
  std::byte* data = nullptr;
  explicit AlignedBytes(size_t n, std::byte fill);
  uint64_t address() const { return reinterpret_cast<uint64_t>(data); }
};

}  // namespace refit
