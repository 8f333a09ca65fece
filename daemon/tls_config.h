// Where a daemon's TLS material lives, and who is who under it (docs/SECURITY.md).
//
// One cluster CA signs every certificate. A certificate's identity is its subject common name
// and its DNS subject alternative names:
//   refit-node-<N>   the daemon of node N (its --node): peers, the coordinator, data connections
//   --tls-operators  names allowed to steer (Refit, StartRefit) and to look; default refit-operator
//   --tls-viewers    names allowed to look (Status, WatchRounds, GetPlan, ListWorkers, ListRounds);
//                    default refit-viewer
// Every daemon certificate also carries the DNS name `refitd` (kTlsServerName): clients check
// the server's certificate against that name, since daemons are reached by IP address.
// Files are read again when they change (every `reload`): a rotated Secret takes effect without
// a restart.
#pragma once

#include <string>
#include <vector>

#include "absl/time/time.h"

namespace refit {

inline constexpr char kTlsServerName[] = "refitd";
inline constexpr char kNodeIdentityPrefix[] = "refit-node-";

struct TlsConfig {
  std::string cert;  // PEM certificate chain (--tls-cert)
  std::string key;   // PEM private key (--tls-key)
  std::string ca;    // PEM CA bundle that signs the cluster's certificates (--tls-ca)
  absl::Duration reload = absl::Seconds(10);  // how often the files are checked (--tls-reload-interval)
  std::vector<std::string> operators = {"refit-operator"};  // --tls-operators a,b
  std::vector<std::string> viewers = {"refit-viewer"};      // --tls-viewers a,b

  bool enabled() const { return !cert.empty(); }
};

}  // namespace refit
