// The one pair of conversions between absl::Status and grpc::Status (their codes coincide).
// Payloads (a Culprit: daemon/base/culprit.h) travel as the details of a
// google.rpc.Status-compatible RpcStatus in gRPC's error details (the grpc-status-details-bin
// trailer).
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>

#include "absl/status/status.h"

namespace refit {

grpc::Status ToGrpc(const absl::Status& s);
absl::Status FromGrpc(const grpc::Status& s);

// Told the code of every failure ToGrpc converts, on the converting thread (process-wide: every
// service's status passes here; daemon/ops/metrics.h counts them), with no lock held. Returns an id
// for Remove; a call that began before Remove may still be running after it.
int AddRpcErrorObserver(std::function<void(absl::StatusCode)> observer);
void RemoveRpcErrorObserver(int id);

}  // namespace refit
