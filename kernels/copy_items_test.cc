// Copy items against the CPU reference (plan/host_copy.h): packing and unpacking every message
// of real plans through items gives the same bytes, for casts, strides, ranks and odd sizes.
#include "kernels/copy_items.h"

#include <catch2/catch.hpp>
#include <random>

#include "absl/strings/str_cat.h"
#include "kernels/test_plans.h"
#include "plan/verify.h"

namespace refit {
namespace {

TEST_CASE("items pack and unpack exactly like the CPU reference") {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    TestRun run(seed);
    auto& [t, src, ref, got, spec] = run;
    for (int stage = 0; stage < kMaxStages; ++stage) {
      for (const Message& m : t.plan.messages) {
        if (m.stage != stage) continue;
        std::vector<std::byte> want, staging(static_cast<size_t>(m.bytes) + 16);
        PackMessage(t.plan, m, src.memory, ref.memory, want);
        // Staging at an odd address: the kernels must not assume alignment.
        const uint64_t at = reinterpret_cast<uint64_t>(staging.data()) + (seed % 3);
        CopyWork pack = PackWork(t.plan, m, src.addresses(), got.addresses(), at, 64);
        REQUIRE(pack.bytes == m.bytes);
        RunCopyWorkOnHost(pack);
        REQUIRE(std::memcmp(want.data(), reinterpret_cast<const void*>(at), want.size()) == 0);
        UnpackMessage(t.plan, m, want, ref.memory);
        RunCopyWorkOnHost(UnpackWork(t.plan, m, at, got.addresses(), 64));
      }
    }
    for (size_t b = 0; b < t.dst.buffers.size(); ++b) {
      INFO("seed " << seed << " buffer " << b);
      REQUIRE(ref.storage[b] == got.storage[b]);
    }
    auto checked = CheckDestinations(t.src, t.dst, spec, got.memory);
    INFO(checked.status().message());
    REQUIRE(checked.ok());
  }
}

TEST_CASE("direct items (no staging) give the CPU reference's destinations") {
  for (uint64_t seed = 100; seed <= 130; ++seed) {
    TestRun run(seed);
    auto& [t, src, ref, got, spec] = run;
    ExecuteOnHost(t.plan, src.memory, ref.memory);
    for (int stage = 0; stage < kMaxStages; ++stage) {
      for (const Message& m : t.plan.messages) {
        if (m.stage == stage) RunCopyWorkOnHost(DirectWork(t.plan, m, src.addresses(), got.addresses(), 128));
      }
    }
    for (size_t b = 0; b < t.dst.buffers.size(); ++b) REQUIRE(ref.storage[b] == got.storage[b]);
  }
}

}  // namespace
}  // namespace refit
