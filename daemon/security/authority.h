// Who may call what on refitd (docs/SECURITY.md). Pure decisions over a Caller, so that every
// rule is tested without gRPC; daemon/grpc_tls.h reads the Caller from a call.
//
// With TLS, every TCP caller has a certificate the cluster CA signed, and its names (CN, DNS SANs)
// say what it is (daemon/tls_config.h):
//   RefitControl: viewer calls need a viewer, operator or daemon name; operator calls (Refit,
//     StartRefit) an operator or daemon name (daemons forward what their callers were allowed).
//     Over the unix socket (no certificate): viewer calls only.
//   RefitWorker over TCP (--worker-listen): only --tls-workers names (the unix socket: the
//     handle socket's uid, worker_admission.h).
//   RefitPeer Join, SyncWorkers: only node N's own certificate, for node N.
//   RefitPeer InstallPlan, RunPhase: only the current coordinator's certificate, stamped with the
//     incarnation this node joined (a restarted or impersonated coordinator is refused).
// Without TLS every listener is loopback (or --insecure-listen), and a TCP caller is admitted only
// when the user owning its socket is this daemon's own or root (loopback_owner.h): loopback is
// every local user's. The unix socket's callers are admitted by its file mode and credentials.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/tls_config.h"
#include "daemon/security/loopback_owner.h"

namespace refit {

struct Caller {
  bool unix_socket = false;        // came over the worker socket
  std::optional<uint32_t> uid;     // the worker socket's caller's user, as the kernel says
  bool authenticated = false;      // a TLS client certificate, verified against the CA
  std::vector<std::string> names;  // its CN and DNS SANs
  std::string peer;                // gRPC's peer string, for errors and logs
};

// The node whose daemon certificate `caller` presents (a name "refit-node-<N>").
std::optional<int32_t> NodeOf(const Caller& caller);

enum class Access { kView, kOperate };

// What the coordinator is, as this node learned it when it last joined.
struct KnownCoordinator {
  int32_t node = -1;  // -1: not joined yet
  int64_t incarnation = 0;
};

class Authority {
 public:
  // `local_users`: without TLS, whose loopback connections are admitted (null: anyone's).
  explicit Authority(TlsConfig tls, std::shared_ptr<const LoopbackUsers> local_users = nullptr)
      : tls_(std::move(tls)), local_users_(std::move(local_users)) {}

  bool enforcing() const { return tls_.enabled(); }
  // RefitControl's `method`.
  absl::Status CheckControl(const Caller& caller, Access access, absl::string_view method) const;
  // RefitWorker.Register: over the unix socket anyone (the handle socket's uid admits); over
  // TCP (--worker-listen) only --tls-workers names.
  absl::Status CheckWorker(const Caller& caller) const;
  // Join and SyncWorkers claiming to be node `node`.
  absl::Status CheckNode(const Caller& caller, int32_t node, absl::string_view method) const;
  // InstallPlan and RunPhase, stamped with `incarnation`.
  absl::Status CheckCoordinator(const Caller& caller, const KnownCoordinator& coordinator,
                                int64_t incarnation, absl::string_view method) const;

 private:
  bool Named(const Caller& caller, const std::vector<std::string>& names) const;
  // Without TLS: the user behind a TCP caller.
  absl::Status CheckLocalUser(const Caller& caller, absl::string_view method) const;
  const TlsConfig tls_;
  const std::shared_ptr<const LoopbackUsers> local_users_;
};

}  // namespace refit
