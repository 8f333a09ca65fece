// The one pair of conversions between absl::Status and grpc::Status (their codes coincide).
// Payloads (a Culprit: daemon/culprit.h) travel as the details of a google.rpc.Status-compatible
// RpcStatus in gRPC's error details (the grpc-status-details-bin trailer).
#pragma once

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"

namespace refit {

grpc::Status ToGrpc(const absl::Status& s);
absl::Status FromGrpc(const grpc::Status& s);

}  // namespace refit
