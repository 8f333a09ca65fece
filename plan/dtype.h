// Element types a layout may hold, and which of them the data plane can convert between.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace refit {

enum class DType : uint8_t {
  kBF16,
  kF16,
  kF32,
  kF8E4M3,
  kF8E5M2,
  kI8,
  kI32,
  kI64,
  // OCP MX E8M0: an exponent byte, 2^(code - 127); MXFP8's block scales (plan/fp8_block.h).
  kE8M0,
};

inline constexpr int kNumDTypes = 9;

// Bytes per element.
int DTypeSize(DType dtype);

// Canonical lower-case name: "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "int32",
// "int64", "e8m0".
absl::string_view DTypeName(DType dtype);

// Accepts the canonical names and the spellings found in configs and PyTorch
// ("bfloat16", "float16", "half", "float32", "float", "float8_e4m3fn", ...).
absl::StatusOr<DType> ParseDType(absl::string_view name);

// True when the data plane converts `from` into `to` element by element on the way (identity, or
// among bf16, fp16 and fp32). Other pairs must match exactly, except bf16, fp16 or fp32 into
// block-scaled fp8, which the layout declares (LogicalTensor::quant; CanQuantize).
bool CanConvert(DType from, DType to);

// True when `from` may be quantized into block-scaled e4m3 (bf16, fp16, fp32).
bool CanQuantizeFrom(DType from);

}  // namespace refit
