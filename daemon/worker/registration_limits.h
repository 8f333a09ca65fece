// What a registration may hold, checked before anything of it is decoded, validated or mapped
// (docs/SECURITY.md, bounded input): a worker is a local process, but not necessarily ours, and one
// registration of 10^6 pieces used to cost the node 2 GB and the coordinator 1.6 GB.
//
// Limits per registration (flags, daemon/config.cc; defaults far above any real model's rank:
// a DeepSeek-V3 or Kimi-K2 engine rank holds under 100k pieces): pieces, buffers, tensors.
// Every name (group, worker, replica, buffer, tensor, a piece's tensor) is 1 to 256 bytes with no
// control character (NUL included) and no invalid UTF-8. A registration lists its pieces: the
// compact form of layouts (Worker.buffers_like, Piece.repeat) is for plans between daemons.
// Errors: INVALID_ARGUMENT naming the field, or RESOURCE_EXHAUSTED naming the limit's flag.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "daemon/worker/registration_decoder.h"
#include "proto/refit.pb.h"

namespace refit {

struct RegistrationLimits {
  int64_t max_pieces = int64_t{1} << 20;   // --max-registration-pieces
  int64_t max_buffers = int64_t{1} << 18;  // --max-registration-buffers
  int64_t max_tensors = int64_t{1} << 20;  // --max-registration-tensors
  int64_t max_bytes = int64_t{64} << 20;   // --max-registration-bytes: the request as encoded
};

// What one model group may hold at the coordinator, over all its workers on every node
// (Membership): a node that registers more has the worker refused, RESOURCE_EXHAUSTED naming the
// flag. Defaults: well above a 256-engine-rank Kimi-K2 (its ranks hold under 100k pieces each).
struct GroupLimits {
  int64_t max_workers = int64_t{1} << 16;  // --max-group-workers
  int64_t max_buffers = int64_t{1} << 24;  // --max-group-buffers
  int64_t max_tensors = int64_t{1}
                        << 26;  // --max-group-tensors (as the workers declare them, summed)
  int64_t max_pieces = int64_t{1} << 27;  // --max-group-pieces
  int64_t max_bytes = int64_t{8} << 30;   // --max-group-bytes: their registrations as encoded
};
inline constexpr size_t kMaxNameBytes = 256;

// The RESOURCE_EXHAUSTED of a registration holding `n` `what` (e.g. "pieces") past `limit`, naming
// the daemon flag that sets it (e.g. "max-registration-pieces").
absl::Status OverRegistrationLimit(absl::string_view what, int64_t n, int64_t limit,
                                   absl::string_view flag);
// OK when `name` may name a `what` (e.g. "buffer"): 1..kMaxNameBytes bytes of printable UTF-8.
absl::Status CheckName(absl::string_view what, absl::string_view name);
// The limits on counts: a request's encoded bytes, its tensors, its worker's buffers and pieces
// (RESOURCE_EXHAUSTED naming the flag).
absl::Status CheckCounts(int64_t bytes, int64_t tensors, int64_t buffers, int64_t pieces,
                         const RegistrationLimits& limits);
absl::Status CheckRegistration(const v1::RegisterWorkerRequest& request,
                               const RegistrationLimits& limits);
// The same for a registration split by SplitRegistration::Of (what a node checks): its pieces
// counted in the encoding before any is decoded, then decoded one at a time.
absl::Status CheckRegistration(const SplitRegistration& registration,
                               const RegistrationLimits& limits);

}  // namespace refit
