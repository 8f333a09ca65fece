#include "daemon/daemon.h"

#include <grpcpp/resource_quota.h>
#include <grpcpp/server_posix.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/backend_factory.h"
#include "daemon/base/clock.h"
#include "daemon/base/logging.h"
#include "daemon/base/pause_detector.h"
#include "daemon/coordinator/group_planner.h"
#include "daemon/coordinator/grpc_peer_client.h"
#include "daemon/coordinator/membership.h"
#include "daemon/coordinator/round_driver.h"
#include "daemon/coordinator/round_log.h"
#include "daemon/coordinator/state_store.h"
#include "daemon/node/coordinator_link.h"
#include "daemon/node/node_agent.h"
#include "daemon/node/watch_hub.h"
#include "daemon/ops/metered_backend.h"
#include "daemon/ops/metrics.h"
#include "daemon/security/socket_access.h"
#include "daemon/worker/handle_inbox.h"
#include "daemon/worker/worker_registry.h"
#include "plan/status_macros.h"

namespace refit {
namespace {

std::string RoleName(v1::Role r) {
  return r == v1::TRAINER ? "trainer" : r == v1::INFERENCE ? "inference" : "?";
}

// What /metrics reads of the coordinator's groups at scrape time: the same calls Status makes
// (the planner's cached plan of the current epoch, planned now if the membership changed).
ClusterView ViewForMetrics(const Membership& membership, GroupPlanner& planner) {
  ClusterView view;
  view.coordinator = true;
  const MembershipCounts counts = membership.Counts();
  view.stale_syncs = counts.stale_syncs;
  view.rebased_syncs = counts.rebased_syncs;
  view.synced_bytes = counts.synced_bytes;
  view.forgotten_nodes = counts.forgotten_nodes;
  view.refused_joins = counts.refused_joins;
  for (const std::string& name : membership.GroupNames()) {
    const GroupMembers members = membership.Group(name, /*with_pieces=*/false);
    const std::shared_ptr<const GroupPlan> plan = planner.Get(name);
    GroupView& g = view.groups.emplace_back();
    g.name = name;
    g.trainers = members.trainers;
    g.inference = members.inference;
    g.membership_epoch = members.epoch;
    g.ready = plan->status.ok();
    g.plan_epoch = plan->epoch;
    g.planning_time = plan->planning_time;
  }
  view.plannings = planner.plannings();
  return view;
}

}  // namespace

Daemon::Daemon(const DaemonConfig& config) : config_(config) {
  std::random_device rd;
  incarnation_ = (static_cast<int64_t>(rd()) << 20) ^ static_cast<int64_t>(getpid()) ^
                 absl::ToUnixMicros(absl::Now());
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonConfig& config) {
  SetLogLevel(config.log_level);
  SetLogFormat(config.log_format, config.node);
  std::unique_ptr<Daemon> d(new Daemon(config));
  d->MakeSecurity();
  d->LogSecurityPosture();
  for (const std::string& w : ConfigWarnings(config)) Logger("rpc")->warn("{}", w);
  REFIT_RETURN_IF_ERROR(d->StartBackend());
  REFIT_RETURN_IF_ERROR(d->StartMetrics());
  REFIT_RETURN_IF_ERROR(d->StartHandleInbox());
  d->MakeNodeComponents();
  REFIT_RETURN_IF_ERROR(d->StartCoordinatorOrFollower());
  REFIT_RETURN_IF_ERROR(d->Serve());
  REFIT_RETURN_IF_ERROR(d->GrantWorkerSockets());
  d->LogServing();
  REFIT_RETURN_IF_ERROR(d->StartLoopsAndJoin());
  d->SetServing(true);
  if (!config.address_file.empty()) {
    std::ofstream(config.address_file) << d->address_ << " " << config.worker_socket << "\n";
  }
  return d;
}

void Daemon::MakeSecurity() {
  tls_ = std::make_unique<GrpcTls>(config_.tls);
  if (!config_.tls.enabled())
    local_users_ = std::make_shared<LoopbackUsers>(/*admit_remote=*/config_.insecure_listen);
  authority_ = std::make_unique<Authority>(config_.tls, local_users_);
}

void Daemon::LogSecurityPosture() const {
  if (config_.tls.enabled()) {
    Logger("rpc")->info(
        "TLS: certificate {}, CA {} (read again every {}); operators {}, viewers {}",
        config_.tls.cert, config_.tls.ca, absl::FormatDuration(config_.tls.reload),
        absl::StrJoin(config_.tls.operators, ","), absl::StrJoin(config_.tls.viewers, ","));
  } else if (config_.insecure_listen) {
    Logger("rpc")->warn(
        "no TLS and --insecure-listen: anyone who reaches {} can start refits and read every "
        "daemon's state; its peers' phases are obeyed unauthenticated (docs/SECURITY.md)",
        config_.listen);
  } else {
    Logger("rpc")->info("no TLS: listening on loopback only, for {} (docs/SECURITY.md)",
                        local_users_->Describe());
  }
}

absl::Status Daemon::StartBackend() {
  auto backend = MakeBackend(config_, BackendContext{.local_users = local_users_});
  if (!backend.ok()) return backend.status();
  backend_ = *std::move(backend);
  return absl::OkStatus();
}

absl::Status Daemon::StartMetrics() {
  if (config_.metrics_listen.empty()) return absl::OkStatus();
  auto metrics = Metrics::Start(config_.metrics_listen);
  if (!metrics.ok()) return metrics.status();
  metrics_ = *std::move(metrics);
  // Every transfer through the backend is reported: the agent and the backends know nothing of
  // it.
  backend_ = MeterBackend(std::move(backend_), metrics_.get());
  Logger("rpc")->info("metrics at http://{}/metrics", metrics_->address());
  return absl::OkStatus();
}

absl::Status Daemon::StartHandleInbox() {
  // Made before the gRPC server serves (a registration may name a token at once), by bind()
  // under the same umask as gRPC's worker socket: both get the same permissions (re-checked
  // once the worker socket exists).
  HandleInboxOptions handles;
  handles.path = config_.worker_socket + ".handles";
  // Only the uids that may register (--worker-uids, else this daemon's and root) may hand over
  // descriptors: anyone else is refused before anything is kept (it cannot fill the inbox).
  handles.admit_uid = [uids = WorkerAdmission(config_.worker_uids, geteuid()).uids()](uid_t uid) {
    return std::find(uids.begin(), uids.end(), static_cast<uint32_t>(uid)) != uids.end();
  };
  auto inbox = HandleInbox::Start(handles);
  if (!inbox.ok()) return Annotate(inbox.status(), "the handle socket");
  handles_ = *std::move(inbox);
  return absl::OkStatus();
}

void Daemon::MakeNodeComponents() {
  registry_ =
      std::make_unique<WorkerRegistry>(config_.node, config_.gpus, backend_.get(), handles_.get());
  registry_->SetLimits(config_.limits);
  registry_->SetAdmission(WorkerAdmission(config_.worker_uids, geteuid()));
  // Ticked every 100 ms by TickLoop (and MonitorLoop): a gap of half a second is a pause of this
  // process.
  pause_ = std::make_unique<PauseDetector>(Clock::Real(), absl::Milliseconds(500));
  NodeAgentLease lease;
  if (!config_.is_coordinator()) {
    lease.lease = config_.heartbeat *
                  config_.heartbeats_missed;  // the verdict the coordinator applies to nodes
    lease.coordinator = config_.coordinator;
  }
  agent_ = std::make_unique<NodeAgent>(config_.node, registry_.get(), backend_.get(), lease);
}

absl::Status Daemon::StartCoordinatorOrFollower() {
  if (!config_.is_coordinator()) {
    MakeCoordinatorLink();
    return absl::OkStatus();
  }
  REFIT_RETURN_IF_ERROR(OpenStateStore());
  MakeMembershipAndPlanner();
  MakeRoundDriver();
  return absl::OkStatus();
}

absl::Status Daemon::OpenStateStore() {
  if (config_.state_file.empty()) {
    Logger("rpc")->warn(
        "no --state-file: round ids and committed versions are kept in memory only; a restarted "
        "coordinator would accept versions already committed");
  }
  auto state = StateStore::Open(config_.state_file);
  if (!state.ok()) return state.status();
  state_ = *std::move(state);
  if (!config_.state_file.empty()) {
    Logger("rpc")->info("state file {}: next round id {}, {} groups' committed versions",
                        config_.state_file, state_->NextRoundId(), state_->Versions().size());
  }
  // Kept (versions never go back), but such a group has no next version to refit to.
  for (const auto& [group, version] : state_->Versions()) {
    if (version < kVersionLimit) continue;
    Logger("rpc")->warn(
        "group \"{}\" is at version {} in {}, at or above the limit {} (2^53): it cannot refit "
        "again until its line there is lowered below the limit (and above every other version it "
        "committed)",
        group, version, config_.state_file, kVersionLimit);
  }
  return absl::OkStatus();
}

void Daemon::MakeMembershipAndPlanner() {
  Daemon* self = this;
  membership_ = std::make_unique<Membership>(config_.node, config_.heartbeat,
                                             config_.heartbeats_missed, Clock::Real());
  membership_->SetLimits(config_.group_limits);
  membership_->SetNodeLimits(
      {.max_nodes = config_.max_nodes, .forget_dead_after = config_.forget_dead_after});
  GroupPlannerOptions planning;
  planning.max_message_bytes = config_.max_message_bytes;
  planning.routing = config_.routing;
  planning.max_relay_depth = config_.max_relay_depth;
  planner_ = std::make_unique<GroupPlanner>(planning, membership_.get());
  // A group whose last worker left is forgotten by every component that kept something of it
  // (the round log keeps its history). The planner and driver outlive the membership's callers.
  membership_->OnGroupForgotten([self](const std::string& group) {
    self->planner_->Forget(group);
    if (self->driver_ != nullptr) self->driver_->ForgetGroup(group);
  });
  round_log_ = std::make_unique<RoundLog>();
  if (metrics_ != nullptr) {
    Metrics* metrics = metrics_.get();
    round_log_->AddListener([metrics](const v1::RoundStats& s) { metrics->RoundEnded(s); });
    metrics->SetClusterView([self] {
      ClusterView view = ViewForMetrics(*self->membership_, *self->planner_);
      view.data_connections = self->backend_->ConnectionEvents();
      return view;
    });
  }
}

void Daemon::MakeRoundDriver() {
  Daemon* self = this;
  GrpcPeerClientOptions peers;
  peers.self = config_.node;
  peers.incarnation = incarnation_;
  peers.tls = tls_.get();
  peers.peer_timeout = config_.peer_timeout;
  peers.max_rpc_bytes = config_.max_rpc_bytes;
  peers.address = [self](int32_t node) { return self->membership_->ControlAddress(node); };
  peers.death_reason = [self](int32_t node) { return self->membership_->DeathReason(node); };
  peers.local_phase = [self](const v1::PhaseRequest& r, v1::PhaseResponse* out) {
    return self->agent_->RunPhase(r, out);
  };
  peers.local_install = [self](const v1::InstallPlanRequest& r) {
    return self->agent_->InstallPlan(r);
  };
  peers_ = std::make_unique<GrpcPeerClient>(std::move(peers));
  RoundDriverOptions rounds;
  rounds.self = config_.node;
  rounds.prepare_timeout = config_.prepare_timeout;
  rounds.transfer_timeout = config_.transfer_timeout;
  rounds.commit_timeout = config_.commit_timeout;
  rounds.peer_timeout = config_.peer_timeout;
  rounds.max_message_bytes = config_.max_message_bytes;
  rounds.step_bytes = config_.staging_bytes / 2;
  rounds.routing = config_.routing;
  rounds.max_relay_depth = config_.max_relay_depth;
  rounds.zero_copy_min_bytes = config_.zero_copy_min_bytes;
  rounds.nccl_register = config_.nccl_register;
  rounds.new_communicator_id = [self] { return self->backend_->NewCommunicatorId(); };
  rounds.state = state_.get();
  rounds.pause = pause_.get();
  rounds.blame_pause = config_.heartbeat * config_.heartbeats_missed;
  rounds.fanout_threads = config_.fanout_threads;
  driver_ = std::make_unique<RoundDriver>(rounds, membership_.get(), planner_.get(), peers_.get(),
                                          round_log_.get(), Clock::Real());
}

void Daemon::MakeCoordinatorLink() {
  Daemon* self = this;
  CoordinatorLinkOptions link;
  link.coordinator = config_.coordinator;
  link.node = config_.node;
  link.incarnation = incarnation_;
  link.tls = tls_.get();
  link.coordinator_node = config_.coordinator_node;
  link.heartbeat = config_.heartbeat;
  link.peer_timeout = config_.peer_timeout;
  link.max_rpc_bytes = config_.max_rpc_bytes;
  link.join_timeout = config_.join_timeout;
  link.snapshot = [self] { return self->registry_->Snapshot(); };
  link.on_refused = [self](const std::vector<v1::WorkerRefusal>& refused) {
    for (const v1::WorkerRefusal& r : refused) {
      self->DropWorker(r.worker_id(), absl::StrCat("the coordinator refused it: ", r.reason()));
    }
  };
  link.on_answer = [self](const v1::JoinResponse& answer) {
    if (!answer.resync()) {
      const std::map<std::string, int64_t> running(answer.running_rounds().begin(),
                                                   answer.running_rounds().end());
      self->agent_->RenewLeases(answer.lists_running_rounds() ? &running : nullptr);
      return;
    }
    self->agent_->AbortOpenRounds(
        absl::StrCat("the coordinator (", self->config_.coordinator,
                     ") no longer knows this node: it restarted, or declared it dead"));
  };
  link_ = std::make_unique<CoordinatorLink>(std::move(link));
  CoordinatorLink* forward = link_.get();
  watch_hub_ = std::make_unique<WatchHub>(
      [forward](const std::function<bool()>& stop,
                const std::function<bool(const v1::RoundStats&)>& deliver,
                const std::function<void()>& opened) {
        return forward->ForwardWatch(v1::WatchRoundsRequest(), stop, deliver, opened);
      });
  if (metrics_ != nullptr) {
    metrics_->SetClusterView([self] {
      ClusterView view;
      view.data_connections = self->backend_->ConnectionEvents();
      return view;
    });
  }
}

absl::Status Daemon::GrantWorkerSockets() {
  // The daemon's user, and the users --worker-uids names, may connect (a unix socket needs write
  // permission); a registration is then admitted or refused by the handle socket's credentials.
  for (const std::string& path : {config_.worker_socket, handles_->path()}) {
    if (auto s = GrantSocketAccess(path, config_.worker_uids); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void Daemon::LogServing() const {
  Logger("rpc")->info(
      "node {} serving on {} and unix:{} (handles: {}), data plane {} ({}), {}", config_.node,
      address_, config_.worker_socket, handles_->path(), backend_->data_address(), backend_->name(),
      config_.is_coordinator() ? "coordinator" : "coordinator at " + config_.coordinator);
}

absl::Status Daemon::StartLoopsAndJoin() {
  Daemon* self = this;
  ticker_ = std::thread([self] { self->TickLoop(); });
  monitor_ = std::thread([self] { self->MonitorLoop(); });
  if (config_.is_coordinator()) {
    membership_->SetSelf(address_, backend_->data_address(), incarnation_);
  } else {
    // Join before serving workers: a registration must reach the coordinator.
    REFIT_RETURN_IF_ERROR(link_->Join(address_, backend_->data_address()));
  }
  return absl::OkStatus();
}

// gRPC's standard health service (grpc.health.v1): each refit service SERVING once the backend
// is up and the node has joined its coordinator (readiness), "" once the server runs (liveness);
// all NOT_SERVING while it drains. Kubernetes' grpc probes ask it (docs/KUBERNETES.md).
constexpr const char* kHealthServices[] = {"", "refit.v1.RefitControl", "refit.v1.RefitPeer",
                                           "refit.v1.RefitWorker"};

std::vector<grpc::Server*> Daemon::Servers() const {
  std::vector<grpc::Server*> out;
  for (const auto* s : {&server_, &worker_server_, &health_server_}) {
    if (*s != nullptr) out.push_back(s->get());
  }
  return out;
}

void Daemon::SetServing(bool serving) {
  for (grpc::Server* server : Servers()) {
    grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
    if (health == nullptr) continue;
    for (const char* service : kHealthServices) health->SetServingStatus(service, serving);
  }
}

void Daemon::SetAlive() {
  // "" answers for the process (a liveness probe): SERVING while it runs, even while it waits
  // for its coordinator; the refit services (readiness) only once joined.
  for (grpc::Server* server : Servers()) {
    if (grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService()) {
      health->SetServingStatus("", true);
    }
  }
}

namespace {

void ConfigureServer(const DaemonConfig& config, grpc::ServerBuilder& builder) {
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_rpc_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config.max_rpc_bytes));
  // Workers ping their session every second to notice a dead or frozen daemon within about a
  // second (WorkerClient, the Python worker). By default a server takes pings without data at
  // most every 5 minutes and closes the connection after 2 more ("too_many_pings").
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);  // 0: no limit
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // And it pings its callers (every gRPC client answers), so that a connection whose other end
  // went silent, froze or vanished without a FIN is closed (config.h, rpc_keepalive).
  const int keepalive_ms = static_cast<int>(absl::ToInt64Milliseconds(config.rpc_keepalive));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, keepalive_ms);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keepalive_ms);
  // The sync services hold a thread per call in progress (a Refit for its round, a RunPhase for
  // its phase): bounded, so that no caller can make the daemon spawn threads without end.
  grpc::ResourceQuota quota("refitd");
  quota.SetMaxThreads(512);
  builder.SetResourceQuota(quota);
}

// The addresses a caller of the listener configured as `configured` (bound to `port`) may have
// reached.
void AddLoopbackListeners(const std::string& configured, int port, LoopbackUsers& users) {
  for (const Endpoint& e : ListenerAddresses(configured, port)) users.AddListener(e);
}

}  // namespace

absl::Status Daemon::Serve() {
  grpc::EnableDefaultHealthCheckService(true);  // process-wide; before the servers are built
  FillServiceParts();
  auto port = StartControlServer();
  if (!port.ok()) return port.status();
  REFIT_RETURN_IF_ERROR(StartWorkerServer());
  REFIT_RETURN_IF_ERROR(StartHealthServer());
  SetServing(false);  // until joined
  SetAlive();
  const std::string host = config_.listen.substr(0, config_.listen.rfind(':'));
  address_ = absl::StrCat(host, ":", *port);
  // Read by Status only (set before any call can reach it in practice: the coordinator's own
  // address is known to operators only from here on).
  parts_.address = address_;
  return absl::OkStatus();
}

void Daemon::FillServiceParts() {
  parts_.config = &config_;
  parts_.authority = authority_.get();
  parts_.incarnation = incarnation_;
  parts_.registry = registry_.get();
  parts_.agent = agent_.get();
  parts_.link = link_.get();
  parts_.watch_hub = watch_hub_.get();
  parts_.membership = membership_.get();
  parts_.planner = planner_.get();
  parts_.driver = driver_.get();
  parts_.log = round_log_.get();
  parts_.register_worker = [this](const v1::RegisterWorkerRequest& r, WorkerTransport transport,
                                  v1::RegisterWorkerResponse* out) {
    return Register(r, transport, out);
  };
  parts_.drop_worker = [this](const std::string& id, const std::string& reason) {
    DropWorker(id, reason);
  };
}

absl::StatusOr<int> Daemon::StartControlServer() {
  // Peers and operators: TLS when configured (every caller then presents a certificate).
  grpc::ServerBuilder builder;
  ConfigureServer(config_, builder);
  int port = 0;
  builder.AddListeningPort(config_.listen, tls_->ServerCredentials(), &port);
  services_.push_back(MakeControlService(&parts_));
  services_.push_back(MakePeerService(&parts_));
  builder.RegisterService(services_[services_.size() - 2].get());
  builder.RegisterService(services_.back().get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port == 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on ", config_.listen));
  if (local_users_ != nullptr) AddLoopbackListeners(config_.listen, port, *local_users_);
  return port;
}

absl::Status Daemon::StartWorkerServer() {
  // Workers: the unix socket (its file mode says who may connect; the handle socket's
  // credentials say who registers), and TCP only when asked. RefitControl is here too, for local
  // tools (under TLS, read-only: steering needs an operator certificate). Never RefitPeer. The
  // unix socket is accepted here, not by gRPC, so that each caller's uid is known
  // (daemon/security/unix_callers.h); gRPC serves each connection it is handed.
  grpc::ServerBuilder workers;
  ConfigureServer(config_, workers);
  int worker_port = 0;
  if (!config_.worker_listen.empty()) {
    workers.AddListeningPort(config_.worker_listen, tls_->ServerCredentials(), &worker_port);
  }
  services_.push_back(MakeWorkerService(&parts_));
  services_.push_back(MakeControlService(&parts_));
  workers.RegisterService(services_[services_.size() - 2].get());
  workers.RegisterService(services_.back().get());
  worker_server_ = workers.BuildAndStart();
  if (local_users_ != nullptr && worker_port != 0)
    AddLoopbackListeners(config_.worker_listen, worker_port, *local_users_);
  if (worker_server_ == nullptr || (!config_.worker_listen.empty() && worker_port == 0)) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on unix:", config_.worker_socket,
                     config_.worker_listen.empty() ? "" : " and " + config_.worker_listen));
  }
  grpc::Server* server = worker_server_.get();
  REFIT_ASSIGN_OR_RETURN(worker_socket_,
                         UnixCallerListener::Start(config_.worker_socket, [server](int fd) {
                           grpc::AddInsecureChannelFromFd(server, fd);
                         }));
  if (!config_.worker_listen.empty()) {
    const std::string host = config_.worker_listen.substr(0, config_.worker_listen.rfind(':'));
    Logger("rpc")->warn("workers are also served over TCP at {}:{} (not identified by uid{})", host,
                        worker_port,
                        config_.tls.enabled() ? "; only --tls-workers certificates register" : "");
  }
  return absl::OkStatus();
}

absl::Status Daemon::StartHealthServer() {
  if (config_.health_listen.empty()) return absl::OkStatus();
  // Plaintext and health only: Kubernetes' grpc probes present no certificate. It tells
  // whether the daemon runs and has joined, nothing else.
  grpc::ServerBuilder health;
  int health_port = 0;
  health.AddListeningPort(config_.health_listen, grpc::InsecureServerCredentials(), &health_port);
  // gRPC's default health service is a sync service, served only by a server that has one of
  // its own; this one answers every RefitControl call UNIMPLEMENTED.
  services_.push_back(std::make_unique<v1::RefitControl::Service>());
  health.RegisterService(services_.back().get());
  health_server_ = health.BuildAndStart();
  if (health_server_ == nullptr || health_port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on --health-listen ", config_.health_listen));
  }
  const std::string health_host = config_.health_listen.substr(0, config_.health_listen.rfind(':'));
  Logger("rpc")->info("health (plaintext, grpc.health.v1 only) at {}:{}", health_host, health_port);
  return absl::OkStatus();
}

Daemon::~Daemon() {
  if (metrics_) metrics_->Stop();  // no scrape reads the components being torn down
  Shutdown();
  if (monitor_.joinable()) monitor_.join();
  if (ticker_.joinable()) ticker_.join();
  if (link_) link_->Stop();
  if (driver_) driver_->Stop();  // rounds started by StartRefit end by their deadlines
  for (grpc::Server* server : Servers()) server->Wait();
  driver_.reset();
  peers_.reset();  // waits for calls in flight
  unlink(config_.worker_socket.c_str());
}

void Daemon::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_started_) {  // a second caller (the destructor) waits for the first to finish
      mu_.Await(absl::Condition(&shutdown_done_));
      return;
    }
    shutdown_started_ = true;
  }
  // Draining: probes see NOT_SERVING; no round begins; the running ones may finish within
  // --drain-timeout, then what is left here is aborted, its workers told.
  SetServing(false);
  if (driver_) {
    if (!driver_->Drain(config_.drain_timeout)) {
      Logger("round")->warn("draining: rounds still running after {}; they end by their deadlines",
                            absl::FormatDuration(config_.drain_timeout));
    }
  }
  if (agent_) {
    const int aborted = agent_->Drain(
        config_.drain_timeout, absl::StrCat("node ", config_.node, " is shutting down (drained)"));
    if (aborted > 0)
      Logger("round")->warn("draining: aborted {} round(s) open on this node", aborted);
  }
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;  // Wait() returns, the monitor ends: after the drain, which needs them
    stopped_.SignalAll();
  }
  // Every attached worker session finishes now (the registry notifies it); the server's deadline
  // cancels whatever is still open (a session before its hello, WatchRounds), so Shutdown ends.
  // The worker service (services_) outlives server_ and waits for sessions still in OnDone.
  if (registry_) registry_->Stop();
  if (round_log_) round_log_->Stop();
  if (watch_hub_) watch_hub_->Stop();
  worker_socket_.reset();  // no connection is handed to the worker server once it shuts down
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(2);
  for (grpc::Server* server : Servers()) server->Shutdown(deadline);
  absl::MutexLock lock(&mu_);
  shutdown_done_ = true;
}

void Daemon::Wait() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) stopped_.WaitWithTimeout(&mu_, absl::Seconds(1));
}

namespace {
void LogPause(const std::optional<PauseDetector::Pause>& paused) {
  if (!paused.has_value()) return;
  Logger("rpc")->warn("this daemon did not run for {} (stopped or starved)",
                      absl::FormatDuration(paused->length()));
}
}  // namespace

bool Daemon::SleepUnlessStopping(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  if (!stopping_) stopped_.WaitWithTimeout(&mu_, d);
  return !stopping_;
}

void Daemon::TickLoop() {
  while (SleepUnlessStopping(absl::Milliseconds(100))) LogPause(pause_->Tick());
}

void Daemon::MonitorLoop() {
  const absl::Duration silence = config_.heartbeat * config_.heartbeats_missed;
  absl::Time checked = absl::Now();  // the pauses that ended since: this loop's to act on
  while (SleepUnlessStopping(absl::Milliseconds(100))) {
    LogPause(
        pause_->Tick());  // a pause that ended just now counts here, before the ticker's next tick
    const std::optional<PauseDetector::Pause> last = pause_->LastPause();
    const bool paused = last.has_value() && last->ended > checked;
    checked = absl::Now();
    // Registrations whose session never attached (a worker that crashed between Register and its
    // hello, or one parked on purpose) are dropped as workers that left: the coordinator is told,
    // the name is free again. Not right after a pause of this process: a hello sent meanwhile
    // has not been read yet.
    if (!pause_->PausedWithin(config_.worker_attach_timeout)) {
      for (const std::string& id : registry_->ExpireUnattached(config_.worker_attach_timeout)) {
        DropWorker(id, absl::StrCat("registered but never opened its session within ",
                                    absl::FormatDuration(config_.worker_attach_timeout)));
      }
    }
    if (membership_ != nullptr) {
      // Heartbeats that arrived while this daemon was stopped were not received: peers are
      // judged again only after a whole verdict's time since it runs again.
      if (pause_->PausedWithin(silence)) continue;
      // A node declared dead has its phase calls in flight cancelled at once.
      const std::vector<DeadNode> declared = membership_->CheckLiveness();
      if (metrics_ != nullptr) metrics_->NodesDeclaredDead(static_cast<int>(declared.size()));
      for (const DeadNode& dead : declared) peers_->CancelNode(dead.node);
    } else if (paused) {
      // Leases ran out while this node was stopped, not the coordinator: the next heartbeat's
      // answer says whether its rounds go on (or resync: they ended).
      agent_->RenewLeases();
    } else {
      agent_->ExpireLeases();
    }
  }
}

absl::Status Daemon::SyncAdded(const LocalWorker& worker) {
  // The coordinator keeps the pieces from the kept encoding (never decoded here), its own
  // workers' and a node's alike.
  if (membership_ != nullptr)  // ALREADY_EXISTS, RESOURCE_EXHAUSTED, FAILED_PRECONDITION
    return membership_->AddLocal(worker.WithWorkerEncoded(), worker.session_key);
  std::vector<v1::WorkerRefusal> refused;
  const absl::Status sent = link_->SyncAdded(worker.Encoded(), &refused);
  // Not applied (this node not joined yet): a retry may succeed, unlike a refused worker.
  if (sent.code() == absl::StatusCode::kFailedPrecondition)
    return absl::UnavailableError(sent.message());
  REFIT_RETURN_IF_ERROR(sent);
  for (const v1::WorkerRefusal& r : refused) {
    if (r.worker_id() != worker.id) {  // refused since it registered (e.g. after a resync)
      DropWorker(r.worker_id(), absl::StrCat("the coordinator refused it: ", r.reason()));
      continue;
    }
    // Over a group limit, a tensor declared otherwise on another node, or its name held there.
    switch (static_cast<absl::StatusCode>(r.code())) {
      case absl::StatusCode::kResourceExhausted:
        return absl::ResourceExhaustedError(r.reason());
      case absl::StatusCode::kFailedPrecondition:
        return absl::FailedPreconditionError(r.reason());
      default:
        return absl::AlreadyExistsError(r.reason());
    }
  }
  return absl::OkStatus();
}

void Daemon::SyncRemoved(const std::string& id, const std::string& registration) {
  if (membership_ != nullptr) {
    membership_->RemoveLocal(id, registration);
  } else if (registry_->Find(id) == nullptr) {
    // Registered again meanwhile: that registration's change replaces this one at the coordinator.
    link_->SyncRemoved(id).IgnoreError();
  }
}

absl::Status Daemon::Register(const v1::RegisterWorkerRequest& request, WorkerTransport transport,
                              v1::RegisterWorkerResponse* response) {
  auto registered = registry_->Register(request, transport);
  if (!registered.ok()) return registered.status();
  const std::shared_ptr<LocalWorker>& worker = registered->worker;
  if (auto s = SyncAdded(*worker); !s.ok()) {
    registry_->Drop(worker->id);
    if (s.code() == absl::StatusCode::kAlreadyExists ||
        s.code() == absl::StatusCode::kResourceExhausted ||
        s.code() == absl::StatusCode::kFailedPrecondition) {
      return absl::Status(s.code(), absl::StrCat("register: ", s.message()));
    }
    return absl::UnavailableError(
        absl::StrCat("register: the coordinator did not take the worker: ", s.message()));
  }
  const v1::Worker& w = worker->request.worker();
  Logger("worker")->info(
      "registered {} ({}, GPU {}, {} buffers, {} pieces total in layout{})", worker->id,
      RoleName(worker->request.role()), w.gpu(), w.buffers_size(), registered->pieces,
      request.fd_token().empty()
          ? std::string()
          : absl::StrCat("; ", registered->descriptors, " descriptors handed over by pid ",
                         registered->pid, " uid ", registered->uid));
  response->set_worker_id(worker->id);
  response->set_node(config_.node);
  response->set_version(0);
  response->set_session_key(worker->session_key);
  return absl::OkStatus();
}

void Daemon::DropWorker(const std::string& id, const std::string& reason) {
  std::shared_ptr<LocalWorker> w = registry_->Drop(id);
  if (w == nullptr) return;
  Logger("worker")->warn("worker {} left: {}", id, reason);
  SyncRemoved(id, w->session_key);
  // A round of its group cannot complete any more: end this node's transfer now.
  agent_->WorkerLost(w->group(), id, reason);
}

}  // namespace refit
