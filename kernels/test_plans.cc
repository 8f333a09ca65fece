#include "kernels/test_plans.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"

namespace refit {

TestPlan MakeTestPlan(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(rng() % (hi - lo + 1)); };
  TestPlan t;
  const DType floats[] = {DType::kBF16, DType::kF16, DType::kF32};
  const int tensors = static_cast<int>(uniform(1, 6));
  for (int i = 0; i < tensors; ++i) {
    const std::string name = absl::StrCat("t", i);
    Dims shape;
    shape.rank = static_cast<int>(uniform(1, 4));
    for (int d = 0; d < shape.rank; ++d) shape[d] = uniform(1, shape.rank > 2 ? 9 : 300);
    const DType sd = floats[uniform(0, 2)], dd = floats[uniform(0, 2)];
    const int sdim = static_cast<int>(uniform(0, shape.rank - 1)), ddim = static_cast<int>(uniform(0, shape.rank - 1));
    const int sparts = static_cast<int>(std::min<int64_t>(uniform(1, 4), shape[sdim]));
    const int dparts = static_cast<int>(std::min<int64_t>(uniform(1, 3), shape[ddim]));
    std::vector<testing::Placement> sp, dp1, dp2;
    for (int k = 0; k < sparts; ++k) sp.push_back({0, k});
    for (int k = 0; k < dparts; ++k) dp1.push_back({1, k}), dp2.push_back({1 + static_cast<int>(uniform(0, 1)), k + 4});
    testing::AddSplitTensor(t.src, name, shape, sd, sdim, testing::EvenSplit(shape[sdim], sparts), sp, "trainer");
    testing::AddSplitTensor(t.dst, name, shape, dd, ddim, testing::EvenSplit(shape[ddim], dparts), dp1, "engineA");
    testing::AddSplitTensor(t.dst, name, shape, dd, ddim, testing::EvenSplit(shape[ddim], dparts), dp2, "engineB");
  }
  ValidateLayout(t.src, "source").IgnoreError();
  ValidateLayout(t.dst, "destination").IgnoreError();
  PlanOptions options;
  options.max_message_bytes = uniform(256, 1 << 16);
  options.topology.gpus_per_node = 8;
  t.plan = *MakePlan(t.src, t.dst, options);
  return t;
}

HostBuffers::HostBuffers(const Layout& l) {
  for (const Buffer& b : l.buffers) storage.emplace_back(static_cast<size_t>(b.NumBytes()));
  for (auto& s : storage) memory.emplace_back(s.data(), s.size());
}

BufferAddresses HostBuffers::addresses() const {
  BufferAddresses a;
  for (const auto& s : memory) a.push_back(reinterpret_cast<uint64_t>(s.data()));
  return a;
}

}  // namespace refit

namespace refit {

TestRun::TestRun(uint64_t seed)
    : t(MakeTestPlan(seed)), src(t.src), ref(t.dst), got(t.dst), spec(MakeFillSpec(t.src, t.dst, seed)) {
  FillSources(t.src, spec, src.memory);
  PoisonDestinations(ref.memory);
  PoisonDestinations(got.memory);
}

}  // namespace refit
