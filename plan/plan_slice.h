// One node's part of a plan: what its data plane runs, and nothing a node elsewhere runs.
//
// The coordinator plans a group once and sends every node its slice (docs/PLANNING.md,
// "Dividing the plan"). A slice keeps the plan's numbering (GPUs, messages, buffers), so that
// frames and network steps name the same message on both ends, but carries descriptors only
// where this node needs them:
//   - every descriptor of a message this node sends or receives;
//   - of a network message between two other nodes, only its descriptors of at least
//     `keep_remote_min_bytes` wire bytes: a data plane that sends large contiguous descriptors
//     without staging (the cuda backend's zero-copy) cuts every node's network steps by them, and
//     every node must cut them alike. Smaller descriptors only add up to the message's bytes,
//     which every header keeps.
// Every message header is kept (40 bytes each: tens of thousands for a frontier model), as are
// the plan's GPUs, scratch buffers and statistics.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "plan/layout.h"
#include "plan/plan.h"

namespace refit {

// `keep_remote_min_bytes` <= 0 keeps no descriptor of other nodes' messages.
Plan SliceOfPlan(const Plan& plan, int32_t node, int64_t keep_remote_min_bytes);

// Whether a message is run (sent or received) by `node`.
bool TouchesNode(const Plan& plan, const Message& m, int32_t node);

// Checks a slice received from elsewhere before a data plane runs it on `node`: every index in
// range (GPUs, messages, buffers, scratch), descriptors grouped by message as the headers say,
// and every descriptor of this node's messages inside the buffers it reads and writes here
// (`src` and `dst` describe them: buffers of other nodes may be placeholders). Errors name the
// message or descriptor and what is out of range.
absl::Status CheckSlice(const Plan& slice, int32_t node, const Layout& src, const Layout& dst);

}  // namespace refit
