// The checks a registration passes before any backend touches its memory, apart from the
// registry so that they can be called without a backend (tests/fuzz/registration_fuzzer.cc runs
// exactly these). WorkerRegistry::Register calls them in this order, after CheckRegistration's
// limits and names (registration_limits.h) and, between the two, resolving the worker's GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/worker/registration_decoder.h"
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

// The worker's part of the layout, decoded on node `node` (on GPU `gpu`: the worker's own
// worker.gpu when not given) and validated as its role's side, then what its memory handles refer
// to (memory_refs.h) against `fds` descriptors handed over. INVALID_ARGUMENT starting "register: ".
// Its pieces are decoded from the worker's encoding one at a time (registration_decoder.h): as
// messages they cost 12x their size on the wire.
absl::StatusOr<CheckedLayout> CheckRegistrationLayout(const SplitRegistration& registration,
                                                      int32_t node, size_t fds,
                                                      std::optional<int32_t> gpu = std::nullopt);
// The same for a request as it came (split here).
absl::StatusOr<CheckedLayout> CheckRegistrationLayout(const v1::RegisterWorkerRequest& request,
                                                      int32_t node, size_t fds,
                                                      std::optional<int32_t> gpu = std::nullopt);

// What a node keeps of a registration it took, made from the worker's encoding, never from a copy
// as messages (a piece costs about 500 bytes as a message, 47 on the wire).
struct KeptRegistration {
  // The registration without its buffers' pieces, everything else as it came (memory handles
  // included: the backends and sessions read them), worker.node and worker.gpu set,
  // worker_encoded empty.
  v1::RegisterWorkerRequest header;
  // The whole registration encoded without its memory handles (memory, fd_token, vmm_ranges), the
  // worker as field `worker` whichever field it came in: what the coordinator is sent.
  // worker.node and worker.gpu are set by a second occurrence of field `worker` at the end, which
  // a parser merges into the first.
  std::string wire;
};
absl::StatusOr<KeptRegistration> KeepRegistration(const SplitRegistration& registration,
                                                  int32_t node, int32_t gpu);

// A registration's tensors by name (views into the request, which must outlive it).
using TensorsByName = absl::flat_hash_map<absl::string_view, const v1::TensorSpec*>;
TensorsByName IndexTensors(const v1::RegisterWorkerRequest& request);

// Whether `request` (its tensors indexed in `mine`) declares every tensor that `registered`, a
// worker of the same group and side registered earlier as `registered_id`, also declares exactly
// as it does: shape, dtype and quantization; the planner plans a group only when they agree.
// FAILED_PRECONDITION naming the tensor, both declarations and the earlier worker.
absl::Status CheckSameTensors(const v1::RegisterWorkerRequest& request, const TensorsByName& mine,
                              const v1::RegisterWorkerRequest& registered,
                              absl::string_view registered_id);

}  // namespace refit
