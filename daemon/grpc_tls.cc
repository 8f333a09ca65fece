#include "daemon/grpc_tls.h"

#include <algorithm>
#include <cmath>

#include <grpcpp/security/tls_credentials_options.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace refit {

GrpcTls::GrpcTls(const TlsConfig& tls) {
  if (!tls.enabled()) return;
  const auto seconds = static_cast<unsigned int>(std::max(1.0, std::ceil(absl::ToDoubleSeconds(tls.reload))));
  provider_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(tls.key, tls.cert, tls.ca, seconds);
}

std::shared_ptr<grpc::ServerCredentials> GrpcTls::ServerCredentials() const {
  if (!enabled()) return grpc::InsecureServerCredentials();
  grpc::experimental::TlsServerCredentialsOptions options(provider_);
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  return grpc::experimental::TlsServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> GrpcTls::ChannelCredentials() const {
  if (!enabled()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider_);
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  options.set_certificate_verifier(std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  return grpc::experimental::TlsCredentials(options);
}

void GrpcTls::AddChannelArgs(grpc::ChannelArguments* args) const {
  if (enabled()) args->SetSslTargetNameOverride(kTlsServerName);
}

std::shared_ptr<grpc::Channel> GrpcTls::Channel(const std::string& target, grpc::ChannelArguments args) const {
  AddChannelArgs(&args);
  return grpc::CreateCustomChannel(target, ChannelCredentials(), args);
}

namespace {

// CN and DNS SANs: gRPC's "peer_dns" holds the DNS SANs alone (its SAN property also lists
// e-mail and URI SANs, which are no identity here).
std::vector<std::string> Names(const grpc::AuthContext& auth) {
  std::vector<std::string> names;
  for (const char* property : {GRPC_X509_CN_PROPERTY_NAME, GRPC_PEER_DNS_PROPERTY_NAME}) {
    for (const grpc::string_ref& v : auth.FindPropertyValues(property)) names.emplace_back(v.data(), v.size());
  }
  return names;
}

}  // namespace

absl::Status CheckServerNode(const GrpcTls& tls, const grpc::ClientContext& context, int32_t node) {
  if (!tls.enabled()) return absl::OkStatus();
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  const std::vector<std::string> names = auth != nullptr ? Names(*auth) : std::vector<std::string>();
  if (NodeOfNames(names) == node) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "the daemon that answered for node ", node, " presented ",
      names.empty() ? std::string("no certificate names") : absl::StrCat("certificate \"", names.front(), "\""),
      ", not ", kNodeIdentityPrefix, node, "'s"));
}

Caller CallerOf(const grpc::ServerContextBase& context) {
  Caller caller;
  caller.peer = context.peer();
  caller.unix_socket = absl::StartsWith(caller.peer, "unix:");
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
