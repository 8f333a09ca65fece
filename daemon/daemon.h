// refitd: one per node. The Daemon only composes and wires the components that do the work:
//
//   WorkerRegistry   this node's workers: registration (validated, memory mapped), lookup, drop
//   WorkerSession    a worker's event stream (PREPARE, COMMIT, ABORT; its answers)
//   NodeAgent        this node's part of a round: installed plans, phases, a lost worker's cancel
//   CoordinatorLink  (not the coordinator) join, heartbeat, ordered syncs, forwarded operator calls
//   Membership       (coordinator) nodes, incarnations, liveness, group epochs
//   GroupPlanner     (coordinator) one plan per group and membership epoch, outside any lock
//   RoundDriver      (coordinator) begin, phases, abort, finish, through a PeerClient
//   RoundLog         (coordinator) what WatchRounds streams
//   services.h       the gRPC services, thin
//
// A round:
//   prepare  every worker of the group confirms: trainers hold version v and leave it untouched,
//            inference workers stopped reading their weights
//   transfer every daemon runs its messages (stage by stage)
//   commit   inference workers learn v and resume; or abort, with the reason and the culprit
//
// Every wait has a deadline. Non-coordinator daemons forward operator calls to the coordinator.
// No component holds its lock across a call into another, the backend or an RPC.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_tls.h"
#include "daemon/config.h"
#include "daemon/dataplane/backend.h"
#include "daemon/security/authority.h"
#include "daemon/security/loopback_owner.h"
#include "daemon/security/unix_callers.h"
#include "daemon/services.h"

namespace refit {

class CoordinatorLink;
class WatchHub;
class GroupPlanner;
class GrpcPeerClient;
class HandleInbox;
class Membership;
class Metrics;
struct LocalWorker;
class NodeAgent;
class PauseDetector;
class RoundDriver;
class RoundLog;
class StateStore;
class WorkerRegistry;

class Daemon {
 public:
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonConfig& config);
  ~Daemon();

  void Wait();  // until Shutdown()
  // Drains, then stops: NOT_SERVING to health checks, no new round, running ones given
  // --drain-timeout, what is left aborted (workers told). Safe from a signal-handling thread; a
  // second call waits for the first to finish.
  void Shutdown();
  const std::string& address() const { return address_; }
  const DaemonConfig& config() const { return config_; }

 private:
  explicit Daemon(const DaemonConfig& config);
  // Start's steps, in their order.
  void MakeSecurity();  // TLS credentials, the loopback users without TLS, the authority
  void LogSecurityPosture() const;
  absl::Status StartBackend();  // the data plane --backend names (backend_factory.h)
  absl::Status StartMetrics();  // --metrics-listen, and the backend metered
  absl::Status StartHandleInbox();
  void MakeNodeComponents();  // the registry, the pause detector, the node agent
  absl::Status StartCoordinatorOrFollower();
  absl::Status OpenStateStore();      // the coordinator's
  void MakeMembershipAndPlanner();    // "", with the round log
  void MakeRoundDriver();             // "", with the peer client
  void MakeCoordinatorLink();         // not on the coordinator
  absl::Status Serve();               // the three listeners
  absl::Status GrantWorkerSockets();  // the unix sockets' access (--worker-uids)
  void LogServing() const;
  absl::Status StartLoopsAndJoin();  // the ticker and the monitor; joins (not on the coordinator)
  // Serve's steps.
  void FillServiceParts();
  absl::StatusOr<int> StartControlServer();  // --listen; its bound port
  absl::Status StartWorkerServer();          // the unix socket, --worker-listen
  absl::Status StartHealthServer();          // --health-listen
  void SetServing(bool serving);             // the health service's status of every service
  void SetAlive();                           // "" SERVING: the process runs
  std::vector<grpc::Server*> Servers() const;
  absl::Status Register(const v1::RegisterWorkerRequest& request, WorkerTransport transport,
                        v1::RegisterWorkerResponse* response);
  void DropWorker(const std::string& id, const std::string& reason);
  // Tells the coordinator this node's workers changed, one worker at a time (on the coordinator:
  // its membership; elsewhere a change to the node's list, or the whole list when the coordinator
  // may hold another). `registration`: the worker's session key (Membership::AddLocal says why).
  absl::Status SyncAdded(const LocalWorker& worker);
  void SyncRemoved(const std::string& id, const std::string& registration);
  // Every 100 ms: on the coordinator the failure detector (not while this daemon was itself
  // paused), elsewhere the coordinator's leases on this node's rounds.
  void MonitorLoop();
  // Every 100 ms, and nothing else: ticks the pause detector. A thread of its own, so that a slow
  // step of the monitor's (a lock held elsewhere, a dropped worker's bookkeeping) is not taken
  // for a pause of the whole process, which would blame the coordinator for a round's failure.
  void TickLoop();
  // Waits `d` or until Shutdown; false once stopping.
  bool SleepUnlessStopping(absl::Duration d);

  const DaemonConfig config_;
  std::string address_;
  int64_t incarnation_ = 0;

  // --metrics-listen: outlives every component that reports to it (declared first).
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<DataBackend> backend_;
  // `<worker socket>.handles`: descriptors that workers hand over before they register. Made
  // before the gRPC server serves, never replaced.
  std::unique_ptr<HandleInbox> handles_;
  std::unique_ptr<WorkerRegistry> registry_;
  std::unique_ptr<PauseDetector> pause_;
  std::unique_ptr<NodeAgent> agent_;
  std::unique_ptr<CoordinatorLink> link_;  // not on the coordinator
  std::unique_ptr<WatchHub> watch_hub_;    // with link_
  // The coordinator's.
  std::unique_ptr<StateStore> state_;
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<GroupPlanner> planner_;
  std::unique_ptr<RoundLog> round_log_;
  std::unique_ptr<GrpcPeerClient> peers_;
  std::unique_ptr<RoundDriver> driver_;

  ServiceParts parts_;
  std::vector<std::unique_ptr<grpc::Service>> services_;
  // TLS credentials and who may call what; before the servers and every client that uses them.
  std::unique_ptr<GrpcTls> tls_;
  std::shared_ptr<LoopbackUsers> local_users_;  // without TLS: who may reach the TCP ports
  std::unique_ptr<Authority> authority_;
  // Three listeners, so that each service is reachable only where it belongs: server_ (--listen:
  // RefitControl, RefitPeer), worker_server_ (the unix socket, and --worker-listen if given:
  // RefitWorker, RefitControl), health_server_ (--health-listen, plaintext: gRPC health only,
  // for probes that cannot present a certificate). Each has gRPC's health service.
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> worker_server_;
  std::unique_ptr<grpc::Server> health_server_;
  // The unix socket's connections, accepted here and handed to worker_server_ (gone first).
  std::unique_ptr<UnixCallerListener> worker_socket_;
  std::thread monitor_;
  std::thread ticker_;

  absl::Mutex mu_;
  absl::CondVar stopped_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // drained: Wait() returns, the monitor ends
  bool shutdown_started_ ABSL_GUARDED_BY(mu_) = false;
  bool shutdown_done_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace refit
