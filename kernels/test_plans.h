// Plans for kernel tests: random layout pairs with casts, ranks up to 4, uneven splits, replicas
// on several nodes (so stages > 0 exist), and host buffers for them.
#pragma once

#include <cstdint>
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

}  // namespace refit
