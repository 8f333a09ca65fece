#include "plan/dtype.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace refit {

int DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kI8:
    case DType::kE8M0:
      return 1;
    case DType::kI64:
      return 8;
  }
  return 0;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kF32:
      return "fp32";
    case DType::kF8E4M3:
      return "fp8_e4m3";
    case DType::kF8E5M2:
      return "fp8_e5m2";
    case DType::kI8:
      return "int8";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kE8M0:
      return "e8m0";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  std::string n = absl::AsciiStrToLower(name);
  if (n.rfind("torch.", 0) == 0) n = n.substr(6);
  if (n == "bf16" || n == "bfloat16") return DType::kBF16;
  if (n == "fp16" || n == "float16" || n == "half" || n == "f16") return DType::kF16;
  if (n == "fp32" || n == "float32" || n == "float" || n == "f32") return DType::kF32;
  if (n == "fp8_e4m3" || n == "float8_e4m3fn" || n == "e4m3" || n == "fp8") return DType::kF8E4M3;
  if (n == "fp8_e5m2" || n == "float8_e5m2" || n == "e5m2") return DType::kF8E5M2;
  if (n == "int8" || n == "i8") return DType::kI8;
  if (n == "int32" || n == "i32") return DType::kI32;
  if (n == "int64" || n == "i64") return DType::kI64;
  if (n == "e8m0" || n == "float8_e8m0fnu" || n == "fp8_e8m0") return DType::kE8M0;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype \"", name,
      "\" (expected one of bf16, fp16, fp32, fp8_e4m3, fp8_e5m2, int8, int32, int64, e8m0)"));
}

bool CanConvert(DType from, DType to) {
  if (from == to) return true;
  auto is_float = [](DType d) { return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32; };
  return is_float(from) && is_float(to);
}

bool CanQuantizeFrom(DType from) {
  return from == DType::kBF16 || from == DType::kF16 || from == DType::kF32;
}

}  // namespace refit
