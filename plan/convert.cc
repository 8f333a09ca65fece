#include "plan/convert.h"

#include <cmath>
#include <cstring>

namespace refit {

float BF16ToFloat(uint16_t bits) {
  const uint32_t u = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t FloatToBF16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  if (std::isnan(value)) return static_cast<uint16_t>((u >> 16) | 0x40);  // stay a (quiet) NaN
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float F16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) mant <<= 1, --exp;
      u = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 0x1F) {
    u = sign | 0x7F800000 | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t FloatToF16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t abs = u & 0x7FFFFFFF;
  if (abs >= 0x7F800000) return sign | 0x7C00 | (abs > 0x7F800000 ? 0x200 : 0);  // inf / NaN
  if (abs >= 0x477FF000) return sign | 0x7C00;  // rounds past the largest half: inf
  if (abs < 0x38800000) {                       // below the smallest normal half
    if (abs < 0x33000000) return sign;          // rounds to zero
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7FFFFF) | 0x800000;
    const uint32_t shift = 126 - exp;  // a half subnormal counts units of 2^-24
    const uint32_t shifted = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    uint32_t r = shifted;
    if (rest > half || (rest == half && (shifted & 1))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = abs - 0x38000000;  // rebias exponent 127 -> 15
  r += 0xFFF + ((r >> 13) & 1);
  return sign | static_cast<uint16_t>(r >> 13);
}

namespace {

float Load(const std::byte* p, DType dtype) {
  uint16_t h;
  float f;
  switch (dtype) {
    case DType::kBF16:
      std::memcpy(&h, p, 2);
      return BF16ToFloat(h);
    case DType::kF16:
      std::memcpy(&h, p, 2);
      return F16ToFloat(h);
    default:
      std::memcpy(&f, p, 4);
      return f;
  }
}

void Store(float v, std::byte* p, DType dtype) {
  uint16_t h;
  switch (dtype) {
    case DType::kBF16:
      h = FloatToBF16(v);
      std::memcpy(p, &h, 2);
      return;
    case DType::kF16:
      h = FloatToF16(v);
      std::memcpy(p, &h, 2);
      return;
    default:
      std::memcpy(p, &v, 4);
  }
}

}  // namespace

void ConvertElements(const std::byte* src, DType src_dtype, std::byte* dst, DType dst_dtype,
                     int64_t n) {
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, static_cast<size_t>(n) * DTypeSize(src_dtype));
    return;
  }
  const int s = DTypeSize(src_dtype), d = DTypeSize(dst_dtype);
  for (int64_t i = 0; i < n; ++i) Store(Load(src + i * s, src_dtype), dst + i * d, dst_dtype);
}

}  // namespace refit
