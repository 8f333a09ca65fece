// Who is at the other end of a gRPC call under refit's TLS (common/grpc_tls.h): a caller of this
// daemon's services, the node that answered its own call (daemon/security/authority.h decides what
// each may do).
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "common/grpc_tls.h"
#include "daemon/security/authority.h"

namespace refit {

// After a call on a channel of these credentials: OK when TLS is off, or the server's verified
// certificate is node `node`'s (refit-node-<node>, and no other node); PERMISSION_DENIED naming
// what answered otherwise (an address that now belongs to another daemon, or an impostor).
absl::Status CheckServerNode(const GrpcTls& tls, const grpc::ClientContext& context, int32_t node);

// Who called: the transport (unix socket or TCP) and, over TLS, the verified certificate's names.
Caller CallerOf(const grpc::ServerContextBase& context);
// The metadata key a coordinator stamps its incarnation under on every phase and install call.
inline constexpr char kCoordinatorIncarnationKey[] = "refit-coordinator-incarnation";
// That incarnation, from a call's metadata; 0 when absent or malformed.
int64_t CoordinatorIncarnationOf(const grpc::ServerContextBase& context);

}  // namespace refit
