#include "plan/fp8_block.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "plan/convert.h"

namespace refit {
namespace {

// ---- An independent reference, in double, from the format's definition --------------------

// The value of an e4m3fn code, from the definition (not the bit tricks under test).
double RefDecode(int code) {
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  const int e = (code >> 3) & 0xF;
  const int m = code & 0x7;
  if (e == 0xF && m == 0x7) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return sign * (m / 8.0) * std::ldexp(1.0, -6);
  return sign * (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
}

// The nearest finite code to x by exhaustive search over every non-negative finite code, ties to
// the even code (the even mantissa); sign kept; NaN -> NaN with its sign. Nearest among finite
// codes saturates by itself: above 448 there is no closer code.
uint8_t RefEncode(double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7F;
  const double mag = std::min(std::fabs(x), std::numeric_limits<double>::max());
  int best = 0;
  double best_d = std::fabs(RefDecode(0) - mag);
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(RefDecode(c) - mag);
    if (d < best_d || (d == best_d && c % 2 == 0)) best = c, best_d = d;
  }
  return sign | static_cast<uint8_t>(best);
}

float ToBF16Value(float f) { return BF16ToFloat(FloatToBF16(f)); }

// Reference block fp8: amax per block in a first pass over all elements, then each element by
// the exhaustive-search encoder. Scale rule from the header (it is the specification).
void RefBlockFp8(const std::vector<float>& x, int64_t rows, int64_t cols, Fp8BlockShape block,
                 std::vector<uint8_t>* q, std::vector<float>* scales) {
  const int64_t gr = (rows + block.rows - 1) / block.rows;
  const int64_t gc = (cols + block.cols - 1) / block.cols;
  std::vector<float> amax(gr * gc, 0.0f);
  for (int64_t i = 0; i < rows * cols; ++i) {
    const int64_t b = (i / cols / block.rows) * gc + (i % cols) / block.cols;
    if (std::isfinite(x[i])) amax[b] = std::max(amax[b], std::fabs(x[i]));
  }
  scales->assign(gr * gc, 0.0f);
  for (int64_t b = 0; b < gr * gc; ++b) {
    float s = amax[b] / 448.0f;
    if (amax[b] == 0.0f) s = 1.0f;
    if (s < std::numeric_limits<float>::min()) s = std::numeric_limits<float>::min();
    (*scales)[b] = s;
  }
  q->assign(rows * cols, 0);
  for (int64_t i = 0; i < rows * cols; ++i) {
    const int64_t b = (i / cols / block.rows) * gc + (i % cols) / block.cols;
    const float t = x[i] / (*scales)[b];  // the fp32 division the rule specifies
    (*q)[i] = RefEncode(std::isnan(x[i]) ? x[i] : t);
  }
}

// Reference MXFP8: shared exponent from frexp in double; elements divided exactly in double.
void RefMxfp8(const std::vector<float>& x, int64_t rows, int64_t cols, std::vector<uint8_t>* q,
              std::vector<uint8_t>* scales) {
  const int64_t gc = (cols + 31) / 32;
  scales->assign(rows * gc, 0);
  q->assign(rows * cols, 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < gc; ++b) {
      double amax = 0;
      for (int64_t c = b * 32; c < std::min(cols, b * 32 + 32); ++c) {
        const double v = x[r * cols + c];
        if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
      }
      int shared = 0;
      if (amax > 0) {
        int e;
        std::frexp(amax, &e);  // amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
        shared = std::max(e - 1 - 8, -127);
      }
      (*scales)[r * gc + b] = static_cast<uint8_t>(shared + 127);
      for (int64_t c = b * 32; c < std::min(cols, b * 32 + 32); ++c) {
        (*q)[r * cols + c] = RefEncode(std::ldexp(double{x[r * cols + c]}, -shared));
      }
    }
  }
}

// Half an e4m3 ulp at |t| (t in e4m3's range): 2^(max(floor(log2|t|), -6) - 3) / 2.
double HalfUlp(double t) {
  int e = -6;
  if (t != 0) {
    int fe;
    std::frexp(std::fabs(t), &fe);
    e = std::max(fe - 1, -6);
  }
  return std::ldexp(1.0, e - 4);
}

std::vector<uint16_t> ToBF16(const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = FloatToBF16(x[i]);
  return out;
}

// Counts codes that differ, reporting the first few.
int CountMismatches(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  REQUIRE(got.size() == want.size());
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && ++bad <= 5) {
      FAIL_CHECK("element " << i << ": got 0x" << std::hex << int{got[i]} << ", want 0x"
                            << int{want[i]});
    }
  }
  return bad;
}

// ---- The element encoder -------------------------------------------------------------------

TEST_CASE("E4M3ToFloat decodes every code as the definition says; encoding it gives it back") {
  for (int c = 0; c < 256; ++c) {
    const float f = E4M3ToFloat(static_cast<uint8_t>(c));
    const double want = RefDecode(c);
    if (std::isnan(want)) {
      REQUIRE(std::isnan(f));
      REQUIRE(std::signbit(f) == ((c & 0x80) != 0));
      continue;
    }
    REQUIRE(double{f} == want);
    REQUIRE(FloatToE4M3(f) == c);
  }
  CHECK(E4M3ToFloat(0x7E) == 448.0f);
  CHECK(E4M3ToFloat(0x01) == std::ldexp(1.0f, -9));
  CHECK(E4M3ToFloat(0x08) == std::ldexp(1.0f, -6));
}

TEST_CASE("FloatToE4M3 equals the exhaustive nearest-code search on every bf16 pattern") {
  int bad = 0;
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float x = BF16ToFloat(static_cast<uint16_t>(bits));
    // As is (mostly saturating or zero), and moved to an exponent in [-11, 9], which spans
    // e4m3's zeros, subnormals, normals and the saturation above 448, every mantissa at each.
    float ys[2] = {x, x};
    const int exp = (bits >> 7) & 0xFF;
    if (exp != 0 && exp != 0xFF) ys[1] = std::ldexp(x, (-11 + exp % 21) - (exp - 127));
    for (float y : ys) {
      const uint8_t got = FloatToE4M3(y), want = RefEncode(y);
      if (got != want && ++bad <= 5) {
        FAIL_CHECK("x = " << y << ": got " << int{got} << ", want " << int{want});
      }
    }
  }
  CHECK(bad == 0);
}

TEST_CASE("FloatToE4M3 at every tie between adjacent codes, one fp32 ulp either side, and random") {
  int bad = 0;
  auto check = [&](float y) {
    const uint8_t got = FloatToE4M3(y), want = RefEncode(y);
    if (got != want && ++bad <= 5) {
      FAIL_CHECK("x = " << y << ": got " << int{got} << ", want " << int{want});
    }
  };
  for (int c = 0; c < 0x7E; ++c) {
    for (double sign : {1.0, -1.0}) {
      const float mid = static_cast<float>(sign * (RefDecode(c) + RefDecode(c + 1)) / 2);
      check(mid);
      check(std::nextafter(mid, 0.0f));
      check(std::nextafter(mid, static_cast<float>(sign * 1e9)));
    }
  }
  std::mt19937 rng(17);
  std::uniform_real_distribution<double> log_mag(-12.0, 10.0);
  for (int i = 0; i < 100000; ++i) {
    const float y = static_cast<float>(std::exp2(log_mag(rng))) * (i % 2 ? -1.0f : 1.0f);
    check(y);
  }
  for (uint32_t u : {1u, 0x7FFFFFu, 0x800000u, 0x7F7FFFFFu}) {  // fp32 subnormals, min, max
    float f;
    std::memcpy(&f, &u, 4);
    check(f);
    check(-f);
  }
  CHECK(bad == 0);
}

TEST_CASE("FloatToE4M3 edge values: saturation, ties to even, subnormals, signed zero, NaN") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    float x;
    uint8_t code;
  };
  const Case cases[] = {
      {448.0f, 0x7E},
      {-448.0f, 0xFE},
      {464.0f, 0x7E},  // the tie between 448 and 480 (the NaN pattern): 448
      {464.5f, 0x7E},
      {479.0f, 0x7E},  // past the tie: saturates, never NaN
      {1e30f, 0x7E},
      {-1e30f, 0xFE},
      {inf, 0x7E},
      {-inf, 0xFE},
      {432.0f, 0x7E},  // tie between 416 (odd mantissa) and 448 (even): up
      {424.0f, 0x7D},
      {240.0f, 0x77},
      {256.0f, 0x78},
      {1.0f, 0x38},
      {1.0625f, 0x38},                // tie between 1 (even) and 1.125: down
      {1.1875f, 0x3A},                // tie between 1.125 (odd) and 1.25: up
      {std::ldexp(1.0f, -6), 0x08},   // smallest normal
      {std::ldexp(7.0f, -9), 0x07},   // largest subnormal
      {std::ldexp(7.5f, -9), 0x08},   // tie between 7 * 2^-9 (odd) and 2^-6: up
      {std::ldexp(1.0f, -9), 0x01},   // smallest subnormal
      {std::ldexp(1.0f, -10), 0x00},  // half of it: the tie goes to 0 (even)
      {std::nextafter(std::ldexp(1.0f, -10), 1.0f), 0x01},
      {std::ldexp(3.0f, -10), 0x02},   // tie between 2^-9 (odd) and 2^-8: up
      {-std::ldexp(1.0f, -10), 0x80},  // rounds to zero, keeps the sign
      {0.0f, 0x00},
      {-0.0f, 0x80},
      {nan, 0x7F},
      {-nan, 0xFF},
  };
  for (const Case& c : cases) {
    INFO("x = " << c.x);
    CHECK(int{FloatToE4M3(c.x)} == int{c.code});
    CHECK(int{RefEncode(c.x)} == int{c.code});  // the reference agrees with the hand values
  }
}

// ---- Block fp8 -----------------------------------------------------------------------------

// Quantizes through both entry points (fp32, and bf16 when every value is a bf16 value) and
// checks codes and scales against the reference, bit for bit.
void CheckBlockFp8(const std::vector<float>& x, int64_t rows, int64_t cols,
                   Fp8BlockShape block = {}) {
  std::vector<uint8_t> want_q;
  std::vector<float> want_s;
  RefBlockFp8(x, rows, cols, block, &want_q, &want_s);
  std::vector<uint8_t> q(x.size(), 0xAA);
  std::vector<float> s(want_s.size(), -1.0f);
  REQUIRE(QuantizeBlockFp8(std::span<const float>(x), rows, cols, block, q, s).ok());
  CHECK(CountMismatches(q, want_q) == 0);
  for (size_t b = 0; b < s.size(); ++b) {
    INFO("block " << b);
    CHECK(s[b] == want_s[b]);
  }
  bool all_bf16 = true;
  for (float v : x) all_bf16 = all_bf16 && (std::isnan(v) || ToBF16Value(v) == v);
  if (all_bf16) {
    const std::vector<uint16_t> h = ToBF16(x);
    std::vector<uint8_t> q2(x.size(), 0xAA);
    std::vector<float> s2(want_s.size(), -1.0f);
    REQUIRE(QuantizeBlockFp8(std::span<const uint16_t>(h), rows, cols, block, q2, s2).ok());
    CHECK(q2 == q);
    CHECK(s2 == s);
  }
}

TEST_CASE("Block fp8: a block of zeros has scale 1 and zero codes, -0.0 keeping its sign") {
  std::vector<float> x(200 * 130, 0.0f);
  for (size_t i = 0; i < x.size(); i += 3) x[i] = -0.0f;
  std::vector<uint8_t> q(x.size(), 0xAA);
  std::vector<float> s(4, -1.0f);
  REQUIRE(QuantizeBlockFp8(std::span<const float>(x), 200, 130, {}, q, s).ok());
  for (float v : s) CHECK(v == 1.0f);
  for (size_t i = 0; i < x.size(); ++i) REQUIRE(int{q[i]} == (i % 3 == 0 ? 0x80 : 0x00));
  CheckBlockFp8(x, 200, 130);
}

TEST_CASE("Block fp8: one huge outlier per block takes 448, the rest of its block follows it") {
  const int64_t rows = 256, cols = 384;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(rows * cols);
  for (float& v : x) v = ToBF16Value(normal(rng));
  for (int64_t br = 0; br < 2; ++br) {
    for (int64_t bc = 0; bc < 3; ++bc) {
      const int64_t r = br * 128 + rng() % 128, c = bc * 128 + rng() % 128;
      x[r * cols + c] = (bc % 2 ? -30720.0f : 30720.0f) * (br + 1);  // bf16 values
    }
  }
  CheckBlockFp8(x, rows, cols);
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(6);
  REQUIRE(QuantizeBlockFp8(std::span<const float>(x), rows, cols, {}, q, s).ok());
  int outliers = 0, subnormal_or_zero = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (std::fabs(x[i]) >= 3e4f) {
      ++outliers;
      CHECK(int{q[i] & 0x7F} == 0x7E);
      CHECK(s[(i / cols / 128) * 3 + (i % cols) / 128] == std::fabs(x[i]) / 448.0f);
    } else if ((q[i] & 0x78) == 0) {
      ++subnormal_or_zero;
    }
  }
  CHECK(outliers == 6);
  CHECK(subnormal_or_zero > 0);  // N(0, 1) at 448 / 3e4: the subnormal range is exercised
}

TEST_CASE("Block fp8: blocks of subnormal inputs get the 2^-126 scale floor; e4m3 subnormals") {
  // bf16 subnormals (m * 2^-133): amax / 448 is below FLT_MIN, so scale = 2^-126 exactly.
  const int64_t rows = 128, cols = 256;
  std::vector<float> x(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    x[i] = BF16ToFloat(static_cast<uint16_t>((i % 127) + 1 + (i % 2 ? 0x8000 : 0)));
  }
  // The second block: a 448 and values whose quotients are e4m3 subnormals.
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 128; c < cols; ++c) x[r * cols + c] = std::ldexp(float((r + c) % 8), -9);
  }
  x[128] = 448.0f;
  CheckBlockFp8(x, rows, cols);
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(2);
  REQUIRE(QuantizeBlockFp8(std::span<const float>(x), rows, cols, {}, q, s).ok());
  CHECK(s[0] == std::numeric_limits<float>::min());
  CHECK(s[1] == 1.0f);
  // Dividing by a power of two is exact: the codes are the values' own roundings at 2^126.
  CHECK(int{q[0]} == int{FloatToE4M3(std::ldexp(x[0], 126))});
  CHECK(int{q[cols + 129]} == int{FloatToE4M3(x[cols + 129])});
  CHECK(E4M3ToFloat(q[cols + 129]) == x[cols + 129]);  // k * 2^-9 is exact in e4m3
}

TEST_CASE("Block fp8: the largest bf16 and fp32 values") {
  const float bf16_max = BF16ToFloat(0x7F7F);
  const float fp32_max = std::numeric_limits<float>::max();
  for (float m : {bf16_max, fp32_max}) {
    INFO("max = " << m);
    std::vector<float> x(128 * 128);
    for (size_t i = 0; i < x.size(); ++i) x[i] = i % 2 ? -m : m;
    CheckBlockFp8(x, 128, 128);
    std::vector<uint8_t> q(x.size());
    std::vector<float> s(1), back(x.size());
    REQUIRE(QuantizeBlockFp8(std::span<const float>(x), 128, 128, {}, q, s).ok());
    CHECK(s[0] == m / 448.0f);
    CHECK(int{q[0]} == 0x7E);
    CHECK(int{q[1]} == 0xFE);
    REQUIRE(DequantizeBlockFp8(q, 128, 128, {}, s, back).ok());
    CHECK(std::fabs(double{back[0]} - m) <= m * 1e-6);
  }
}

TEST_CASE("Block fp8: random blocks of many magnitudes, partial edge blocks, bf16 and fp32") {
  std::mt19937 rng(2024);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> mag(-30, 30);
  struct Shape {
    int64_t rows, cols;
    Fp8BlockShape block;
  };
  for (const Shape& sh : {Shape{300, 200, {}}, Shape{128, 128, {}}, Shape{1, 1, {}},
                          Shape{129, 257, {}}, Shape{77, 45, {16, 32}}, Shape{5, 300, {1, 128}}}) {
    INFO("shape " << sh.rows << "x" << sh.cols << " block " << sh.block.rows << "x"
                  << sh.block.cols);
    const int64_t gc = (sh.cols + sh.block.cols - 1) / sh.block.cols;
    const int64_t gr = (sh.rows + sh.block.rows - 1) / sh.block.rows;
    std::vector<int> block_mag(gr * gc);
    for (int& m : block_mag) m = mag(rng);
    for (bool bf16 : {true, false}) {
      std::vector<float> x(sh.rows * sh.cols);
      for (int64_t i = 0; i < sh.rows * sh.cols; ++i) {
        const int64_t b = (i / sh.cols / sh.block.rows) * gc + (i % sh.cols) / sh.block.cols;
        x[i] = std::ldexp(normal(rng), block_mag[b]);
        if (bf16) x[i] = ToBF16Value(x[i]);
      }
      CheckBlockFp8(x, sh.rows, sh.cols, sh.block);
    }
  }
}

TEST_CASE("Block fp8: an edge block's scale comes from its own elements only") {
  const int64_t rows = 130, cols = 129;  // grid [2, 2]: the corner block is 2 x 1
  std::vector<float> x(rows * cols, 0.5f);
  x[129 * cols + 128] = -1000.0f;  // in the corner block
  x[128 * cols + 5] = 3.0f;        // in the bottom-left block (rows 128..129)
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(4);
  REQUIRE(QuantizeBlockFp8(std::span<const float>(x), rows, cols, {}, q, s).ok());
  CHECK(s[0] == 0.5f / 448.0f);
  CHECK(s[1] == 0.5f / 448.0f);  // top-right: 128 x 1
  CHECK(s[2] == 3.0f / 448.0f);
  CHECK(s[3] == 1000.0f / 448.0f);
  CHECK(int{q[129 * cols + 128]} == 0xFE);
  CHECK(int{q[128 * cols + 128]} == int{FloatToE4M3(0.5f / (1000.0f / 448.0f))});
  CHECK(int{q[0]} == 0x7E);
  CheckBlockFp8(x, rows, cols);
  std::vector<float> wrong(3);
  CHECK(QuantizeBlockFp8(std::span<const float>(x), rows, cols, {}, q, wrong).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Block fp8: NaN stays NaN, inf saturates, neither counts in amax") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x(128 * 256, 0.25f);
  x[0] = nan;
  x[1] = -nan;
  x[2] = inf;
  x[3] = -inf;
  x[4] = 2.0f;
  for (int64_t i = 128; i < 256; ++i) x[i] = nan;  // second block: NaN and inf only
  for (int64_t r = 1; r < 128; ++r) {
    for (int64_t c = 128; c < 256; ++c) x[r * 256 + c] = (r % 2) ? inf : -inf;
  }
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(2), back(x.size());
  REQUIRE(QuantizeBlockFp8(std::span<const float>(x), 128, 256, {}, q, s).ok());
  CHECK(s[0] == 2.0f / 448.0f);
  CHECK(s[1] == 1.0f);
  CHECK(int{q[0]} == 0x7F);
  CHECK(int{q[1]} == 0xFF);
  CHECK(int{q[2]} == 0x7E);
  CHECK(int{q[3]} == 0xFE);
  CHECK(int{q[4]} == 0x7E);
  CHECK(int{q[5]} == int{FloatToE4M3(0.25f / (2.0f / 448.0f))});
  CHECK(int{q[128]} == 0x7F);
  CHECK(int{q[256 + 128]} == 0x7E);
  CHECK(int{q[2 * 256 + 128]} == 0xFE);
  CheckBlockFp8(x, 128, 256);
  REQUIRE(DequantizeBlockFp8(q, 128, 256, {}, s, back).ok());
  CHECK(std::isnan(back[0]));
  CHECK(back[2] == 448.0f * s[0]);
  CHECK(back[3] == -448.0f * s[0]);
  CHECK(std::fabs(back[4] - 2.0f) <= 2.0f * 0x1p-23f);
}

TEST_CASE(
    "Block fp8: dequantize(quantize(x)) is within half an e4m3 ulp of x / scale, times scale") {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t rows = 257, cols = 300;
  std::vector<float> x(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    x[i] = ToBF16Value(std::ldexp(normal(rng), static_cast<int>((i / cols / 128) * 7 - 6)));
  }
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(BlockFp8ScaleCount(rows, cols, {})), back(x.size());
  REQUIRE(s.size() == 9);
  REQUIRE(QuantizeBlockFp8(std::span<const uint16_t>(ToBF16(x)), rows, cols, {}, q, s).ok());
  REQUIRE(DequantizeBlockFp8(q, rows, cols, {}, s, back).ok());
  int bad = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    const double scale = s[(i / cols / 128) * 3 + (i % cols) / 128];
    const double t = double{x[i]} / scale;  // exact quotient
    const double e = HalfUlp(t);
    // In the scaled domain: half an ulp, plus the fp32 rounding of x / scale.
    const bool scaled_ok = std::fabs(E4M3ToFloat(q[i]) - t) <= e + std::fabs(t) * 0x1p-24;
    // Dequantized, in fp32: that times scale, plus the rounding of the product.
    const bool value_ok = std::fabs(back[i] - double{x[i]}) <=
                          (e + std::fabs(t) * 0x1p-24) * scale + std::fabs(back[i]) * 0x1p-24;
    if (!(scaled_ok && value_ok) && ++bad <= 5) {
      FAIL_CHECK("element " << i << ": x = " << x[i] << ", back = " << back[i]);
    }
  }
  CHECK(bad == 0);
}

TEST_CASE("Block fp8: sizes that do not match are INVALID_ARGUMENT naming the span; none written") {
  std::vector<float> x(10 * 20, 1.0f);
  std::vector<uint8_t> q(200, 0xAA);
  std::vector<float> s(1, -1.0f);
  auto quantize = [&](std::span<const float> in, int64_t rows, int64_t cols, Fp8BlockShape b,
                      std::span<uint8_t> out,
                      std::span<float> sc) { return QuantizeBlockFp8(in, rows, cols, b, out, sc); };
  CHECK(quantize(x, 10, 20, {}, q, s).ok());
  std::fill(q.begin(), q.end(), 0xAA);
  s[0] = -1.0f;
  struct Bad {
    absl::Status status;
    std::string word;
  };
  std::vector<float> s2(2);
  std::vector<uint8_t> q_short(199);
  std::vector<float> back(200);
  const std::vector<float> x_long(201);
  const Bad bad[] = {
      {quantize(x_long, 10, 20, {}, q, s), "input has 201 elements, expected 200"},
      {quantize(x, 10, 20, {}, q_short, s), "output has 199 elements, expected 200"},
      {quantize(x, 10, 20, {}, q, s2), "scales has 2 elements, expected 1"},
      {quantize(x, -10, -20, {}, q, s), "negative"},
      {quantize(x, 10, 20, {0, 128}, q, s), "not positive"},
      {DequantizeBlockFp8(q, 10, 20, {}, s2, back), "scales has 2 elements, expected 1"},
  };
  for (const Bad& b : bad) {
    INFO(b.status.message());
    CHECK(b.status.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(b.status.message()).find(b.word) != std::string::npos);
  }
  for (uint8_t v : q) REQUIRE(int{v} == 0xAA);
  CHECK(s[0] == -1.0f);
  CHECK(BlockFp8ScaleCount(7168, 2112, {}) == 56 * 17);
}

// ---- MXFP8 ---------------------------------------------------------------------------------

void CheckMxfp8(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<uint8_t> want_q, want_s;
  RefMxfp8(x, rows, cols, &want_q, &want_s);
  std::vector<uint8_t> q(x.size(), 0xAA), s(want_s.size(), 0xAA);
  REQUIRE(QuantizeMxfp8(std::span<const float>(x), rows, cols, q, s).ok());
  CHECK(CountMismatches(q, want_q) == 0);
  CHECK(CountMismatches(s, want_s) == 0);
  bool all_bf16 = true;
  for (float v : x) all_bf16 = all_bf16 && (std::isnan(v) || ToBF16Value(v) == v);
  if (all_bf16) {
    std::vector<uint8_t> q2(x.size(), 0xAA), s2(want_s.size(), 0xAA);
    REQUIRE(QuantizeMxfp8(std::span<const uint16_t>(ToBF16(x)), rows, cols, q2, s2).ok());
    CHECK(q2 == q);
    CHECK(s2 == s);
  }
}

TEST_CASE("MXFP8 scale: 2^(floor(log2(amax)) - 8) as an E8M0 code, against frexp") {
  struct Case {
    float amax;
    int code;
  };
  const Case cases[] = {
      {448.0f, 127},
      {256.0f, 127},
      {511.99f, 127},
      {512.0f, 128},
      {255.99f, 126},
      {1.0f, 119},
      {0.0f, 127},
      {std::numeric_limits<float>::max(), 127 + 127 - 8},
      {std::ldexp(1.0f, -119), 0},
      {std::ldexp(1.0f, -140), 0},  // clamped at 2^-127
      {std::ldexp(1.0f, -118), 1},
      {std::numeric_limits<float>::denorm_min(), 0},
  };
  for (const Case& c : cases) {
    INFO("amax = " << c.amax);
    CHECK(int{Mxfp8ScaleCode(c.amax)} == c.code);
  }
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits(1, 0x7F7FFFFF);
  for (int i = 0; i < 100000; ++i) {
    const uint32_t u = bits(rng);
    float a;
    std::memcpy(&a, &u, 4);
    int e;
    std::frexp(double{a}, &e);
    REQUIRE(int{Mxfp8ScaleCode(a)} == std::max(e - 1 - 8, -127) + 127);
  }
  CHECK(E8M0ToFloat(127) == 1.0f);
  CHECK(E8M0ToFloat(0) == std::ldexp(1.0f, -127));
  CHECK(E8M0ToFloat(254) == std::ldexp(1.0f, 127));
  CHECK(std::isnan(E8M0ToFloat(255)));
}

TEST_CASE("MXFP8: random rows of many magnitudes, partial last blocks, bf16 and fp32") {
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> mag(-40, 40);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {5, 100}, {1, 1}, {3, 32}, {64, 4096}, {7, 33}};
  for (auto [rows, cols] : shapes) {
    INFO("shape " << rows << "x" << cols);
    for (bool bf16 : {true, false}) {
      std::vector<float> x(rows * cols);
      int m = 0;
      for (int64_t i = 0; i < rows * cols; ++i) {
        if (i % 32 == 0) m = mag(rng);
        x[i] = std::ldexp(normal(rng), m);
        if (bf16) x[i] = ToBF16Value(x[i]);
      }
      CheckMxfp8(x, rows, cols);
    }
  }
}

TEST_CASE("MXFP8: saturation at the top of the binade, zeros, subnormals, NaN and inf") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t cols = 32 * 5 + 3;
  std::vector<float> x(cols, 0.0f);
  // Block 0: amax 500 in [256, 512): X = 1, 500 saturates to 448, 300 rounds to 288.
  x[0] = 500.0f;
  x[1] = -300.0f;
  x[2] = 0.001f;
  // Block 1: all zeros (one -0.0): code 127, zero codes.
  x[33] = -0.0f;
  // Block 2: fp32 subnormals only: X = 2^-127.
  for (int64_t c = 64; c < 96; ++c) x[c] = std::ldexp(float(c - 63), -140);
  // Block 3: NaN and inf around 1.5: X = 2^-8.
  x[96] = nan;
  x[97] = -inf;
  x[98] = inf;
  x[99] = 1.5f;
  x[100] = -nan;
  // Block 4: amax exactly 2^9 = 512: X = 2, so 512 is 256's code.
  x[128] = 512.0f;
  x[129] = 447.5f;  // / 2 = 223.75, which rounds to 224 (steps of 16 in [128, 256))
  // Block 5 (3 elements): NaN only.
  x[160] = nan;
  x[161] = nan;
  x[162] = nan;
  std::vector<uint8_t> q(cols), s(6);
  REQUIRE(QuantizeMxfp8(std::span<const float>(x), 1, cols, q, s).ok());
  CHECK(int{s[0]} == 127);
  CHECK(int{q[0]} == 0x7E);
  CHECK(E4M3ToFloat(q[1]) == -288.0f);
  CHECK(int{s[1]} == 127);
  CHECK(int{q[33]} == 0x80);
  CHECK(int{q[34]} == 0x00);
  CHECK(int{s[2]} == 0);
  CHECK(E4M3ToFloat(q[95]) == std::ldexp(32.0f, -13));  // 32 * 2^-140 / 2^-127, exact
  CHECK(int{s[3]} == 127 - 8);
  CHECK(int{q[96]} == 0x7F);
  CHECK(int{q[97]} == 0xFE);
  CHECK(int{q[98]} == 0x7E);
  CHECK(E4M3ToFloat(q[99]) == 384.0f);
  CHECK(int{q[100]} == 0xFF);
  CHECK(int{s[4]} == 128);
  CHECK(E4M3ToFloat(q[128]) == 256.0f);
  CHECK(E4M3ToFloat(q[129]) == 224.0f);
  CHECK(int{s[5]} == 127);
  CHECK(int{q[162]} == 0x7F);
  CheckMxfp8(x, 1, cols);
  std::vector<float> back(cols);
  REQUIRE(DequantizeMxfp8(q, 1, cols, s, back).ok());
  CHECK(back[0] == 448.0f);
  CHECK(back[99] == 1.5f);
  CHECK(back[97] == -448.0f / 256);
  CHECK(back[128] == 512.0f);
  CHECK(std::isnan(back[96]));
}

TEST_CASE("MXFP8: dequantize(quantize(x)) within half an e4m3 ulp of x / X, times X") {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t rows = 16, cols = 1000;
  std::vector<float> x(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] = std::ldexp(normal(rng), int(i / 32 % 40) - 20);
  std::vector<uint8_t> q(x.size()), s(Mxfp8ScaleCount(rows, cols));
  std::vector<float> back(x.size());
  REQUIRE(s.size() == 16 * 32);
  REQUIRE(QuantizeMxfp8(std::span<const float>(x), rows, cols, q, s).ok());
  REQUIRE(DequantizeMxfp8(q, rows, cols, s, back).ok());
  int bad = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    const double xs = E8M0ToFloat(s[(i / cols) * 32 + (i % cols) / 32]);
    const double t = double{x[i]} / xs;
    // Exact scaling, so half an ulp bounds it, except where the top of the binade saturates.
    const double err = std::fabs(E4M3ToFloat(q[i]) - t);
    const bool ok = std::fabs(t) > 448 ? err <= std::fabs(t) - 448 : err <= HalfUlp(t);
    if ((!ok || double{back[i]} != E4M3ToFloat(q[i]) * xs) && ++bad <= 5) {
      FAIL_CHECK("element " << i << ": x = " << x[i] << ", back = " << back[i]);
    }
  }
  CHECK(bad == 0);
}

TEST_CASE("MXFP8: sizes that do not match are INVALID_ARGUMENT naming the span") {
  std::vector<float> x(3 * 40);
  std::vector<uint8_t> q(120), s(6), s_bad(3), q_bad(121);
  CHECK(QuantizeMxfp8(std::span<const float>(x), 3, 40, q, s).ok());
  const absl::Status a = QuantizeMxfp8(std::span<const float>(x), 3, 40, q, s_bad);
  CHECK(a.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(a.message()).find("scales has 3 elements, expected 6") != std::string::npos);
  const absl::Status b = QuantizeMxfp8(std::span<const float>(x), 3, 40, q_bad, s);
  CHECK(std::string(b.message()).find("output has 121") != std::string::npos);
  std::vector<float> back(119);
  const absl::Status c = DequantizeMxfp8(q, 3, 40, s, back);
  CHECK(c.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(c.message()).find("output has 119") != std::string::npos);
}

}  // namespace
}  // namespace refit
