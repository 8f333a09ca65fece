#include "plan/fp8_block.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "plan/convert.h"

namespace refit {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// x / scale to e4m3. A NaN is encoded from its own bits, before the division: IEEE leaves the sign
// of a NaN result unspecified, and a GPU returns a canonical one.
uint8_t QuantizeElement(float x, float scale) { return FloatToE4M3(std::isnan(x) ? x : x / scale); }

// Loads element i as fp32 (bf16 widens exactly).
float Load(std::span<const uint16_t> in, int64_t i) { return BF16ToFloat(in[i]); }
float Load(std::span<const float> in, int64_t i) { return in[i]; }

// Checks a 2-D shape and returns rows * cols.
absl::Status CheckShape(absl::string_view op, int64_t rows, int64_t cols, int64_t* elements) {
  if (rows < 0 || cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": shape [", rows, ", ", cols, "] has a negative dimension"));
  }
  if (cols != 0 && rows > std::numeric_limits<int64_t>::max() / cols) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": shape [", rows, ", ", cols, "] overflows int64"));
  }
  *elements = rows * cols;
  return absl::OkStatus();
}

absl::Status CheckSize(absl::string_view op, absl::string_view what, size_t got, int64_t want,
                       absl::string_view why) {
  if (static_cast<int64_t>(got) == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", what, " has ", got, " elements, expected ", want, " (", why, ")"));
}

absl::Status CheckBlock(absl::string_view op, Fp8BlockShape block) {
  if (block.rows > 0 && block.cols > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": block ", block.rows, "x", block.cols, " is not positive"));
}

// Sizes of a block fp8 call: input/q, output, scales.
absl::Status CheckBlockFp8(absl::string_view op, size_t in, int64_t rows, int64_t cols,
                           Fp8BlockShape block, size_t out, size_t scales) {
  int64_t n = 0;
  if (absl::Status s = CheckShape(op, rows, cols, &n); !s.ok()) return s;
  if (absl::Status s = CheckBlock(op, block); !s.ok()) return s;
  const std::string shape = absl::StrCat("[", rows, ", ", cols, "]");
  const int64_t grid_rows = CeilDiv(rows, block.rows), grid_cols = CeilDiv(cols, block.cols);
  if (absl::Status s = CheckSize(op, "input", in, n, shape); !s.ok()) return s;
  if (absl::Status s = CheckSize(op, "output", out, n, shape); !s.ok()) return s;
  return CheckSize(op, "scales", scales, grid_rows * grid_cols,
                   absl::StrCat("[", grid_rows, ", ", grid_cols, "] blocks of ", block.rows, "x",
                                block.cols, " over ", shape));
}

absl::Status CheckMxfp8(absl::string_view op, size_t in, int64_t rows, int64_t cols, size_t out,
                        size_t scales) {
  int64_t n = 0;
  if (absl::Status s = CheckShape(op, rows, cols, &n); !s.ok()) return s;
  const std::string shape = absl::StrCat("[", rows, ", ", cols, "]");
  if (absl::Status s = CheckSize(op, "input", in, n, shape); !s.ok()) return s;
  if (absl::Status s = CheckSize(op, "output", out, n, shape); !s.ok()) return s;
  return CheckSize(op, "scales", scales, Mxfp8ScaleCount(rows, cols),
                   absl::StrCat("[", rows, ", ", CeilDiv(cols, kMxfp8BlockSize),
                                "] blocks of 32 along the last dimension of ", shape));
}

// Max |x| over the finite elements of the block [r0, r1) x [c0, c1).
template <typename In>
float FiniteAmax(In in, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float amax = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      const float a = std::fabs(Load(in, r * cols + c));
      if (std::isfinite(a) && a > amax) amax = a;
    }
  }
  return amax;
}

template <typename In>
absl::Status QuantizeBlockFp8Impl(In in, int64_t rows, int64_t cols, Fp8BlockShape block,
                                  std::span<uint8_t> out, std::span<float> scales) {
  if (absl::Status s = CheckBlockFp8("QuantizeBlockFp8", in.size(), rows, cols, block, out.size(),
                                     scales.size());
      !s.ok()) {
    return s;
  }
  const int64_t grid_cols = CeilDiv(cols, block.cols);
  for (int64_t r0 = 0; r0 < rows; r0 += block.rows) {
    const int64_t r1 = std::min(rows, r0 + block.rows);
    for (int64_t c0 = 0; c0 < cols; c0 += block.cols) {
      const int64_t c1 = std::min(cols, c0 + block.cols);
      const float scale = BlockFp8Scale(FiniteAmax(in, cols, r0, r1, c0, c1));
      scales[(r0 / block.rows) * grid_cols + c0 / block.cols] = scale;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          out[r * cols + c] = QuantizeElement(Load(in, r * cols + c), scale);
        }
      }
    }
  }
  return absl::OkStatus();
}

template <typename In>
absl::Status QuantizeMxfp8Impl(In in, int64_t rows, int64_t cols, std::span<uint8_t> out,
                               std::span<uint8_t> scales) {
  if (absl::Status s =
          CheckMxfp8("QuantizeMxfp8", in.size(), rows, cols, out.size(), scales.size());
      !s.ok()) {
    return s;
  }
  const int64_t grid_cols = CeilDiv(cols, kMxfp8BlockSize);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += kMxfp8BlockSize) {
      const int64_t c1 = std::min(cols, c0 + kMxfp8BlockSize);
      const uint8_t code = Mxfp8ScaleCode(FiniteAmax(in, cols, r, r + 1, c0, c1));
      scales[r * grid_cols + c0 / kMxfp8BlockSize] = code;
      const float x = E8M0ToFloat(code);  // a power of two: the division below is exact
      for (int64_t c = c0; c < c1; ++c)
        out[r * cols + c] = QuantizeElement(Load(in, r * cols + c), x);
    }
  }
  return absl::OkStatus();
}

}  // namespace

uint8_t FloatToE4M3(float value) {
  const uint32_t u = Bits(value);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFF;
  if (a > 0x7F800000) return sign | 0x7F;   // NaN
  if (a >= 0x43E00000) return sign | 0x7E;  // >= 448 and inf: saturate
  const uint32_t exp = a >> 23;
  if (exp < 121) {
    // Below 2^-6, e4m3's smallest normal: a subnormal result counts units of 2^-9. The value is
    // mant * 2^(exp - 150) (exp >= 1), so the count is mant >> (141 - exp), rounded to even; a
    // carry into 8 is the smallest normal's code, 0x08.
    if (exp < 117) return sign;  // below 2^-10: rounds to zero (fp32 subnormals included)
    const uint32_t mant = (a & 0x7FFFFF) | 0x800000;
    const uint32_t shift = 141 - exp;  // 21..24
    uint32_t q = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (q & 1))) ++q;
    return sign | static_cast<uint8_t>(q);
  }
  // Normal: keep the top 3 of 23 mantissa bits, round to even (a carry moves the exponent), and
  // rebias 127 -> 7. The result is at most 448's code: anything that would round past it was
  // caught above.
  uint32_t v = a >> 20;
  const uint32_t rest = a & 0xFFFFF;
  if (rest > 0x80000 || (rest == 0x80000 && (v & 1))) ++v;
  return sign | static_cast<uint8_t>(v - (120u << 3));
}

float E4M3ToFloat(uint8_t code) {
  const uint32_t sign = uint32_t(code & 0x80) << 24;
  const uint32_t exp = (code >> 3) & 0xF;
  const uint32_t mant = code & 0x7;
  if (exp == 0xF && mant == 0x7) return FromBits(sign | 0x7FC00000);
  if (exp == 0) {  // mant * 2^-9, exact in fp32
    const float m = static_cast<float>(mant) * 0.001953125f;
    return sign ? -m : m;
  }
  return FromBits(sign | ((exp + 120) << 23) | (mant << 20));
}

float E8M0ToFloat(uint8_t code) {
  if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, int{code} - 127);
}

float BlockFp8Scale(float amax) {
  if (amax == 0.0f) return 1.0f;
  const float scale = amax / kE4M3Max;
  return scale < std::numeric_limits<float>::min() ? std::numeric_limits<float>::min() : scale;
}

uint8_t Mxfp8ScaleCode(float amax) {
  if (amax == 0.0f) return 127;
  // floor(log2(amax)) from the bits: the biased exponent for a normal amax, the top set bit's
  // position for an fp32 subnormal one.
  const uint32_t u = Bits(amax) & 0x7FFFFFFF;
  int floor_log2;
  if ((u >> 23) != 0) {
    floor_log2 = static_cast<int>(u >> 23) - 127;
  } else {
    int top = 22;
    while (((u >> top) & 1) == 0) --top;
    floor_log2 = top - 149;
  }
  const int shared_exp = std::max(floor_log2 - 8, -127);
  return static_cast<uint8_t>(shared_exp + 127);
}

float QuantizeOneBlockFp8(const float* values, int64_t rows, int64_t cols, uint8_t* codes,
                          int64_t code_stride) {
  const std::span<const float> in(values, static_cast<size_t>(rows * cols));
  const float scale = BlockFp8Scale(FiniteAmax(in, cols, 0, rows, 0, cols));
  if (codes != nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c)
        codes[r * code_stride + c] = QuantizeElement(in[r * cols + c], scale);
    }
  }
  return scale;
}

uint8_t QuantizeOneBlockMxfp8(const float* values, int64_t cols, uint8_t* codes) {
  const std::span<const float> in(values, static_cast<size_t>(cols));
  const uint8_t code = Mxfp8ScaleCode(FiniteAmax(in, cols, 0, 1, 0, cols));
  if (codes != nullptr) {
    const float x = E8M0ToFloat(code);
    for (int64_t c = 0; c < cols; ++c) codes[c] = QuantizeElement(in[c], x);
  }
  return code;
}

int64_t BlockFp8ScaleCount(int64_t rows, int64_t cols, Fp8BlockShape block) {
  return CeilDiv(rows, block.rows) * CeilDiv(cols, block.cols);
}

int64_t Mxfp8ScaleCount(int64_t rows, int64_t cols) {
  return rows * CeilDiv(cols, kMxfp8BlockSize);
}

absl::Status QuantizeBlockFp8(std::span<const uint16_t> bf16, int64_t rows, int64_t cols,
                              Fp8BlockShape block, std::span<uint8_t> out,
                              std::span<float> scales) {
  return QuantizeBlockFp8Impl(bf16, rows, cols, block, out, scales);
}

absl::Status QuantizeBlockFp8(std::span<const float> values, int64_t rows, int64_t cols,
                              Fp8BlockShape block, std::span<uint8_t> out,
                              std::span<float> scales) {
  return QuantizeBlockFp8Impl(values, rows, cols, block, out, scales);
}

absl::Status DequantizeBlockFp8(std::span<const uint8_t> q, int64_t rows, int64_t cols,
                                Fp8BlockShape block, std::span<const float> scales,
                                std::span<float> out) {
  if (absl::Status s = CheckBlockFp8("DequantizeBlockFp8", q.size(), rows, cols, block, out.size(),
                                     scales.size());
      !s.ok()) {
    return s;
  }
  const int64_t grid_cols = CeilDiv(cols, block.cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = scales[(r / block.rows) * grid_cols + c / block.cols];
      out[r * cols + c] = E4M3ToFloat(q[r * cols + c]) * scale;
    }
  }
  return absl::OkStatus();
}

absl::Status QuantizeMxfp8(std::span<const uint16_t> bf16, int64_t rows, int64_t cols,
                           std::span<uint8_t> out, std::span<uint8_t> scales) {
  return QuantizeMxfp8Impl(bf16, rows, cols, out, scales);
}

absl::Status QuantizeMxfp8(std::span<const float> values, int64_t rows, int64_t cols,
                           std::span<uint8_t> out, std::span<uint8_t> scales) {
  return QuantizeMxfp8Impl(values, rows, cols, out, scales);
}

absl::Status DequantizeMxfp8(std::span<const uint8_t> q, int64_t rows, int64_t cols,
                             std::span<const uint8_t> scales, std::span<float> out) {
  if (absl::Status s =
          CheckMxfp8("DequantizeMxfp8", q.size(), rows, cols, out.size(), scales.size());
      !s.ok()) {
    return s;
  }
  const int64_t grid_cols = CeilDiv(cols, kMxfp8BlockSize);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float x = E8M0ToFloat(scales[r * grid_cols + c / kMxfp8BlockSize]);
      out[r * cols + c] = E4M3ToFloat(q[r * cols + c]) * x;
    }
  }
  return absl::OkStatus();
}

}  // namespace refit
