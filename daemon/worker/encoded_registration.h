// A RegisterWorkerRequest as it came off the wire, checked and only then decoded: gRPC would
// decode all of it before any limit is looked at, and a registration is input from a local
// process that may not be ours. 30 MB of empty tensor entries decode into 1.5 GB; a worker spelled
// out as messages into 10 times its size.
//
// Before anything is decoded: the request's size (--max-registration-bytes); how many tensors,
// memory entries and VMM ranges it lists, and its worker's buffers and pieces (their flags); each
// piece's size (pieces are decoded one at a time); and the memory of what is decoded as messages
// (everything but the worker's pieces, proto/decoded_size.h): at most kMaxDecodedPerEncoded times
// the request's size, plus kDecodedSlack. A worker spelled out (`worker`) is cut out as its
// encoding and never decoded as messages here (registration_decoder.h reads its pieces).
//
// Errors: INVALID_ARGUMENT starting "register: " for what is not a RegisterWorkerRequest, both
// worker fields, a piece over kMaxPieceBytes or too much decoded memory (naming the field that
// takes most); RESOURCE_EXHAUSTED naming the flag for counts and size.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/worker/registration_limits.h"
#include "proto/refit.pb.h"

namespace refit {

inline constexpr int64_t kMaxDecodedPerEncoded = 8;
inline constexpr int64_t kDecodedSlack = int64_t{1} << 20;
inline constexpr int64_t kMaxPieceBytes = 4096;  // a real piece: a name and two small boxes

// The request, its worker as `worker_encoded` whichever way it came. `encoded` is consumed: freed
// before the request is decoded where it is not needed any more.
absl::StatusOr<v1::RegisterWorkerRequest> DecodeRegistrationRequest(
    std::string encoded, const RegistrationLimits& limits);

}  // namespace refit
