// The quantizing kernel's block fp8 quotients (kernels/e4m3_quotient.h) against the reference's
// division, on the CPU, for every case a block of bf16 weights can present: its scale is
// BlockFp8Scale(amax) for the bf16 amax of its finite elements, and each of its x has |x| <= amax.
// The kernel converts the quotients with the hardware's instruction, which kernels/e4m3_rule_test
// (and copy_kernels_test on a GPU) shows is FloatToE4M3 for finite values; fmaf and the products
// here are IEEE fp32 operations, as on the GPU (no flush to zero on either).
#include "kernels/e4m3_quotient.h"

#include <bit>
#include <catch2/catch.hpp>
#include <cfenv>
#include <cstdint>

#include "plan/convert.h"
#include "plan/fp8_block.h"

namespace refit {
namespace {

// Pairs (amax, x), |x| <= amax, both signs, whose codes differ, over the bf16 amaxes [lo, hi).
struct Sweep {
  uint64_t checked = 0, wrong = 0;
  uint32_t first_amax = 0, first_x = 0;
};

Sweep SweepAmaxes(uint32_t lo, uint32_t hi) {
  Sweep s;
  for (uint32_t a = lo; a < hi; ++a) {
    const float scale = BlockFp8Scale(BF16ToFloat(static_cast<uint16_t>(a)));
    const float inverse = ReciprocalOf(scale);
    for (uint32_t magnitude = 0; magnitude <= a; ++magnitude) {
      for (uint32_t sign : {0u, 0x8000u}) {
        const float x = BF16ToFloat(static_cast<uint16_t>(sign | magnitude));
        ++s.checked;
        if (FloatToE4M3(CorrectedQuotient(x, scale, inverse)) != FloatToE4M3(x / scale) &&
            s.wrong++ == 0) {
          s.first_amax = a, s.first_x = sign | magnitude;
        }
      }
    }
  }
  return s;
}

constexpr uint32_t kMinAmaxBits = 0x1F80;  // bf16 bits of kCorrectedQuotientMinAmax

TEST_CASE(
    "block fp8: the corrected quotient's code is the division's for every bf16 block from the "
    "threshold") {
  REQUIRE(std::fegetround() == FE_TONEAREST);
  REQUIRE(BF16ToFloat(kMinAmaxBits) == kCorrectedQuotientMinAmax);
  const Sweep s = SweepAmaxes(kMinAmaxBits, 0x7F80);  // every finite amax from 2^-64
  INFO(s.wrong << " of " << s.checked << " differ, the first amax 0x" << std::hex << s.first_amax
               << ", x 0x" << s.first_x);
  REQUIRE(s.checked ==
          (0x7F80ull * 0x7F81ull - uint64_t{kMinAmaxBits} * (kMinAmaxBits + 1)));  // 2 (a + 1) each
  REQUIRE(s.wrong == 0);
}

// Below the threshold the rule is not the division's (so the threshold is needed, and the sweep
// above can fail): bf16 subnormals in blocks at the 2^-126 scale floor.
TEST_CASE("block fp8: below the threshold some codes differ") {
  const Sweep s = SweepAmaxes(0, kMinAmaxBits);
  INFO(s.wrong << " of " << s.checked << " differ, the first amax 0x" << std::hex << s.first_amax
               << ", x 0x" << s.first_x);
  CHECK(s.wrong > 0);
}

}  // namespace
}  // namespace refit
