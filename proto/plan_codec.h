// One node's part of a plan on the wire (refit.v1.PlanSlice, plan/plan_slice.h), and the digests
// that tie every node's install to one plan.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "plan/layout.h"
#include "plan/plan.h"
#include "plan/planner.h"
#include "proto/refit.pb.h"

namespace refit {

// SHA-256 of `bytes` (32 raw bytes), and a short hex form of a digest for messages and logs.
std::string Sha256(absl::string_view bytes);
std::string ShortHex(absl::string_view digest);

// What determines a plan: both layouts (their compact protos, serialized deterministically) and
// the planner's options. Equal digests, equal plans: the planner is deterministic.
std::string PlanInputsDigest(const v1::Layout& src, const v1::Layout& dst,
                             const PlanOptions& options);

// `slice` (SliceOfPlan(plan, node, ...)) with the layouts' workers and `node`'s buffers,
// serialized.
std::string SliceToWire(const Plan& slice, int32_t node, const Layout& src, const Layout& dst);

// A slice as a node runs it: the plan's part and the layouts it indexes (every worker; this
// node's buffers at their indices, other buffers placeholders whose worker is -1).
struct DecodedSlice {
  Plan plan;
  Layout src, dst;
};
// Decodes and checks (CheckSlice) a slice for `node`; every size and index is bounded before
// use. Errors say which field is wrong.
absl::StatusOr<DecodedSlice> SliceFromWire(absl::string_view wire, int32_t node);

}  // namespace refit
