// Element types a layout may hold, and which of them the data plane can convert between.
#pragma once

#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

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
};

inline constexpr int kNumDTypes = 8;

// Bytes per element.
int DTypeSize(DType dtype);

// Canonical lower-case name: "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "int32", "int64".
absl::string_view DTypeName(DType dtype);

// Accepts the canonical names and the spellings found in configs and PyTorch
// ("bfloat16", "float16", "half", "float32", "float", "float8_e4m3fn", ...).
absl::StatusOr<DType> ParseDType(absl::string_view name);

// True when the data plane converts `from` into `to` on the way (identity, or among bf16, fp16
// and fp32). Other pairs must match exactly.
bool CanConvert(DType from, DType to);

}  // namespace refit
