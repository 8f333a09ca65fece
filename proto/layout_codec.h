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

// The most pieces a layout may expand to (runs and buffers_like multiply what the wire carries;
// DeepSeek-V3 on 128 engine GPUs has 5.7 M) and the longest run one Piece may stand for.
inline constexpr int64_t kMaxLayoutPieces = int64_t{1} << 26;
inline constexpr int64_t kMaxPieceRepeat = int64_t{1} << 20;
// The largest group of pieces one run repeats (Piece.run_pieces) that CompactLayoutToProto looks
// for: a fused buffer's few tensors per expert.
inline constexpr size_t kMaxRunPieces = 8;

// Decodes a layout, expanding the compact form (Worker.buffers_like, Piece.tensor_index and runs:
// proto/layout.proto), so that every consumer sees the whole Layout. Checks what the proto cannot
// express (ranks, negative extents, dtype names, tensor names and indices a piece refers to,
// references to earlier workers, runs); ValidateLayout checks the rest. `max_pieces`: the most
// pieces it may expand to, checked before a run or buffers_like is expanded (a caller with a
// tighter budget than kMaxLayoutPieces passes it).
absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& proto,
                                       int64_t max_pieces = kMaxLayoutPieces);
// Every worker, buffer and piece spelled out (tensors by name, boxes explicit).
v1::Layout LayoutToProto(const Layout& layout, absl::string_view model = "");

// Which redundancies CompactLayoutToProto removes (all by default; the benchmark measures each).
struct CompactOptions {
  bool buffers_like = true;      // a worker whose buffers equal an earlier one's names it
  bool tensor_index = true;      // pieces name tensors by index
  bool omit_whole_boxes = true;  // a box that is the whole tensor or buffer is left out
  bool runs = true;              // consecutive pieces moving by equal steps become one run
};
// The compact form of a layout, as the coordinator sends it (InstallPlanRequest). LayoutFromProto
// of it yields exactly LayoutFromProto(LayoutToProto(layout)): the same tensors, workers,
// buffers, pieces, in the same order, with the same interned boxes; so every node plans the same
// plan from it.
v1::Layout CompactLayoutToProto(const Layout& layout, absl::string_view model = "",
                                const CompactOptions& options = {});

// JSON in the proto3 mapping. Unknown fields are errors: a typo must not silently drop data.
absl::StatusOr<Layout> ParseLayoutJson(absl::string_view json,
                                       int64_t max_pieces = kMaxLayoutPieces);
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
