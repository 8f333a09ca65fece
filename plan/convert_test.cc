#include "plan/convert.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>

namespace refit {
namespace {

TEST_CASE("bf16 round-trips every bf16 value through fp32 and rounds to nearest even") {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float f = BF16ToFloat(static_cast<uint16_t>(bits));
    if (std::isnan(f)) {
      REQUIRE(std::isnan(BF16ToFloat(FloatToBF16(f))));
      continue;
    }
    REQUIRE(FloatToBF16(f) == bits);
  }
  CHECK(FloatToBF16(1.00390625f) == 0x3F80);  // exactly half way: ties to even (down)
  CHECK(FloatToBF16(1.01171875f) == 0x3F82);  // half way above an odd mantissa: up
}

TEST_CASE("fp16 round-trips every fp16 value, subnormals included") {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float f = F16ToFloat(static_cast<uint16_t>(bits));
    if (std::isnan(f)) {
      REQUIRE(std::isnan(F16ToFloat(FloatToF16(f))));
      continue;
    }
    REQUIRE(FloatToF16(f) == bits);
  }
  CHECK(FloatToF16(65520.0f) == 0x7C00);  // overflows to infinity
  CHECK(FloatToF16(1e-9f) == 0);
  CHECK(F16ToFloat(FloatToF16(0.1f)) == Approx(0.1f).epsilon(1e-3));
}

TEST_CASE("ConvertElements converts among bf16, fp16 and fp32; copies identical dtypes") {
  const float in[3] = {1.5f, -2.0f, 100.0f};
  uint16_t half[3];
  float back[3];
  ConvertElements(reinterpret_cast<const std::byte*>(in), DType::kF32,
                  reinterpret_cast<std::byte*>(half), DType::kF16, 3);
  ConvertElements(reinterpret_cast<const std::byte*>(half), DType::kF16,
                  reinterpret_cast<std::byte*>(back), DType::kF32, 3);
  CHECK(std::memcmp(in, back, sizeof in) == 0);
  uint16_t bf[3];
  ConvertElements(reinterpret_cast<const std::byte*>(half), DType::kF16,
                  reinterpret_cast<std::byte*>(bf), DType::kBF16, 3);
  CHECK(BF16ToFloat(bf[2]) == 100.0f);
  int64_t a[2] = {1, -1}, b[2] = {0, 0};
  ConvertElements(reinterpret_cast<const std::byte*>(a), DType::kI64,
                  reinterpret_cast<std::byte*>(b), DType::kI64, 2);
  CHECK(b[1] == -1);
}

}  // namespace
}  // namespace refit
