// Plans with quantizing descriptors (kQuantize, kScale), and adversarial sources for them: shared
// by the CPU twin's test (copy_items_test) and the GPU kernel's (copy_kernels_test), so both run
// the same cases. Test-only (Catch2 assertions inside).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/host_copy.h"
#include "plan/layout.h"
#include "plan/plan.h"

namespace refit {

int64_t CeilDiv(int64_t a, int64_t b);

struct QuantCase {
  std::string name;
  Layout src, dst;
  Plan plan;
  int64_t block_rows = 0, block_cols = 0;  // of the quantized tensors (the fill's block classes)
};

// Validates, plans (8 GPUs per node, messages of at most `max_message_bytes`) and names a case.
QuantCase Finish(std::string name, Layout src, Layout dst, int64_t br, int64_t bc,
                 int64_t max_message_bytes);

// Fixed cases (both ops, both formats, bf16 / fp16 / fp32 sources, whole blocks quantized in the
// pack step, cut blocks gathered into scratch and quantized from there in stage 1, partial edge
// blocks, NVLink fan-out of codes, colocated, copy descriptors beside them), then random ones.
std::vector<QuantCase> QuantCases(int random_trials);

uint64_t Mix(uint64_t x);
// The element's bits in `dt` (bf16, fp16, fp32): `v` rounded, or special patterns.
uint32_t BitsOf(float v, DType dt);
uint32_t SignOf(DType dt);
uint32_t MantissaOf(DType dt);
uint32_t InfOf(DType dt);
uint32_t MaxOf(DType dt);
uint32_t NanOf(DType dt, uint64_t h);  // any sign, any payload
// A normal value: random sign and mantissa, exponent in [lo, hi].
float Normal(uint64_t h, int lo, int hi);

inline constexpr int kBlockClasses = 12;
// Element bits of block class `cls` (a function of the block), `h` the element's hash, `origin`
// whether it is the block's first element (the classes are listed in quant_test_cases.cc).
uint32_t AdversarialBits(DType dt, int cls, uint64_t h, bool origin);

// Fills every source piece: tensors the destination quantizes get a block class per block of
// br x bc (seeded), the others normals (exponents -8..8: exact casts both ways).
void FillAdversarial(const Layout& src, const Layout& dst, const BufferMemory& memory,
                     uint64_t seed, int64_t br, int64_t bc);

}  // namespace refit
