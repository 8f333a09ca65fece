// Block-scaled fp8 quantization, the CPU reference: bf16 or fp32 weights to OCP
// float8_e4m3fn with one scale per block, in the two layouts engines load.
//
// e4m3fn: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; S.1111.111 (0x7f,
// 0xff) is NaN; largest finite 448 = 1.75 * 2^8; smallest normal 2^-6; subnormals k * 2^-9.
//
// Element rule, FloatToE4M3: round to nearest, ties to even (on the exact fp32 value), then
// saturate: every finite |v| >= 448 and +-inf become +-448 (so 464, the tie between 448 and the
// NaN pattern's 480, is 448 too). NaN -> NaN with its sign (0x7f / 0xff). The sign of a zero
// result is kept (-0.0 and -2^-11 give 0x80). This is OCP FP8's saturating conversion; the GPU
// counterpart is CUDA's __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3) (its NaN sign is to be
// checked there). torch's .to(float8_e4m3fn) does not saturate (a finite value past 464 becomes
// NaN), so torch comparisons clamp to +-448 first.
//
// Block fp8 (DeepSeek-V3, vLLM `weight_block_size`): a 2-D [rows, cols] row-major weight (rows = n,
// the output dimension; cols = k, the reduction dimension) cut into blocks of block.rows x
// block.cols (128 x 128), the last block row and column partial when rows or cols is not a
// multiple; scales are fp32, row-major [ceil(rows / block.rows), ceil(cols / block.cols)], the
// `<weight>_scale_inv` tensor. Per block, in fp32 with IEEE operations (a GPU kernel must use
// __fdiv_rn, not a reciprocal, to match):
//   amax  = max |x| over the block's finite elements (NaN and +-inf do not count)
//   scale = amax / 448, raised to 2^-126 (FLT_MIN) when smaller; scale = 1 when amax == 0
//   q     = FloatToE4M3(x / scale)   (a NaN x is encoded from its own bits, not divided)
// Dequantized value: E4M3ToFloat(q) * scale (the engines multiply by scale_inv; scale here IS
// scale_inv). The 2^-126 floor keeps a block of tiny values (amax < 448 * 2^-126) from a
// subnormal scale, which a flush-to-zero engine would read as 0; a block that is all zeros, NaN
// or inf gets scale 1. So +-inf saturates to +-448 * scale, NaN stays NaN, and neither changes
// its block's other elements.
//
// MXFP8 (OCP Microscaling Formats v1.0, E4M3 elements): blocks of 32 consecutive elements along
// the last (reduction) dimension of each row, the last one of a row partial when cols % 32 != 0;
// scales are E8M0 bytes (2^(code - 127); 0xff NaN; never written here), row-major
// [rows, ceil(cols / 32)]. Per block:
//   amax       = max |x| over the block's finite elements, as above
//   shared_exp = floor(log2(amax)) - 8, clamped below to -127 (8 = the exponent of e4m3's largest
//                normal, 448 = 1.75 * 2^8); code 127 (scale 1) when amax == 0
//   q          = FloatToE4M3(x / 2^shared_exp)   (exact division by a power of two)
// This is the spec's conversion (OCP MX v1.0 section 6.3, "shared_exp = floor(log2(max_i
// |V_i|)) - emax_elem; X = 2^shared_exp; P_i = quantize_to_element_format(V_i / X)", normal
// numbers clamped to the largest). Values of the block in (448, 512) * X saturate. The spec does
// not clamp infs and NaNs, and e4m3 has no inf; here, as in block fp8, amax skips them, NaN stays
// NaN and +-inf saturates to +-448 * X, so neither changes its block's other elements.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"

namespace refit {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr int64_t kMxfp8BlockSize = 32;

// One element. FloatToE4M3: round to nearest even, saturating, NaN kept (rules above).
uint8_t FloatToE4M3(float value);
float E4M3ToFloat(uint8_t code);

// E8M0 scale byte to its value, 2^(code - 127) (0xff: NaN).
float E8M0ToFloat(uint8_t code);

// The per-block scales, from a block's finite amax (>= 0), by the rules above.
float BlockFp8Scale(float amax);
uint8_t Mxfp8ScaleCode(float amax);

struct Fp8BlockShape {
  int64_t rows = 128;
  int64_t cols = 128;
};

// Elements of the scale tensor: ceil(rows / block.rows) * ceil(cols / block.cols), and
// rows * ceil(cols / 32).
int64_t BlockFp8ScaleCount(int64_t rows, int64_t cols, Fp8BlockShape block);
int64_t Mxfp8ScaleCount(int64_t rows, int64_t cols);

// Quantizes a row-major [rows, cols] tensor (bf16 bit patterns or fp32) into `out` (rows * cols
// e4m3 codes) and `scales`. INVALID_ARGUMENT, naming the span whose size is wrong (or the bad
// shape), when a size does not match; nothing is written then.
absl::Status QuantizeBlockFp8(std::span<const uint16_t> bf16, int64_t rows, int64_t cols,
                              Fp8BlockShape block, std::span<uint8_t> out, std::span<float> scales);
absl::Status QuantizeBlockFp8(std::span<const float> values, int64_t rows, int64_t cols,
                              Fp8BlockShape block, std::span<uint8_t> out, std::span<float> scales);
// out[i] = E4M3ToFloat(q[i]) * scale of i's block.
absl::Status DequantizeBlockFp8(std::span<const uint8_t> q, int64_t rows, int64_t cols,
                                Fp8BlockShape block, std::span<const float> scales,
                                std::span<float> out);

absl::Status QuantizeMxfp8(std::span<const uint16_t> bf16, int64_t rows, int64_t cols,
                           std::span<uint8_t> out, std::span<uint8_t> scales);
absl::Status QuantizeMxfp8(std::span<const float> values, int64_t rows, int64_t cols,
                           std::span<uint8_t> out, std::span<uint8_t> scales);
// out[i] = E4M3ToFloat(q[i]) * E8M0ToFloat(scale of i's block).
absl::Status DequantizeMxfp8(std::span<const uint8_t> q, int64_t rows, int64_t cols,
                             std::span<const uint8_t> scales, std::span<float> out);

// One block, the data plane's unit of quantization: `rows` x `cols` values, element (r, c) at
// values[r * cols + c]. Writes the codes to codes[r * code_stride + c] (codes may be null: the
// scale alone) and returns the scale by the rules above: block fp8's fp32 scale_inv, or MXFP8's
// E8M0 code (rows 1).
float QuantizeOneBlockFp8(const float* values, int64_t rows, int64_t cols, uint8_t* codes,
                          int64_t code_stride);
uint8_t QuantizeOneBlockMxfp8(const float* values, int64_t cols, uint8_t* codes);

}  // namespace refit
