#include "common/grpc_tls.h"

#include <grpcpp/security/tls_credentials_options.h>

#include <algorithm>
#include <cmath>

namespace refit {

GrpcTls::GrpcTls(const TlsConfig& tls) {
  if (!tls.enabled()) return;
  const auto seconds =
      static_cast<unsigned int>(std::max(1.0, std::ceil(absl::ToDoubleSeconds(tls.reload))));
  provider_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      tls.key, tls.cert, tls.ca, seconds);
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
  options.set_certificate_verifier(
      std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  return grpc::experimental::TlsCredentials(options);
}

void GrpcTls::AddChannelArgs(grpc::ChannelArguments* args) const {
  if (enabled()) args->SetSslTargetNameOverride(kTlsServerName);
}

std::shared_ptr<grpc::Channel> GrpcTls::Channel(const std::string& target,
                                                grpc::ChannelArguments args) const {
  AddChannelArgs(&args);
  return grpc::CreateCustomChannel(target, ChannelCredentials(), args);
}

}  // namespace refit
