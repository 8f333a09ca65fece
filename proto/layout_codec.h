// Layout, topology and plan-summary codecs: proto <-> plan/ types, and the JSON files.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "plan/layout.h"
#include "plan/plan.h"
#include "plan/topology.h"
#include "proto/layout.pb.h"

namespace refit {

// The largest Worker.replica_size accepted (an engine of 65,536 ranks).
inline constexpr int32_t kMaxReplicaSize = 1 << 16;

// Decodes a layout. Checks what the proto cannot express (ranks, negative extents, dtype names,
// tensor names a piece refers to); ValidateLayout checks the rest.
absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& proto);
v1::Layout LayoutToProto(const Layout& layout, absl::string_view model = "");

// JSON in the proto3 mapping. Unknown fields are errors: a typo must not silently drop data.
absl::StatusOr<Layout> ParseLayoutJson(absl::string_view json);
std::string LayoutToJson(const Layout& layout, absl::string_view model = "");

absl::StatusOr<Topology> TopologyFromProto(const v1::Topology& proto);
absl::StatusOr<Topology> ParseTopologyJson(absl::string_view json);

v1::PlanSummary SummaryToProto(const PlanStats& stats, bool verified);
std::string SummaryToJson(const PlanStats& stats, bool verified);

// Reads a whole file; NOT_FOUND naming the path when it cannot.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Reads, parses and validates a layout file (`side` names it in errors); errors start with the
// path.
absl::StatusOr<Layout> ReadLayoutFile(const std::string& path, absl::string_view side);

}  // namespace refit
