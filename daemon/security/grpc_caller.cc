#include "daemon/security/grpc_caller.h"

#include <grpcpp/security/tls_credentials_options.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/security/unix_callers.h"

namespace refit {

namespace {

// CN and DNS SANs: gRPC's "peer_dns" holds the DNS SANs alone (its SAN property also lists
// e-mail and URI SANs, which are no identity here).
std::vector<std::string> Names(const grpc::AuthContext& auth) {
  std::vector<std::string> names;
  for (const char* property : {GRPC_X509_CN_PROPERTY_NAME, GRPC_PEER_DNS_PROPERTY_NAME}) {
    for (const grpc::string_ref& v : auth.FindPropertyValues(property))
      names.emplace_back(v.data(), v.size());
  }
  return names;
}

}  // namespace

absl::Status CheckServerNode(const GrpcTls& tls, const grpc::ClientContext& context, int32_t node) {
  if (!tls.enabled()) return absl::OkStatus();
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  const std::vector<std::string> names =
      auth != nullptr ? Names(*auth) : std::vector<std::string>();
  if (NodeOfNames(names) == node) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("the daemon that answered for node ", node, " presented ",
                   names.empty() ? std::string("no certificate names")
                                 : absl::StrCat("certificate \"", names.front(), "\""),
                   ", not ", kNodeIdentityPrefix, node, "'s"));
}

Caller CallerOf(const grpc::ServerContextBase& context) {
  Caller caller;
  caller.peer = context.peer();
  if (const std::optional<UnixCredentials> unix = UnixCallerOf(caller.peer)) {
    caller.unix_socket = true;
    caller.uid = unix->uid;
  } else {
    caller.unix_socket = absl::StartsWith(caller.peer, "unix:");
  }
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    caller.authenticated = true;
    caller.names = Names(*auth);
  }
  return caller;
}

int64_t CoordinatorIncarnationOf(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kCoordinatorIncarnationKey);
  if (it == metadata.end()) return 0;
  int64_t v = 0;
  return absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &v) ? v : 0;
}

}  // namespace refit
