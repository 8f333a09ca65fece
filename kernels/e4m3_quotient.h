// Block fp8's quotients x / scale without an IEEE division per element. The reference
// (plan/fp8_block.h) rounds x / scale to fp32 once, then to e4m3; a GPU's division is a dozen
// instructions an element, a reciprocal and a call-guard among them, and made the quantizing
// kernel compute-bound. Here the block's scale gets its correctly rounded reciprocal once, and each
// element one product and one correction by fused multiply-adds (the overshoot q * scale - x is
// exact in an FMA; subtracting overshoot * reciprocal rounds to the quotient, Markstein's step;
// taken with this sign, a zero x keeps its sign: +0 - +0 would make -0's quotient +0). That is
// the division's fp32 value except where x or the overshoot is far below the normal range; no
// such case changes an e4m3 code for a block whose amax is kCorrectedQuotientMinAmax or more:
// kernels/e4m3_quotient_test checks every bf16 x against every bf16 amax from there up, and finds
// codes that differ below it.
// Shared by the CUDA kernels and that test, so both run this code.
#pragma once

#include <cmath>

#ifdef __CUDACC__
#define REFIT_HOST_DEVICE __host__ __device__
#else
#define REFIT_HOST_DEVICE
#endif

namespace refit {

// Blocks with a smaller amax (2^-64: no weight block is this small but one of zeros, amax 0)
// divide.
inline constexpr float kCorrectedQuotientMinAmax = 0x1p-64f;

// 1 / scale, correctly rounded.
REFIT_HOST_DEVICE inline float ReciprocalOf(float scale) {
#ifdef __CUDA_ARCH__
  return __frcp_rn(scale);
#else
  return 1.0f / scale;
#endif
}

// x / scale as the division rounds it (for the blocks above), from `inverse` = ReciprocalOf(scale).
REFIT_HOST_DEVICE inline float CorrectedQuotient(float x, float scale, float inverse) {
#ifdef __CUDA_ARCH__
  const float q = __fmul_rn(x, inverse);
  const float overshoot = __fmaf_rn(q, scale, -x);
  return __fmaf_rn(-overshoot, inverse, q);
#else
  const float q = x * inverse;
  const float overshoot = std::fmaf(q, scale, -x);
  return std::fmaf(-overshoot, inverse, q);
#endif
}

}  // namespace refit
