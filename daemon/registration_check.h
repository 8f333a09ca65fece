// The checks a registration passes before any backend touches its memory, apart from the
// registry so that they can be called without a backend (tests/fuzz/registration_fuzzer.cc runs
// exactly these). WorkerRegistry::Register calls them in this order, after CheckRegistration's
// limits and names (registration_limits.h) and, between the two, resolving the worker's GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "plan/layout.h"
#include "proto/refit.pb.h"

namespace refit {

// Group, role, the worker's name, one memory handle per buffer. INVALID_ARGUMENT naming the field.
absl::Status CheckRegistrationFields(const v1::RegisterWorkerRequest& request);

// What the registry keeps of a registration's checks.
struct CheckedLayout {
  Layout layout;                      // the worker's own part: every tensor, it, its buffers
  std::vector<int64_t> buffer_bytes;  // per buffer of request.worker(), in order
};

// The worker's part of the layout, decoded on node `node` and validated as its role's side, then
// what its memory handles refer to (memory_refs.h) against `fds` descriptors handed over.
// INVALID_ARGUMENT starting "register: ".
absl::StatusOr<CheckedLayout> CheckRegistrationLayout(const v1::RegisterWorkerRequest& request, int32_t node,
                                                      size_t fds);

// What a node keeps of a registration it took (issue 15.5): returns `request` serialized without
// its memory handles (what the coordinator is sent), and clears its buffers' pieces, which as
// messages cost 12x their size on the wire; the rest of `request` stays as it was.
std::string TakePieces(v1::RegisterWorkerRequest* request);

}  // namespace refit
