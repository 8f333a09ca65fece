// Element conversions among bf16, fp16 and fp32 (round to nearest even), the CPU reference for
// the casts the data plane performs on the way.
#pragma once

#include <cstddef>
#include <cstdint>

#include "plan/dtype.h"

namespace refit {

float BF16ToFloat(uint16_t bits);
uint16_t FloatToBF16(float value);
float F16ToFloat(uint16_t bits);
uint16_t FloatToF16(float value);

// Converts `n` elements; identical dtypes copy bytes. Pairs that CanConvert() rejects must not
// reach here.
void ConvertElements(const std::byte* src, DType src_dtype, std::byte* dst, DType dst_dtype,
                     int64_t n);

}  // namespace refit
