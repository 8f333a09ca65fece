// The quantizing kernel converts finite quotients to e4m3 with the hardware's
// cvt.rn.satfinite.e4m3x2.f32 instead of a port of FloatToE4M3, and MXFP8 quotients by multiplying
// by the scale's exact reciprocal instead of dividing. Both are claimed to give the reference's
// bits; these check the claims on the CPU, exhaustively. The rule the hardware documents (PTX
// ISA, cvt): round the fp32 value to nearest, ties to even, over e4m3's normals and subnormals
// (k * 2^-9), the sign of a zero result kept; a result past the largest finite value (448)
// saturates to +-448. Here that rule is computed in double arithmetic, a way independent of
// FloatToE4M3's bit manipulation, and compared with it for every finite fp32 pattern.
// copy_kernels_test checks the instruction itself against the kernel's port on a GPU.
#include <bit>
#include <catch2/catch.hpp>
#include <cfenv>
#include <cmath>
#include <cstdint>

#include "plan/convert.h"
#include "plan/fp8_block.h"

namespace refit {
namespace {

// The documented rule for a finite v: the e4m3 code of v rounded to nearest even, saturated.
uint8_t SaturatingRoundToE4M3(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(v));
  // e4m3 values are m * 2^(e - 3) with m in [8, 15] for exponents e in [-6, 8]; below 2^-6 they
  // are k * 2^-9. The step of the binade holding a (the subnormals' for a < 2^-6).
  int e = a < 0x1p-6 ? -6 : std::ilogb(a);
  double step = std::ldexp(1.0, e - 3);
  double k = std::nearbyint(a / step);  // exact quotient (a power of two), rounded ties-to-even
  if (e >= -6 && k == 16) k = 8, ++e, step *= 2;  // rounded up into the next binade
  const double r = k * step;
  if (r > 448.0) return sign | 0x7E;  // 480 and up: past the largest finite value
  if (r == 0) return sign;
  if (r < 0x1p-6) return sign | static_cast<uint8_t>(k);  // subnormal: k * 2^-9
  const int biased = std::ilogb(r) + 7;
  const int mant = static_cast<int>(r / std::ldexp(1.0, std::ilogb(r) - 3)) - 8;
  return sign | static_cast<uint8_t>(biased << 3 | mant);
}

TEST_CASE("FloatToE4M3 is the hardware's saturating round to nearest even for every finite fp32") {
  REQUIRE(std::fegetround() == FE_TONEAREST);
  uint64_t checked = 0, wrong = 0;
  uint32_t first = 0;
  for (uint64_t b = 0; b <= 0xFFFFFFFFull; ++b) {
    const uint32_t u = static_cast<uint32_t>(b);
    if ((u & 0x7F800000u) == 0x7F800000u) continue;  // inf and NaN never reach the instruction
    const float v = std::bit_cast<float>(u);
    ++checked;
    if (FloatToE4M3(v) != SaturatingRoundToE4M3(v) && wrong++ == 0) first = u;
  }
  INFO(wrong << " of " << checked << " differ, the first 0x" << std::hex << first
             << ": FloatToE4M3 " << int{FloatToE4M3(std::bit_cast<float>(first))} << ", the rule "
             << int{SaturatingRoundToE4M3(std::bit_cast<float>(first))});
  REQUIRE(checked == 0xFF000000ull);
  REQUIRE(wrong == 0);
  // The rule itself on values whose codes are known.
  CHECK(SaturatingRoundToE4M3(448.0f) == 0x7E);
  CHECK(SaturatingRoundToE4M3(464.0f) == 0x7E);
  CHECK(SaturatingRoundToE4M3(-1e30f) == 0xFE);
  CHECK(SaturatingRoundToE4M3(0x1p-9f) == 0x01);
  CHECK(SaturatingRoundToE4M3(0x1p-10f) == 0x00);  // the tie between 0 and 2^-9: even
  CHECK(SaturatingRoundToE4M3(-0x1p-11f) == 0x80);
  CHECK(SaturatingRoundToE4M3(1.0f) == 0x38);
  CHECK(SaturatingRoundToE4M3(1.0625f) == 0x38);  // the tie between 1 and 1.125: even
  CHECK(SaturatingRoundToE4M3(1.1875f) == 0x3A);  // the tie between 1.125 and 1.25: even
}

// MXFP8's scale is 2^(code - 127); the kernel multiplies by 2^(127 - code) (E8M0ToFloat(254 -
// code), exact for every code the scale rule makes) where the reference divides: the same real
// number rounded once, so the same bits, subnormal quotients included (no flush to zero).
TEST_CASE(
    "MXFP8: x times the scale's exact reciprocal is x divided by the scale, for every bf16 and "
    "code") {
  uint64_t wrong = 0;
  for (int code = 0; code <= 254; ++code) {
    const float scale = E8M0ToFloat(static_cast<uint8_t>(code));
    const float inverse = E8M0ToFloat(static_cast<uint8_t>(254 - code));
    REQUIRE(static_cast<double>(scale) * static_cast<double>(inverse) == 1.0);
    for (uint32_t h = 0; h <= 0xFFFF; ++h) {
      const float x = BF16ToFloat(static_cast<uint16_t>(h));
      if (std::isnan(x)) continue;  // encoded from its own bits, never divided
      wrong += std::bit_cast<uint32_t>(x / scale) != std::bit_cast<uint32_t>(x * inverse);
    }
  }
  REQUIRE(wrong == 0);
}

}  // namespace
}  // namespace refit
