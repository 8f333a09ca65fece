// refitd: one per node. Serves local workers (registration, sessions), executes this node's part
// of every round through its DataBackend, and, on the coordinator, keeps the cluster's
// membership, plans each model group once per membership and drives rounds:
//
//   prepare  every worker of the group confirms: trainers hold version v and leave it untouched,
//            inference workers stopped reading their weights
//   transfer every daemon runs its messages (stage by stage)
//   commit   inference workers learn v and resume; or abort, with the reason and the culprit
//
// Every wait has a deadline. Non-coordinator daemons forward operator calls to the coordinator.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "daemon/backend.h"
#include "daemon/config.h"
#include "daemon/handle_inbox.h"
#include "plan/layout.h"
#include "plan/plan.h"
#include "proto/refit.grpc.pb.h"

namespace refit {

class Daemon {
 public:
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonConfig& config);
  ~Daemon();

  void Wait();      // until Shutdown()
  void Shutdown();  // idempotent; safe from a signal-handling thread
  const std::string& address() const { return address_; }
  const DaemonConfig& config() const { return config_; }

  // RefitWorker.
  absl::Status Register(const v1::RegisterWorkerRequest& request, v1::RegisterWorkerResponse* response);
  absl::Status Session(grpc::ServerContext* context,
                       grpc::ServerReaderWriter<v1::RoundEvent, v1::WorkerMessage>* stream);
  absl::Status Unregister(const v1::UnregisterWorkerRequest& request);

  // RefitControl: executed on the coordinator, forwarded from the others.
  absl::Status Refit(const v1::RefitRequest& request, v1::RoundStats* stats);
  absl::Status StartRefit(const v1::RefitRequest& request, v1::StartRefitResponse* response);
  absl::Status WatchRounds(grpc::ServerContext* context, const v1::WatchRoundsRequest& request,
                           grpc::ServerWriter<v1::RoundStats>* writer);
  absl::Status Status(v1::StatusResponse* response);
  absl::Status ListWorkers(const v1::ListWorkersRequest& request, v1::ListWorkersResponse* response);
  absl::Status GetPlan(const v1::GetPlanRequest& request, v1::PlanSummary* response);

  // RefitPeer.
  absl::Status Join(const v1::JoinRequest& request, v1::JoinResponse* response);
  absl::Status SyncWorkers(const v1::SyncWorkersRequest& request);
  absl::Status InstallPlan(const v1::InstallPlanRequest& request);
  absl::Status RunPhase(const v1::PhaseRequest& request, v1::PhaseResponse* response);

 private:
  struct LocalWorker;
  struct InstalledPlan;
  struct NodeInfo;
  struct GroupState;

  explicit Daemon(const DaemonConfig& config);
  absl::Status Serve();

  // Local side.
  std::shared_ptr<LocalWorker> FindWorker(const std::string& id);
  void DropWorker(const std::string& id, const std::string& reason);
  void Push(LocalWorker& w, v1::RoundEvent event);
  absl::Status AwaitWorkers(const std::string& group, const std::vector<std::string>& ids,
                            int64_t round_id, bool resumed, absl::Duration timeout,
                            const char* phase);
  // Tells the coordinator this node's workers changed (one added or removed; remote daemons send
  // the whole list).
  absl::Status SyncToCoordinator(const v1::RegisterWorkerRequest* added, const std::string& removed);
  v1::SyncWorkersRequest LocalSnapshot();
  void HeartbeatLoop();

  // Coordinator side.
  void ApplySync(const v1::SyncWorkersRequest& request);  // mu_ held
  void RecomputeEpochs();                                   // mu_ held
  void MarkNodeDead(int32_t node, const std::string& why);  // takes mu_
  void MonitorLoop();
  absl::Status EnsurePlan(const std::string& group);        // mu_ held
  absl::Status CallPeer(int32_t node, const v1::PhaseRequest& request, v1::PhaseResponse* response,
                        absl::Duration timeout);
  absl::Status CallInstall(int32_t node, const v1::InstallPlanRequest& request);
  // Checks a refit request and reserves the group (busy) and a round id.
  absl::StatusOr<int64_t> BeginRound(const v1::RefitRequest& request);
  absl::Status FinishRound(const v1::RefitRequest& request, int64_t round_id, v1::RoundStats* stats);
  absl::Status RunRound(const std::string& group, int64_t round_id, int64_t version, v1::RoundStats* stats);
  void Publish(const v1::RoundStats& stats);  // to WatchRounds
  v1::RefitControl::Stub* CoordinatorStub();
  v1::RefitPeer::Stub* PeerStub(const std::string& address);

  const DaemonConfig config_;
  std::string address_;
  int64_t incarnation_ = 0;
  std::unique_ptr<DataBackend> backend_;
  // `<worker socket>.handles`: descriptors that workers hand over before they register. Made
  // before the gRPC server serves, never replaced.
  std::unique_ptr<HandleInbox> handles_;
  std::vector<std::unique_ptr<grpc::Service>> services_;
  std::unique_ptr<grpc::Server> server_;
  std::thread heartbeat_, monitor_;
  std::vector<std::thread> background_;  // rounds started by StartRefit (guarded by mu_)

  std::mutex mu_;
  std::condition_variable changed_;  // any state change: workers, rounds, shutdown
  bool stopping_ = false;
  std::map<std::string, std::shared_ptr<LocalWorker>> workers_;
  // Phase calls to peers in flight (under mu_): a peer declared dead has its calls cancelled at
  // once, so a round does not wait out its deadline on a frozen node.
  std::multimap<int32_t, grpc::ClientContext*> peer_calls_;
  std::map<int32_t, std::string> dead_because_;
  std::map<std::string, std::shared_ptr<InstalledPlan>> installed_;
  std::map<std::string, int64_t> active_rounds_;  // group -> round running on this node
  // group -> the latest round the coordinator aborted here: ends this node's wait for PREPARE of
  // that round at once (another node failed it), and refuses its PREPARE if that arrives late.
  std::map<std::string, int64_t> aborted_rounds_;

  // Coordinator state.
  std::map<int32_t, NodeInfo> nodes_;
  std::map<std::string, GroupState> groups_;
  int64_t next_round_ = 1;
  std::deque<v1::RoundStats> round_log_;  // WatchRounds reads from here
  int64_t round_log_start_ = 0;           // sequence number of round_log_.front()

  // Heartbeats, apart from mu_: planning a large group under mu_ must not make live nodes look
  // dead. node -> (incarnation, last heartbeat).
  std::mutex beat_mu_;
  std::map<int32_t, std::pair<int64_t, absl::Time>> beats_;

  std::mutex sync_mu_;  // orders SyncToCoordinator calls (remote daemons)

  std::mutex stubs_mu_;
  std::map<std::string, std::unique_ptr<v1::RefitPeer::Stub>> peer_stubs_;
  std::unique_ptr<v1::RefitControl::Stub> coordinator_stub_;
};

}  // namespace refit
