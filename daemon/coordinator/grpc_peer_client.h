// PeerClient over gRPC's callback API (no thread per call): RefitPeer.RunPhase and InstallPlan
// to other daemons, and this node's own part straight to its NodeAgent (on a bounded executor:
// a phase blocks until the node's workers answer). A node declared dead has its calls in flight
// cancelled at once (CancelNode), so a round does not wait out its deadline on a frozen node.
//
// Lock: `mu_` guards the stubs and the calls in flight; never held across an RPC or a callback.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/base/executor.h"
#include "daemon/coordinator/peer_client.h"
#include "daemon/security/grpc_caller.h"
#include "proto/refit.grpc.pb.h"

namespace refit {

struct GrpcPeerClientOptions {
  int32_t self = 0;
  // This coordinator's incarnation, stamped on every call (nodes obey only the incarnation they
  // joined), and its channels' credentials (null: insecure; outlives the client).
  int64_t incarnation = 0;
  const GrpcTls* tls = nullptr;
  absl::Duration peer_timeout = absl::Seconds(5);
  int64_t max_rpc_bytes = 256 << 20;
  int local_threads = 16;  // this node's own phases running at once (one per concurrent round)
  // Where nodes are: a live node's control address (else UNAVAILABLE), and why a node was declared
  // dead (nullopt while alive).
  std::function<absl::StatusOr<std::string>(int32_t node)> address;
  std::function<std::optional<std::string>(int32_t node)> death_reason;
  // This node's own part.
  std::function<absl::Status(const v1::PhaseRequest&, v1::PhaseResponse*)> local_phase;
  std::function<absl::Status(const v1::InstallPlanRequest&)> local_install;
};

class GrpcPeerClient : public PeerClient {
 public:
  explicit GrpcPeerClient(GrpcPeerClientOptions options);
  ~GrpcPeerClient() override;  // cancels what is in flight and waits for it

  void RunPhase(int32_t node, const v1::PhaseRequest& request, absl::Duration timeout,
                v1::PhaseResponse* response, Done done) override;
  void InstallPlan(int32_t node, std::shared_ptr<const v1::InstallPlanRequest> request,
                   absl::Duration timeout, Done done) override;
  // Cancels every call in flight to `node` (it was declared dead).
  void CancelNode(int32_t node);

 private:
  struct Call;
  v1::RefitPeer::Stub* Stub(const std::string& address);
  Call* Begin(int32_t node, absl::Duration deadline, bool wait_for_ready);
  void End(Call* call);

  const GrpcPeerClientOptions options_;
  Executor local_;

  absl::Mutex mu_;
  absl::CondVar idle_;  // no call in flight
  std::map<std::string, std::unique_ptr<v1::RefitPeer::Stub>> stubs_ ABSL_GUARDED_BY(mu_);
  std::multimap<int32_t, Call*> in_flight_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
