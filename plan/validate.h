// Phase 1 of planning: is a layout, and a pair of layouts, well formed?
//
// Errors are INVALID_ARGUMENT and name the side, the tensor, the worker, the buffer and the box,
// so that a person can find the offending entry in a file of a million pieces. Coverage (does
// every destination element have a source?) is checked while matching, in the planner, where the
// index that answers it exists anyway.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "plan/layout.h"

namespace refit {

// Checks names (non-empty, unique), indices, ranks, bounds, dtypes, that each piece's buffer box
// is reachable from its tensor box by strides, and that no two pieces of one buffer overlap.
// Builds the layout's name indices. `side` ("source", "destination") prefixes every message.
absl::Status ValidateLayout(Layout& layout, absl::string_view side);

// Checks that every tensor the destination declares exists in the source with the same shape and
// a dtype the data plane converts from. Both layouts must have been validated.
absl::Status ValidatePair(const Layout& source, const Layout& destination);

// "tensor \"x\" (worker \"w\" buffer \"b\" box [0:4, 0:8])": how errors name a piece.
std::string DescribePiece(const Layout& layout, int32_t piece);

}  // namespace refit
