// gRPC's own TLS for refit's channels and listeners, from the files of a TlsConfig: what refitd
// and refitctl both dial and serve with.
//
// Certificates come from gRPC's FileWatcherCertificateProvider: it reads the files again every
// `reload`, so a rotated Secret is used for new handshakes without a restart. Every listener asks
// for and verifies a client certificate against the CA; every channel verifies the server's chain
// and that it answers to kTlsServerName ("refitd": daemons are reached by IP address, so the name
// checked is the role, not the host; which daemon it is, the daemon's authority checks).
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/tls_certificate_provider.h>

#include <memory>
#include <string>

#include "common/tls_config.h"

namespace refit {

class GrpcTls {
 public:
  // Without TLS (tls.enabled() false): insecure credentials, as on loopback.
  explicit GrpcTls(const TlsConfig& tls);

  bool enabled() const { return provider_ != nullptr; }
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() const;
  // Adds what a channel needs besides its credentials (the server name checked).
  void AddChannelArgs(grpc::ChannelArguments* args) const;
  // A channel to `target` with these credentials and `args` (AddChannelArgs applied).
  std::shared_ptr<grpc::Channel> Channel(const std::string& target,
                                         grpc::ChannelArguments args) const;

 private:
  std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> provider_;
};

}  // namespace refit
