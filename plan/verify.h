// Byte-exact verification of a plan on host memory, and the fill / poison / check primitives the
// integration tests of every backend share.
//
// Sources hold a function of (tensor name, global element index); destinations are poisoned
// first; afterwards every element a destination piece covers must hold exactly the source's
// value (converted when the two sides' dtypes differ) and every other byte must still be poison.
// So an unwritten, misplaced, doubled or stray byte cannot hide.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "plan/host_copy.h"
#include "plan/layout.h"
#include "plan/plan.h"

namespace refit {

inline constexpr std::byte kPoison{0xA5};

// How a tensor's values are generated: arbitrary bytes when both sides share the dtype (every
// bit pattern is checked); small integers when a cast happens on the way (exact in bf16, fp16 and
// fp32, so the cast is checked exactly too).
// Tensors the destination quantizes (LogicalTensor::quant) get small integers times a power of
// two that differs from block to block, and some blocks of zeros: so every block has its own
// scale, a misplaced code or scale shows, and the amax-0 rule runs. The expected codes and scales
// come from the CPU reference (plan/fp8_block.h) run on the whole tensor.
struct QuantFill {
  int64_t cols = 0;  // 0: not quantized
  int64_t block_rows = 0;
  int64_t block_cols = 0;
};
struct FillSpec {
  uint64_t seed = 1;
  // Tensors, by index into the *source* layout, whose destination dtype differs.
  std::vector<bool> numeric;
  std::vector<QuantFill> quant;  // by source tensor; empty when none is quantized
};
FillSpec MakeFillSpec(const Layout& source, const Layout& destination, uint64_t seed);

// Writes the value of element `linear` of tensor `name` as `dtype` into `out`.
void ExpectedElement(uint64_t name_hash, int64_t linear, DType dtype, bool numeric, uint64_t seed,
                     std::byte* out);
uint64_t HashName(absl::string_view name);
// Element `linear` of a quantized tensor's source, as fp32 (exact in bf16, fp16 and fp32).
float QuantSourceValue(uint64_t name_hash, int64_t linear, const QuantFill& fill, uint64_t seed);

// Fills every source piece's elements with their values.
void FillSources(const Layout& source, const FillSpec& spec, const BufferMemory& memory);
// Sets every destination byte to kPoison.
void PoisonDestinations(const BufferMemory& memory);
// Checks every destination byte as described above. The error names the tensor, the index, the
// worker and the buffer of the first wrong element, and how many are wrong.
struct CheckReport {
  int64_t elements_checked = 0;
  int64_t padding_bytes_checked = 0;
};
absl::StatusOr<CheckReport> CheckDestinations(const Layout& source, const Layout& destination,
                                              const FillSpec& spec, const BufferMemory& memory);

struct VerifyReport {
  int64_t bytes_allocated = 0;
  int64_t elements_checked = 0;
  int64_t padding_bytes_checked = 0;
  double seconds = 0;
};
// Allocates every buffer of both layouts and the plan's scratch on the host (refusing beyond
// `max_bytes`), fills, poisons, executes the plan with ExecuteOnHost and checks.
absl::StatusOr<VerifyReport> VerifyOnHost(const Plan& plan, const Layout& source,
                                          const Layout& destination, uint64_t seed,
                                          int64_t max_bytes);

}  // namespace refit
