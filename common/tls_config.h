// Where a daemon's TLS material lives, and who is who under it (docs/SECURITY.md).
//
// One cluster CA signs every certificate. A certificate's identity is its subject common name
// and its DNS subject alternative names:
//   refit-node-<N>   the daemon of node N (its --node): peers, the coordinator, data connections
//   --tls-operators  names allowed to steer (Refit, StartRefit) and to look; default refit-operator
//   --tls-viewers    names allowed to look (Status, WatchRounds, GetPlan, ListWorkers, ListRounds);
//                    default refit-viewer
//   --tls-workers    names allowed to register workers over --worker-listen; default refit-worker
// Every daemon certificate also carries the DNS name `refitd` (kTlsServerName): clients check
// the server's certificate against that name, since daemons are reached by IP address.
// Files are read again when they change (every `reload`): a rotated Secret takes effect without
// a restart.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace refit {

inline constexpr char kTlsServerName[] = "refitd";
inline constexpr char kNodeIdentityPrefix[] = "refit-node-";

// "refit-node-<N>": the node N (digits only, at most 9, no leading zero); false for any other name.
inline bool ParseNodeIdentity(absl::string_view identity, int32_t* node) {
  if (identity.substr(0, sizeof(kNodeIdentityPrefix) - 1) != kNodeIdentityPrefix) return false;
  identity.remove_prefix(sizeof(kNodeIdentityPrefix) - 1);
  if (identity.empty() || identity.size() > 9) return false;  // fits an int32
  if (identity.size() > 1 && identity[0] == '0')
    return false;  // one spelling per node: "refit-node-00" is none
  for (char c : identity) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return absl::SimpleAtoi(identity, node);
}

// The one node a certificate's names (CN, DNS SANs) name; -1 when they name none, or more than
// one (such a certificate is no node's: which would it speak for?).
inline int32_t NodeOfNames(const std::vector<std::string>& names) {
  int32_t found = -1;
  for (const std::string& name : names) {
    int32_t node = -1;
    if (!ParseNodeIdentity(name, &node)) continue;
    if (found >= 0 && node != found) return -1;
    found = node;
  }
  return found;
}

struct TlsConfig {
  std::string cert;  // PEM certificate chain (--tls-cert)
  std::string key;   // PEM private key (--tls-key)
  std::string ca;    // PEM CA bundle that signs the cluster's certificates (--tls-ca)
  absl::Duration reload =
      absl::Seconds(10);  // how often the files are checked (--tls-reload-interval)
  std::vector<std::string> operators = {"refit-operator"};  // --tls-operators a,b
  std::vector<std::string> viewers = {"refit-viewer"};      // --tls-viewers a,b
  // Names that may register workers over --worker-listen (TCP); the unix socket needs none.
  std::vector<std::string> workers = {"refit-worker"};  // --tls-workers a,b

  bool enabled() const { return !cert.empty(); }
};

}  // namespace refit
