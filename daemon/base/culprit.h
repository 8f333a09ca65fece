// Whom a failure is blamed on, carried by the failure itself: a v1::Culprit as a payload of the
// absl::Status (and, through grpc_status.h, of the gRPC status on the wire). The first component
// that knows the culprit names it (the worker registry a worker, the peer client a node, the
// round driver the coordinator); wrappers keep it.
#pragma once

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "proto/refit.pb.h"

namespace refit {

inline constexpr char kCulpritUrl[] = "type.googleapis.com/refit.v1.Culprit";

// `status` blaming `culprit` (a culprit it already names is replaced). OK stays OK.
absl::Status WithCulprit(absl::Status status, const v1::Culprit& culprit);
// `status` blaming `culprit` unless it already names one.
absl::Status WithCulpritIfNone(absl::Status status, const v1::Culprit& culprit);
std::optional<v1::Culprit> CulpritOf(const absl::Status& status);

v1::Culprit WorkerCulprit(int32_t node, const std::string& worker_id, const std::string& phase);
v1::Culprit NodeCulprit(int32_t node, const std::string& address, const std::string& phase);
v1::Culprit CoordinatorCulprit(int32_t node, const std::string& phase);

// A new message and code for `status`, its payloads (the culprit) kept.
absl::Status Rewrap(const absl::Status& status, absl::StatusCode code, const std::string& message);

}  // namespace refit
