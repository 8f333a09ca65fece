// libFuzzer target for the path untrusted layouts take: JSON -> proto -> Layout -> validation ->
// planning -> host execution and verification (bounded). Any crash, sanitizer report, leak or
// hang is a bug: bad input must only ever produce an error. Built by tools/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <string>

#include "plan/planner.h"
#include "plan/validate.h"
#include "plan/verify.h"
#include "proto/layout_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace refit;
  const std::string json(reinterpret_cast<const char*>(data), size);
  auto layout = ParseLayoutJson(json);
  if (!layout.ok()) return 0;
  if (!ValidateLayout(*layout, "source").ok()) return 0;
  // Refit the layout into a copy of itself: every validated layout covers its own needs.
  Layout copy = *layout;
  if (!ValidateLayout(copy, "destination").ok()) __builtin_trap();  // validation must be stable
  PlanOptions options;
  options.max_message_bytes = 256;
  auto plan = MakePlan(*layout, copy, options);
  if (!plan.ok()) return 0;
  auto verified = VerifyOnHost(*plan, *layout, copy, 1, int64_t{1} << 20);
  if (!verified.ok() && verified.status().code() != absl::StatusCode::kResourceExhausted) {
    __builtin_trap();  // a plan of valid layouts must execute exactly
  }
  return 0;
}
