// A daemon's own certificate, checked when it starts: a certificate that gRPC and the data plane
// would accept at load time but that every peer refuses later (no `refitd` name, another node's
// name, signed by another CA, expired, a key of another certificate) would otherwise make every
// round fail after its deadlines with no word of TLS. Read with OpenSSL, as the data plane does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tls_config.h"

namespace refit {

// The names a certificate answers to as refitd reads them (docs/SECURITY.md): its subject CN and
// DNS SANs.
absl::StatusOr<std::vector<std::string>> CertificateNames(const std::string& pem);

// OK when --tls-cert is a certificate of node `node` (refit-node-<node>, and no other node's name)
// that peers accept as a daemon (the DNS name kTlsServerName), valid now, signed by a CA of
// --tls-ca (with the chain's intermediates), and --tls-key is its key. INVALID_ARGUMENT naming
// the flag, the file and what is wrong otherwise.
absl::Status CheckDaemonCertificate(const TlsConfig& tls, int32_t node);

}  // namespace refit
