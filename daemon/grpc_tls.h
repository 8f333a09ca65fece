// gRPC's own TLS for refitd's channels and listeners, from the files of a TlsConfig, and who a
// caller is under it (daemon/authority.h decides what that caller may do).
//
// Certificates come from gRPC's FileWatcherCertificateProvider: it reads the files again every
// `reload`, so a rotated Secret is used for new handshakes without a restart. Every listener asks
// for and verifies a client certificate against the CA; every channel verifies the server's chain
// and that it answers to kTlsServerName ("refitd": daemons are reached by IP address, so the name
// checked is the role, not the host; which daemon it is, the authority checks).
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/tls_certificate_provider.h>

#include "daemon/authority.h"
#include "daemon/tls_config.h"

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
  std::shared_ptr<grpc::Channel> Channel(const std::string& target, grpc::ChannelArguments args) const;

 private:
  std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> provider_;
};

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
