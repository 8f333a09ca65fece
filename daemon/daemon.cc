#include "daemon/daemon.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <optional>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/cuda_backend.h"
#include "daemon/grpc_status.h"
#include "daemon/host_backend.h"
#include "daemon/logging.h"
#include "daemon/memory_refs.h"
#include "plan/planner.h"
#include "plan/status_macros.h"
#include "plan/validate.h"
#include "proto/layout_codec.h"

namespace refit {

// A worker registered on this node.
struct Daemon::LocalWorker {
  std::string id;
  v1::RegisterWorkerRequest request;  // worker.node filled in
  std::vector<std::unique_ptr<MappedBuffer>> buffers;
  absl::flat_hash_map<std::string, int> buffer_index;  // by name: a trainer may hold 100k buffers
  bool has_session = false;
  bool gone = false;  // unregistered or its session ended: never used again
  std::deque<v1::RoundEvent> outbox;
  std::condition_variable wake;  // its session writer: an event, or the worker is gone
  int64_t prepared_round = -1;
  int64_t resumed_round = -1;
  int64_t refused_round = -1;  // the worker refused PREPARE of this round,
  std::string refused_reason;  // in its own words
};

// A group's plan as this daemon executes it.
struct Daemon::InstalledPlan {
  int64_t epoch = -1;
  Layout src, dst;
  std::shared_ptr<const Plan> plan;
  absl::flat_hash_map<int32_t, std::string> data_addresses;
  std::string nccl_id;
  int64_t step_bytes = 0;
  int64_t zero_copy_min_bytes = 0;
  bool nccl_register = false;
  // The buffers of the last transfer, reused while the same local workers stay registered (a
  // model of 100k tensors would otherwise cost tens of milliseconds of lookups every round).
  // Guarded by mu_.
  struct Resolved {
    std::vector<std::weak_ptr<LocalWorker>> workers;
    BufferMemory src, dst;
  };
  std::optional<Resolved> resolved;
};

// The coordinator's view of a node.
struct Daemon::NodeInfo {
  std::string control_address, data_address;
  int64_t incarnation = 0;
  bool alive = false;
  std::vector<v1::RegisterWorkerRequest> workers;
};

struct Daemon::GroupState {
  int64_t epoch = 0;
  std::string fingerprint;  // membership; a change bumps epoch
  int64_t version = 0;      // last committed
  bool busy = false;
  int64_t planned_epoch = -1;
  absl::Status plan_status = absl::FailedPreconditionError("not planned yet");
  v1::Layout src, dst;
  PlanStats stats;
  std::map<int32_t, int64_t> installed_epoch;  // per node
  std::set<int32_t> nodes;                     // nodes with workers of this group
  int trainers = 0, inference = 0;
};

namespace {

std::string RoleName(v1::Role r) { return r == v1::TRAINER ? "trainer" : r == v1::INFERENCE ? "inference" : "?"; }

template <typename Service>
class ServiceBase : public Service {
 public:
  explicit ServiceBase(Daemon* d) : d_(d) {}

 protected:
  Daemon* d_;
};

class WorkerService : public ServiceBase<v1::RefitWorker::Service> {
 public:
  using ServiceBase::ServiceBase;
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterWorkerRequest* r,
                        v1::RegisterWorkerResponse* out) override {
    return ToGrpc(d_->Register(*r, out));
  }
  grpc::Status Session(grpc::ServerContext* c,
                       grpc::ServerReaderWriter<v1::RoundEvent, v1::WorkerMessage>* s) override {
    return ToGrpc(d_->Session(c, s));
  }
  grpc::Status Unregister(grpc::ServerContext*, const v1::UnregisterWorkerRequest* r,
                          v1::UnregisterWorkerResponse*) override {
    return ToGrpc(d_->Unregister(*r));
  }
};

class ControlService : public ServiceBase<v1::RefitControl::Service> {
 public:
  using ServiceBase::ServiceBase;
  grpc::Status Refit(grpc::ServerContext*, const v1::RefitRequest* r, v1::RoundStats* out) override {
    return ToGrpc(d_->Refit(*r, out));
  }
  grpc::Status StartRefit(grpc::ServerContext*, const v1::RefitRequest* r,
                          v1::StartRefitResponse* out) override {
    return ToGrpc(d_->StartRefit(*r, out));
  }
  grpc::Status WatchRounds(grpc::ServerContext* c, const v1::WatchRoundsRequest* r,
                           grpc::ServerWriter<v1::RoundStats>* w) override {
    return ToGrpc(d_->WatchRounds(c, *r, w));
  }
  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*, v1::StatusResponse* out) override {
    return ToGrpc(d_->Status(out));
  }
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest* r,
                           v1::ListWorkersResponse* out) override {
    return ToGrpc(d_->ListWorkers(*r, out));
  }
  grpc::Status GetPlan(grpc::ServerContext*, const v1::GetPlanRequest* r, v1::PlanSummary* out) override {
    return ToGrpc(d_->GetPlan(*r, out));
  }
};

class PeerService : public ServiceBase<v1::RefitPeer::Service> {
 public:
  using ServiceBase::ServiceBase;
  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest* r, v1::JoinResponse* out) override {
    return ToGrpc(d_->Join(*r, out));
  }
  grpc::Status SyncWorkers(grpc::ServerContext*, const v1::SyncWorkersRequest* r,
                           v1::SyncWorkersResponse*) override {
    return ToGrpc(d_->SyncWorkers(*r));
  }
  grpc::Status InstallPlan(grpc::ServerContext*, const v1::InstallPlanRequest* r,
                           v1::InstallPlanResponse*) override {
    return ToGrpc(d_->InstallPlan(*r));
  }
  grpc::Status RunPhase(grpc::ServerContext*, const v1::PhaseRequest* r, v1::PhaseResponse* out) override {
    return ToGrpc(d_->RunPhase(*r, out));
  }
};

std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoNanoseconds(d);
}

}  // namespace

Daemon::Daemon(const DaemonConfig& config) : config_(config) {
  std::random_device rd;
  incarnation_ = (static_cast<int64_t>(rd()) << 20) ^ static_cast<int64_t>(getpid()) ^
                 absl::ToUnixMicros(absl::Now());
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonConfig& config) {
  SetLogLevel(config.log_level);
  std::unique_ptr<Daemon> d(new Daemon(config));
  if (config.backend == "cuda") {
    auto backend = CudaBackend::Start(config.gpus, config.staging_bytes, config.nccl_stream_priority);
    if (!backend.ok()) return backend.status();
    d->backend_ = *std::move(backend);
  } else {
    auto backend = HostBackend::Start(config.data_listen);
    if (!backend.ok()) return backend.status();
    d->backend_ = *std::move(backend);
  }
  {
    // Made before the gRPC server serves (a registration may name a token at once), by bind()
    // under the same umask as gRPC's worker socket: both get the same permissions (re-checked
    // once the worker socket exists).
    HandleInboxOptions handles;
    handles.path = config.worker_socket + ".handles";
    auto inbox = HandleInbox::Start(handles);
    if (!inbox.ok()) return Annotate(inbox.status(), "the handle socket");
    d->handles_ = *std::move(inbox);
  }
  if (auto s = d->Serve(); !s.ok()) return s;
  if (struct stat st; stat(config.worker_socket.c_str(), &st) == 0) {
    chmod(d->handles_->path().c_str(), st.st_mode & 07777);
  }
  Logger("rpc")->info("node {} serving on {} and unix:{} (handles: {}), data plane {} ({}), {}", config.node,
                      d->address_, config.worker_socket, d->handles_->path(), d->backend_->data_address(),
                      d->backend_->name(),
                      config.is_coordinator() ? "coordinator" : "coordinator at " + config.coordinator);
  {
    std::lock_guard<std::mutex> lock(d->mu_);
    NodeInfo& me = d->nodes_[config.node];
    me.control_address = d->address_;
    me.data_address = d->backend_->data_address();
    me.incarnation = d->incarnation_;
    me.alive = true;
  }
  if (config.is_coordinator()) {
    d->monitor_ = std::thread([p = d.get()] { p->MonitorLoop(); });
  } else {
    // Join before serving workers: a registration must reach the coordinator.
    v1::JoinRequest join;
    join.set_node(config.node);
    join.set_control_address(d->address_);
    join.set_data_address(d->backend_->data_address());
    join.set_incarnation(d->incarnation_);
    absl::Status joined = absl::UnavailableError("not tried");
    const absl::Time until = absl::Now() + config.peer_timeout * 4;
    while (absl::Now() < until) {
      grpc::ClientContext ctx;
      ctx.set_deadline(Deadline(config.peer_timeout));
      v1::JoinResponse out;
      joined = FromGrpc(d->PeerStub(config.coordinator)->Join(&ctx, join, &out));
      if (joined.ok()) break;
      absl::SleepFor(absl::Milliseconds(200));
    }
    if (!joined.ok()) {
      return absl::UnavailableError(absl::StrCat("cannot join the coordinator at ", config.coordinator,
                                                 ": ", joined.message()));
    }
    d->heartbeat_ = std::thread([p = d.get()] { p->HeartbeatLoop(); });
  }
  if (!config.address_file.empty()) {
    std::ofstream(config.address_file) << d->address_ << " " << config.worker_socket << "\n";
  }
  return d;
}

absl::Status Daemon::Serve() {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config_.listen, grpc::InsecureServerCredentials(), &port);
  unlink(config_.worker_socket.c_str());  // a stale socket from a dead daemon
  builder.AddListeningPort("unix:" + config_.worker_socket, grpc::InsecureServerCredentials());
  builder.SetMaxReceiveMessageSize(static_cast<int>(config_.max_rpc_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config_.max_rpc_bytes));
  // Workers ping their session every second to notice a dead or frozen daemon within about a
  // second (WorkerClient, the Python worker). By default a server takes pings without data at
  // most every 5 minutes and closes the connection after 2 more ("too_many_pings").
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);  // 0: no limit
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  services_.push_back(std::make_unique<WorkerService>(this));
  services_.push_back(std::make_unique<ControlService>(this));
  services_.push_back(std::make_unique<PeerService>(this));
  for (auto& s : services_) builder.RegisterService(s.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", config_.listen, " and unix:",
                                               config_.worker_socket));
  }
  const std::string host = config_.listen.substr(0, config_.listen.rfind(':'));
  address_ = absl::StrCat(host, ":", port);
  return absl::OkStatus();
}

Daemon::~Daemon() {
  Shutdown();
  if (heartbeat_.joinable()) heartbeat_.join();
  if (monitor_.joinable()) monitor_.join();
  for (std::thread& t : background_) t.join();  // rounds started by StartRefit end by deadlines
  if (server_) server_->Wait();
  unlink(config_.worker_socket.c_str());
}

void Daemon::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  changed_.notify_all();
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

void Daemon::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait(lock, [&] { return stopping_; });
}

// ----------------------------------------------------------------------------------------------
// Stubs.

v1::RefitPeer::Stub* Daemon::PeerStub(const std::string& address) {
  std::lock_guard<std::mutex> lock(stubs_mu_);
  auto& stub = peer_stubs_[address];
  if (!stub) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(static_cast<int>(config_.max_rpc_bytes));
    args.SetMaxSendMessageSize(static_cast<int>(config_.max_rpc_bytes));
    stub = v1::RefitPeer::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }
  return stub.get();
}

v1::RefitControl::Stub* Daemon::CoordinatorStub() {
  std::lock_guard<std::mutex> lock(stubs_mu_);
  if (!coordinator_stub_) {
    coordinator_stub_ = v1::RefitControl::NewStub(
        grpc::CreateChannel(config_.coordinator, grpc::InsecureChannelCredentials()));
  }
  return coordinator_stub_.get();
}

// ----------------------------------------------------------------------------------------------
// Workers on this node.

absl::Status Daemon::Register(const v1::RegisterWorkerRequest& original,
                              v1::RegisterWorkerResponse* response) {
  // The descriptors handed over under the token are claimed first, whatever happens next: they
  // are closed when this returns (mapped memory stays mapped), so a registration that fails
  // leaves nothing behind; the worker hands them over again under a new token.
  HandleDelivery delivery;
  if (!original.fd_token().empty()) {
    const std::string& token = original.fd_token();
    if (token.size() != kHandleTokenChars ||
        !std::all_of(token.begin(), token.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); })) {
      return absl::InvalidArgumentError(absl::StrCat("register: worker \"", original.worker().name(),
                                                     "\": fd_token must be ", kHandleTokenChars, " lowercase hex digits"));
    }
    auto taken = handles_->Take(token);
    if (!taken.ok()) {
      return absl::Status(taken.status().code(), absl::StrCat("register: worker \"", original.worker().name(),
                                                              "\": ", taken.status().message()));
    }
    delivery = *std::move(taken);
  }
  auto worker = std::make_shared<LocalWorker>();
  worker->request = original;  // worker.node (and worker.gpu, from gpu_uuid) filled in below
  const v1::RegisterWorkerRequest& request = worker->request;
  const v1::Worker& w = request.worker();
  if (request.group().empty()) return absl::InvalidArgumentError("register: \"group\" is empty");
  if (request.role() != v1::TRAINER && request.role() != v1::INFERENCE) {
    return absl::InvalidArgumentError("register: role must be TRAINER or INFERENCE");
  }
  if (w.name().empty() || w.name().find('/') != std::string::npos) {
    return absl::InvalidArgumentError("register: the worker needs a name without '/'");
  }
  if (request.memory_size() != w.buffers_size()) {
    return absl::InvalidArgumentError(absl::StrCat("register: worker \"", w.name(), "\" has ",
                                                   w.buffers_size(), " buffers but ",
                                                   request.memory_size(), " memory handles"));
  }
  if (!request.gpu_uuid().empty()) {
    // The worker's CUDA index is its own (CUDA_VISIBLE_DEVICES); the UUID is everyone's.
    auto gpu = backend_->GpuIndex(request.gpu_uuid());
    if (!gpu.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("register: worker \"", w.name(), "\": ", gpu.status().message()));
    }
    worker->request.mutable_worker()->set_gpu(*gpu);
  }
  if (!config_.gpus.empty() &&
      std::find(config_.gpus.begin(), config_.gpus.end(), w.gpu()) == config_.gpus.end()) {
    return absl::InvalidArgumentError(absl::StrCat("register: worker \"", w.name(), "\" is on GPU ",
                                                   w.gpu(), ", which node ", config_.node,
                                                   "'s daemon does not serve (--gpus ",
                                                   absl::StrJoin(config_.gpus, ","), ")"));
  }
  // The worker's own part of the layout must be well formed before it joins a group.
  v1::Layout mine;
  *mine.mutable_tensors() = request.tensors();
  *mine.add_workers() = w;
  mine.mutable_workers(0)->set_node(config_.node);
  auto layout = LayoutFromProto(mine);
  if (!layout.ok()) return absl::InvalidArgumentError(absl::StrCat("register: ", layout.status().message()));
  if (auto s = ValidateLayout(*layout, RoleName(request.role())); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("register: ", s.message()));
  }
  worker->id = absl::StrCat(request.group(), "/", w.name());
  worker->request.mutable_worker()->set_node(config_.node);
  std::vector<int64_t> bytes;
  bytes.reserve(layout->buffers.size());
  for (const Buffer& b : layout->buffers) bytes.push_back(b.NumBytes());
  if (auto s = CheckMemoryRefs(request, bytes, delivery.fds.size()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("register: worker \"", w.name(), "\": ", s.message()));
  }
  auto mapped = backend_->MapBuffers(request, bytes, delivery.fds);
  if (!mapped.ok()) {
    return absl::Status(mapped.status().code(),
                        absl::StrCat("register: worker \"", w.name(), "\": ", mapped.status().message()));
  }
  worker->buffers = *std::move(mapped);
  for (int b = 0; b < w.buffers_size(); ++b) worker->buffer_index[w.buffers(b).name()] = b;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (workers_.contains(worker->id)) {
      return absl::AlreadyExistsError(absl::StrCat("worker \"", worker->id,
                                                   "\" is already registered on node ", config_.node,
                                                   "; unregister it first"));
    }
    workers_[worker->id] = worker;
  }
  if (auto s = SyncToCoordinator(&worker->request, ""); !s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    workers_.erase(worker->id);
    return absl::UnavailableError(absl::StrCat("register: the coordinator did not take the worker: ",
                                               s.message()));
  }
  Logger("worker")->info("registered {} ({}, GPU {}, {} buffers, {} pieces total in layout{})", worker->id,
                         RoleName(request.role()), w.gpu(), w.buffers_size(), layout->pieces.size(),
                         original.fd_token().empty()
                             ? std::string()
                             : absl::StrCat("; ", delivery.fds.size(), " descriptors handed over by pid ", delivery.pid,
                                            " uid ", delivery.uid));
  response->set_worker_id(worker->id);
  response->set_node(config_.node);
  response->set_version(0);
  return absl::OkStatus();
}

std::shared_ptr<Daemon::LocalWorker> Daemon::FindWorker(const std::string& id) {
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : it->second;
}

void Daemon::DropWorker(const std::string& id, const std::string& reason) {
  std::string group;
  int64_t round = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto w = FindWorker(id);
    if (w == nullptr) return;
    w->gone = true;
    w->wake.notify_all();
    group = w->request.group();
    workers_.erase(id);
    if (auto it = active_rounds_.find(group); it != active_rounds_.end()) round = it->second;
  }
  changed_.notify_all();
  Logger("worker")->warn("worker {} left: {}", id, reason);
  SyncToCoordinator(nullptr, id).IgnoreError();
  // A round of its group cannot complete any more: end this node's transfer now.
  if (round >= 0) {
    backend_->Cancel(group, round, absl::StrCat("worker \"", id, "\" on node ", config_.node, " left: ", reason));
  }
}

void Daemon::Push(LocalWorker& w, v1::RoundEvent event) {
  w.outbox.push_back(std::move(event));
  w.wake.notify_all();
}

absl::Status Daemon::Session(grpc::ServerContext* context,
                             grpc::ServerReaderWriter<v1::RoundEvent, v1::WorkerMessage>* stream) {
  v1::WorkerMessage hello;
  if (!stream->Read(&hello) || hello.kind_case() != v1::WorkerMessage::kHello) {
    return absl::InvalidArgumentError("a session starts with hello(worker_id)");
  }
  std::shared_ptr<LocalWorker> w;
  {
    std::lock_guard<std::mutex> lock(mu_);
    w = FindWorker(hello.hello());
    if (w == nullptr) return absl::NotFoundError(absl::StrCat("no worker \"", hello.hello(), "\" on node ", config_.node));
    if (w->has_session) return absl::AlreadyExistsError(absl::StrCat("worker \"", w->id, "\" already has a session"));
    w->has_session = true;
  }
  // Reads on their own thread; this one writes. A worker's session ending means the worker is gone.
  std::atomic<bool> reader_done{false};
  std::thread reader([&] {
    v1::WorkerMessage m;
    while (stream->Read(&m)) {
      std::lock_guard<std::mutex> lock(mu_);
      if (m.kind_case() == v1::WorkerMessage::kPrepared) w->prepared_round = m.prepared();
      if (m.kind_case() == v1::WorkerMessage::kResumed) w->resumed_round = m.resumed();
      if (m.kind_case() == v1::WorkerMessage::kRefused) {
        w->refused_round = m.refused().round_id();
        w->refused_reason = m.refused().reason().substr(0, 4096);  // it reaches operators: bounded
        Logger("worker")->warn("worker {} refused round {}: {}", w->id, w->refused_round, w->refused_reason);
      }
      changed_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    reader_done = true;
    w->wake.notify_all();
  });
  while (true) {
    v1::RoundEvent event;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Its own condition variable: a thousand sessions must not all wake for every event.
      w->wake.wait_for(lock, std::chrono::milliseconds(200), [&] {
        return stopping_ || w->gone || reader_done || !w->outbox.empty() || context->IsCancelled();
      });
      if (stopping_ || w->gone || reader_done || context->IsCancelled()) break;
      if (w->outbox.empty()) continue;
      event = w->outbox.front();
      w->outbox.pop_front();
    }
    if (!stream->Write(event)) break;
  }
  context->TryCancel();  // unblocks the reader's Read
  reader.join();
  const bool unregistered = w->gone;
  if (!unregistered) {
    DropWorker(w->id, "its session ended (process exited or connection lost)");
  }
  return absl::OkStatus();
}

absl::Status Daemon::Unregister(const v1::UnregisterWorkerRequest& request) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (FindWorker(request.worker_id()) == nullptr) {
      return absl::NotFoundError(absl::StrCat("no worker \"", request.worker_id(), "\" on node ", config_.node));
    }
  }
  DropWorker(request.worker_id(), "unregistered");
  return absl::OkStatus();
}

v1::SyncWorkersRequest Daemon::LocalSnapshot() {
  v1::SyncWorkersRequest sync;
  sync.set_node(config_.node);
  sync.set_incarnation(incarnation_);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, w] : workers_) {
    v1::RegisterWorkerRequest* r = sync.add_workers();
    *r = w->request;
    r->clear_memory();  // handles stay on this node
    r->clear_vmm_ranges();
    r->clear_fd_token();
  }
  return sync;
}

absl::Status Daemon::SyncToCoordinator(const v1::RegisterWorkerRequest* added,
                                       const std::string& removed) {
  if (config_.is_coordinator()) {
    // In place: a snapshot per registration would make registering n workers O(n^2).
    std::lock_guard<std::mutex> lock(mu_);
    auto& mine = nodes_[config_.node].workers;
    if (added != nullptr) {
      mine.push_back(*added);
      mine.back().clear_memory();  // handles stay on this node
      mine.back().clear_vmm_ranges();
      mine.back().clear_fd_token();
      groups_[added->group()];
    }
    if (!removed.empty()) {
      std::erase_if(mine, [&](const v1::RegisterWorkerRequest& r) {
        return absl::StrCat(r.group(), "/", r.worker().name()) == removed;
      });
    }
    RecomputeEpochs();
    return absl::OkStatus();
  }
  // One sync at a time, snapshot taken inside: two registrations racing must not let an older
  // snapshot (without the newer worker) reach the coordinator last.
  std::lock_guard<std::mutex> order(sync_mu_);
  v1::SyncWorkersRequest sync = LocalSnapshot();
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(config_.peer_timeout));
  v1::SyncWorkersResponse out;
  return FromGrpc(PeerStub(config_.coordinator)->SyncWorkers(&ctx, sync, &out));
}

void Daemon::HeartbeatLoop() {
  v1::JoinRequest join;
  join.set_node(config_.node);
  join.set_control_address(address_);
  join.set_data_address(backend_->data_address());
  join.set_incarnation(incarnation_);
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait_for(lock, absl::ToChronoNanoseconds(config_.heartbeat), [&] { return stopping_; });
      if (stopping_) return;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(config_.peer_timeout));
    v1::JoinResponse out;
    const absl::Status s = FromGrpc(PeerStub(config_.coordinator)->Join(&ctx, join, &out));
    if (!s.ok()) {
      Logger("rpc")->warn("heartbeat to the coordinator at {} failed: {}", config_.coordinator, std::string(s.message()));
      continue;
    }
    if (out.resync()) SyncToCoordinator(nullptr, "").IgnoreError();  // the coordinator restarted
  }
}

absl::Status Daemon::AwaitWorkers(const std::string& group, const std::vector<std::string>& ids,
                                  int64_t round_id, bool resumed, absl::Duration timeout,
                                  const char* phase) {
  const absl::Time deadline = absl::Now() + timeout;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    std::vector<std::string> waiting;
    for (const std::string& id : ids) {
      auto w = FindWorker(id);
      if (w == nullptr) {
        return absl::AbortedError(absl::StrCat("worker \"", id, "\" on node ", config_.node,
                                               " left during ", phase));
      }
      if (!resumed && w->refused_round == round_id) {  // the round cannot happen: end it now
        return absl::AbortedError(absl::StrCat("worker \"", id, "\" on node ", config_.node, " refused ", phase,
                                               " of round ", round_id, ": ", w->refused_reason));
      }
      const int64_t seen = resumed ? w->resumed_round : w->prepared_round;
      if (seen != round_id) waiting.push_back(absl::StrCat("\"", id, "\""));
    }
    if (waiting.empty()) return absl::OkStatus();
    if (!resumed) {
      if (auto a = aborted_rounds_.find(group); a != aborted_rounds_.end() && a->second == round_id) {
        return absl::AbortedError(absl::StrCat("node ", config_.node, ": round ", round_id, " of group \"", group,
                                               "\" was aborted during ", phase));
      }
    }
    if (stopping_) return absl::UnavailableError("daemon shutting down");
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "node ", config_.node, ": worker", waiting.size() > 1 ? "s " : " ",
          absl::StrJoin(waiting, ", "), " did not confirm ", phase, " of group \"", group,
          "\" within ", absl::FormatDuration(timeout)));
    }
    changed_.wait_for(lock, std::chrono::milliseconds(50));
  }
}

// ----------------------------------------------------------------------------------------------
// This node's part of a round.

namespace {

// The planner options every daemon derives from an InstallPlan request: identical everywhere,
// so every daemon computes the identical plan.
PlanOptions OptionsFor(const v1::InstallPlanRequest& request) {
  PlanOptions options;
  options.max_message_bytes = request.max_message_bytes();
  options.routing = !request.no_routing();
  options.max_relay_depth = request.max_relay_depth();
  int32_t gpus = 1;
  for (const v1::Layout* l : {&request.source(), &request.destination()}) {
    for (const v1::Worker& w : l->workers()) gpus = std::max(gpus, w.gpu() + 1);
  }
  options.topology.gpus_per_node = gpus;
  options.topology.nics_per_node = gpus;
  return options;
}

const char* PhaseName(v1::PhaseRequest::Phase p) {
  switch (p) {
    case v1::PhaseRequest::PREPARE: return "PREPARE";
    case v1::PhaseRequest::TRANSFER: return "TRANSFER";
    case v1::PhaseRequest::COMMIT: return "COMMIT";
    case v1::PhaseRequest::ABORT: return "ABORT";
    default: return "?";
  }
}

}  // namespace

absl::Status Daemon::InstallPlan(const v1::InstallPlanRequest& request) {
  auto installed = std::make_shared<InstalledPlan>();
  installed->epoch = request.epoch();
  auto src = LayoutFromProto(request.source());
  auto dst = LayoutFromProto(request.destination());
  if (!src.ok()) return src.status();
  if (!dst.ok()) return dst.status();
  installed->src = *std::move(src);
  installed->dst = *std::move(dst);
  REFIT_RETURN_IF_ERROR(ValidateLayout(installed->src, "source"));
  REFIT_RETURN_IF_ERROR(ValidateLayout(installed->dst, "destination"));
  auto plan = MakePlan(installed->src, installed->dst, OptionsFor(request));
  if (!plan.ok()) return plan.status();
  installed->plan = std::make_shared<const Plan>(*std::move(plan));
  for (const v1::NodeAddress& n : request.nodes()) installed->data_addresses[n.node()] = n.data_address();
  installed->nccl_id = request.nccl_id();
  installed->step_bytes = request.step_bytes();
  installed->zero_copy_min_bytes = request.zero_copy_min_bytes();
  installed->nccl_register = request.nccl_register();
  Logger("plan")->info("group \"{}\" epoch {}: installed a plan of {} messages, {} bytes",
                       request.group(), request.epoch(), installed->plan->stats.messages,
                       installed->plan->stats.bytes_total);
  std::lock_guard<std::mutex> lock(mu_);
  installed_[request.group()] = installed;
  return absl::OkStatus();
}

absl::Status Daemon::RunPhase(const v1::PhaseRequest& request, v1::PhaseResponse* response) {
  const std::string& group = request.group();
  std::shared_ptr<InstalledPlan> installed;
  std::vector<std::string> ids;  // this node's workers in the plan
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = installed_.find(group);
    if (it != installed_.end()) installed = it->second;
  }
  if (request.phase() == v1::PhaseRequest::ABORT) {
    backend_->Cancel(group, request.round_id(), request.reason());
    std::lock_guard<std::mutex> lock(mu_);
    active_rounds_.erase(group);
    aborted_rounds_[group] = request.round_id();
    changed_.notify_all();  // a wait for this round's PREPARE ends now
    for (auto& [id, w] : workers_) {
      if (w->request.group() != group) continue;
      v1::RoundEvent e;
      e.set_kind(v1::RoundEvent::ABORT);
      e.set_round_id(request.round_id());
      e.set_version(request.version());
      e.set_reason(request.reason());
      Push(*w, e);
    }
    return absl::OkStatus();
  }
  if (installed == nullptr || installed->epoch != request.epoch()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", config_.node, " has no plan of group \"", group, "\" for membership epoch ",
        request.epoch()));
  }
  for (const Layout* l : {&installed->src, &installed->dst}) {
    for (const Worker& w : l->workers) {
      if (w.node == config_.node) ids.push_back(absl::StrCat(group, "/", w.name));
    }
  }
  const absl::Duration timeout = absl::Milliseconds(request.timeout_ms());
  switch (request.phase()) {
    case v1::PhaseRequest::PREPARE: {
      {
        std::lock_guard<std::mutex> lock(mu_);
        // What this node remembers of earlier rounds must not answer for this one: round ids
        // start again at 1 when the coordinator restarts.
        aborted_rounds_.erase(group);
        active_rounds_[group] = request.round_id();
        for (const std::string& id : ids) {
          auto w = FindWorker(id);
          if (w == nullptr) {
            return absl::AbortedError(absl::StrCat("worker \"", id, "\" is no longer on node ", config_.node));
          }
          // Answers about an earlier round of the same id (before a coordinator restart) are stale.
          w->prepared_round = -1;
          w->refused_round = -1;
          v1::RoundEvent e;
          e.set_kind(v1::RoundEvent::PREPARE);
          e.set_round_id(request.round_id());
          e.set_version(request.version());
          Push(*w, e);
        }
      }
      return AwaitWorkers(group, ids, request.round_id(), false, timeout, "PREPARE");
    }
    case v1::PhaseRequest::TRANSFER: {
      TransferJob job;
      job.requested = absl::Now();
      job.group = group;
      job.round_id = request.round_id();
      job.node = config_.node;
      job.plan = installed->plan;
      job.data_addresses = installed->data_addresses;
      job.deadline = absl::Now() + timeout;
      job.epoch = installed->epoch;
      job.nccl_id = installed->nccl_id;
      job.step_bytes = installed->step_bytes;
      job.zero_copy_min_bytes = installed->zero_copy_min_bytes;
      job.nccl_register = installed->nccl_register;
      std::vector<std::shared_ptr<LocalWorker>> hold;  // keeps mappings alive for the transfer
      // Each buffer of the plan on this node, found by name in its worker's registration (once
      // per worker, then by hash: linear over 100k buffers, not quadratic).
      auto resolve = [&](const Layout& l, BufferMemory& memory) -> absl::Status {
        memory.assign(l.buffers.size(), {});
        std::vector<LocalWorker*> by_worker(l.workers.size(), nullptr);
        for (size_t b = 0; b < l.buffers.size(); ++b) {
          const int32_t wi = l.buffers[b].worker;
          const Worker& w = l.workers[wi];
          if (w.node != config_.node) continue;
          if (by_worker[wi] == nullptr) {
            const std::string id = absl::StrCat(group, "/", w.name);
            auto local = FindWorker(id);
            if (local == nullptr) {
              return absl::AbortedError(absl::StrCat("worker \"", id, "\" left node ", config_.node));
            }
            by_worker[wi] = local.get();
            hold.push_back(std::move(local));
          }
          LocalWorker& local = *by_worker[wi];
          auto k = local.buffer_index.find(l.buffers[b].name);
          if (k == local.buffer_index.end()) {
            return absl::FailedPreconditionError(absl::StrCat("worker \"", local.id, "\" has no buffer \"",
                                                              l.buffers[b].name, "\""));
          }
          memory[b] = local.buffers[k->second]->bytes();
        }
        return absl::OkStatus();
      };
      {
        std::lock_guard<std::mutex> lock(mu_);
        // This node's workers of both layouts, as registered now.
        std::vector<std::shared_ptr<LocalWorker>> workers;
        for (const Layout* l : {&installed->src, &installed->dst}) {
          for (const Worker& w : l->workers) {
            if (w.node != config_.node) continue;
            workers.push_back(FindWorker(absl::StrCat(group, "/", w.name)));
          }
        }
        const auto& cached = installed->resolved;
        bool same = cached.has_value() && cached->workers.size() == workers.size();
        for (size_t i = 0; same && i < workers.size(); ++i) {
          same = workers[i] != nullptr && cached->workers[i].lock() == workers[i];
        }
        if (same) {
          job.src = cached->src;
          job.dst = cached->dst;
          hold = std::move(workers);
        } else {
          REFIT_RETURN_IF_ERROR(resolve(installed->src, job.src));
          REFIT_RETURN_IF_ERROR(resolve(installed->dst, job.dst));
          InstalledPlan::Resolved fresh{{}, job.src, job.dst};
          for (const auto& w : workers) fresh.workers.push_back(w);
          installed->resolved = std::move(fresh);
        }
      }
      auto stats = backend_->Transfer(job);
      if (!stats.ok()) return stats.status();
      response->set_bytes_sent(stats->bytes_sent);
      response->set_bytes_received(stats->bytes_received);
      response->set_bytes_local(stats->bytes_local);
      return absl::OkStatus();
    }
    case v1::PhaseRequest::COMMIT: {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const std::string& id : ids) {
          auto w = FindWorker(id);
          if (w == nullptr) {
            return absl::AbortedError(absl::StrCat("worker \"", id, "\" left node ", config_.node,
                                                   " before the commit"));
          }
          w->resumed_round = -1;  // its answer to this COMMIT, not to an earlier round of the same id
          v1::RoundEvent e;
          e.set_kind(v1::RoundEvent::COMMIT);
          e.set_round_id(request.round_id());
          e.set_version(request.version());
          Push(*w, e);
        }
      }
      const absl::Status s = AwaitWorkers(group, ids, request.round_id(), true, timeout, "COMMIT");
      std::lock_guard<std::mutex> lock(mu_);
      active_rounds_.erase(group);
      return s;
    }
    default:
      return absl::InvalidArgumentError("RunPhase: unknown phase");
  }
}

// ----------------------------------------------------------------------------------------------
// Coordinator: membership.

absl::Status Daemon::Join(const v1::JoinRequest& request, v1::JoinResponse* response) {
  if (!config_.is_coordinator()) {
    return absl::FailedPreconditionError(absl::StrCat("node ", config_.node, " is not the coordinator; it is ",
                                                      config_.coordinator));
  }
  if (request.node() == config_.node) {
    return absl::AlreadyExistsError(absl::StrCat("node ", request.node(), " is the coordinator's own index"));
  }
  {
    // The common case, a heartbeat from a known, live daemon: no need for mu_.
    std::lock_guard<std::mutex> lock(beat_mu_);
    auto it = beats_.find(request.node());
    if (it != beats_.end() && it->second.first == request.incarnation()) {
      it->second.second = absl::Now();
      return absl::OkStatus();
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  NodeInfo& n = nodes_[request.node()];
  {
    std::lock_guard<std::mutex> beat(beat_mu_);
    beats_[request.node()] = {request.incarnation(), absl::Now()};
  }
  if (n.incarnation != request.incarnation() || !n.alive) {
    if (n.incarnation != 0 && n.incarnation != request.incarnation()) {
      Logger("rpc")->warn("node {} restarted; its old workers are gone", request.node());
    }
    n.workers.clear();
    n.incarnation = request.incarnation();
    response->set_resync(true);
  }
  n.control_address = request.control_address();
  n.data_address = request.data_address();
  n.alive = true;
  RecomputeEpochs();
  return absl::OkStatus();
}

absl::Status Daemon::SyncWorkers(const v1::SyncWorkersRequest& request) {
  if (!config_.is_coordinator()) return absl::FailedPreconditionError("not the coordinator");
  std::lock_guard<std::mutex> lock(mu_);
  ApplySync(request);
  return absl::OkStatus();
}

void Daemon::ApplySync(const v1::SyncWorkersRequest& request) {
  NodeInfo& n = nodes_[request.node()];
  n.incarnation = request.incarnation();
  n.workers.assign(request.workers().begin(), request.workers().end());
  n.alive = true;
  if (request.node() != config_.node) {
    std::lock_guard<std::mutex> beat(beat_mu_);
    beats_[request.node()] = {request.incarnation(), absl::Now()};
  }
  for (const auto& w : n.workers) groups_[w.group()];  // a group exists once a worker names it
  RecomputeEpochs();
}

void Daemon::RecomputeEpochs() {
  std::map<std::string, std::vector<std::string>> members;
  std::map<std::string, std::set<int32_t>> nodes;
  std::map<std::string, std::pair<int, int>> counts;
  for (const auto& [node, info] : nodes_) {
    if (!info.alive) continue;
    for (const auto& w : info.workers) {
      members[w.group()].push_back(absl::StrCat(node, ":", info.incarnation, ":", w.worker().name(), ":", w.role()));
      nodes[w.group()].insert(node);
      (w.role() == v1::TRAINER ? counts[w.group()].first : counts[w.group()].second)++;
    }
  }
  for (auto& [name, g] : groups_) {
    auto& m = members[name];
    std::sort(m.begin(), m.end());
    const std::string fingerprint = absl::StrJoin(m, ",");
    if (fingerprint != g.fingerprint) {
      g.fingerprint = fingerprint;
      ++g.epoch;
    }
    g.nodes = nodes[name];
    g.trainers = counts[name].first;
    g.inference = counts[name].second;
  }
  changed_.notify_all();
}

void Daemon::MarkNodeDead(int32_t node, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = nodes_.find(node);
  if (it == nodes_.end() || !it->second.alive) return;
  it->second.alive = false;
  it->second.workers.clear();
  {
    std::lock_guard<std::mutex> beat(beat_mu_);
    beats_.erase(node);  // its next heartbeat takes the slow path and resyncs
  }
  Logger("rpc")->warn("node {} ({}) is dead: {}", node, it->second.control_address, why);
  dead_because_[node] = why;
  for (auto [call, end] = peer_calls_.equal_range(node); call != end; ++call) call->second->TryCancel();
  RecomputeEpochs();
}

void Daemon::MonitorLoop() {
  while (true) {
    std::vector<int32_t> silent;
    {
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait_for(lock, absl::ToChronoNanoseconds(config_.heartbeat), [&] { return stopping_; });
      if (stopping_) return;
    }
    {
      std::lock_guard<std::mutex> beat(beat_mu_);
      const absl::Time now = absl::Now();
      for (const auto& [node, seen] : beats_) {
        if (now - seen.second > config_.heartbeat * config_.heartbeats_missed) silent.push_back(node);
      }
    }
    for (int32_t node : silent) {
      MarkNodeDead(node, absl::StrCat("no heartbeat for ",
                                      absl::FormatDuration(config_.heartbeat * config_.heartbeats_missed)));
    }
  }
}

absl::Status Daemon::EnsurePlan(const std::string& group) {
  GroupState& g = groups_[group];
  if (g.planned_epoch == g.epoch) return g.plan_status;
  g.planned_epoch = g.epoch;
  g.src.Clear();
  g.dst.Clear();
  g.src.set_model(group + " trainers");
  g.dst.set_model(group + " inference");
  std::map<std::string, std::pair<v1::TensorSpec, std::string>> seen[2];  // name -> spec, worker
  for (const auto& [node, info] : nodes_) {
    if (!info.alive) continue;
    for (const auto& w : info.workers) {
      if (w.group() != group) continue;
      const int side = w.role() == v1::TRAINER ? 0 : 1;
      v1::Layout& l = side == 0 ? g.src : g.dst;
      for (const v1::TensorSpec& t : w.tensors()) {
        auto [it, added] = seen[side].emplace(t.name(), std::make_pair(t, w.worker().name()));
        if (added) {
          *l.add_tensors() = t;
        } else if (it->second.first.SerializeAsString() != t.SerializeAsString()) {
          g.plan_status = absl::FailedPreconditionError(absl::StrCat(
              "group \"", group, "\": workers \"", it->second.second, "\" and \"", w.worker().name(),
              "\" disagree on tensor \"", t.name(), "\" (shape or dtype)"));
          return g.plan_status;
        }
      }
      *l.add_workers() = w.worker();
    }
  }
  if (g.src.workers_size() == 0 || g.dst.workers_size() == 0) {
    g.plan_status = absl::FailedPreconditionError(absl::StrCat(
        "group \"", group, "\" is not ready: ", g.src.workers_size(), " trainers and ",
        g.dst.workers_size(), " inference workers registered; both sides are needed"));
    return g.plan_status;
  }
  v1::InstallPlanRequest probe;
  *probe.mutable_source() = g.src;
  *probe.mutable_destination() = g.dst;
  probe.set_max_message_bytes(config_.max_message_bytes);
  probe.set_no_routing(!config_.routing);
  probe.set_max_relay_depth(config_.max_relay_depth);
  auto src = LayoutFromProto(g.src);
  auto dst = LayoutFromProto(g.dst);
  absl::Status s = src.ok() ? dst.status() : src.status();
  if (s.ok()) s = ValidateLayout(*src, "source");
  if (s.ok()) s = ValidateLayout(*dst, "destination");
  if (s.ok()) {
    auto plan = MakePlan(*src, *dst, OptionsFor(probe));
    if (plan.ok()) {
      g.stats = plan->stats;
      Logger("plan")->info("group \"{}\" epoch {}: planned {} tensors, {} messages, {} bytes in {:.3f} s",
                           group, g.epoch, g.stats.tensors, g.stats.messages, g.stats.bytes_total,
                           g.stats.planning_seconds);
    }
    s = plan.status();
  }
  g.plan_status = s.ok() ? s
                         : absl::FailedPreconditionError(absl::StrCat(
                               "group \"", group, "\" is not ready: ", s.message()));
  return g.plan_status;
}

// ----------------------------------------------------------------------------------------------
// Coordinator: rounds.

absl::Status Daemon::CallPeer(int32_t node, const v1::PhaseRequest& request,
                              v1::PhaseResponse* response, absl::Duration timeout) {
  if (node == config_.node) return RunPhase(request, response);
  std::string address;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = nodes_.find(node);
    if (it == nodes_.end() || !it->second.alive) {
      return absl::UnavailableError(absl::StrCat("node ", node, " is not alive"));
    }
    address = it->second.control_address;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(timeout + config_.peer_timeout));
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = nodes_.find(node);
    if (it == nodes_.end() || !it->second.alive) {
      return absl::UnavailableError(absl::StrCat("node ", node, " is not alive"));
    }
    peer_calls_.emplace(node, &ctx);
  }
  if (request.phase() == v1::PhaseRequest::TRANSFER) {  // to compare with the peer's arrival time
    Logger("round")->info("group \"{}\" round {}: TRANSFER sent to node {} at {}", request.group(), request.round_id(),
                          node, absl::FormatTime("%H:%M:%E6S", absl::Now(), absl::LocalTimeZone()));
  }
  absl::Status s = FromGrpc(PeerStub(address)->RunPhase(&ctx, request, response));
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto [it, end] = peer_calls_.equal_range(node); it != end; ++it) {
      if (it->second == &ctx) {
        peer_calls_.erase(it);
        break;
      }
    }
    auto dead = dead_because_.find(node);
    if (!s.ok() && dead != dead_because_.end() && (nodes_.count(node) == 0 || !nodes_[node].alive)) {
      s = absl::UnavailableError(absl::StrCat("node ", node, " (", address, ") died during ", PhaseName(request.phase()),
                                              ": ", dead->second));
    }
  }
  if (s.ok()) return s;
  // Say which node failed, unless its own message already does.
  const std::string prefix = absl::StrCat("node ", node);
  if (std::string(s.message()).rfind(prefix, 0) == 0) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, " (", address, ") failed ",
                                             PhaseName(request.phase()), ": ", s.message()));
}

absl::Status Daemon::CallInstall(int32_t node, const v1::InstallPlanRequest& request) {
  if (node == config_.node) return InstallPlan(request);
  std::string address;
  {
    std::lock_guard<std::mutex> lock(mu_);
    address = nodes_[node].control_address;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(config_.peer_timeout * 4));
  v1::InstallPlanResponse out;
  const absl::Status s = FromGrpc(PeerStub(address)->InstallPlan(&ctx, request, &out));
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("node ", node, " (", address, ") could not install the plan: ",
                                             s.message()));
}

void Daemon::Publish(const v1::RoundStats& stats) {
  std::lock_guard<std::mutex> lock(mu_);
  round_log_.push_back(stats);
  while (round_log_.size() > 1024) {
    round_log_.pop_front();
    ++round_log_start_;
  }
  changed_.notify_all();
}

absl::Status Daemon::RunRound(const std::string& group, int64_t round_id, int64_t version,
                              v1::RoundStats* stats) {
  const absl::Time start = absl::Now();
  stats->set_group(group);
  stats->set_round_id(round_id);
  stats->set_version(version);
  stats->set_state(v1::RoundStats::PREPARING);
  v1::InstallPlanRequest install;
  std::vector<int32_t> nodes, to_install;
  int64_t epoch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    GroupState& g = groups_[group];
    if (auto s = EnsurePlan(group); !s.ok()) return s;
    epoch = g.epoch;
    nodes.assign(g.nodes.begin(), g.nodes.end());
    install.set_group(group);
    install.set_epoch(epoch);
    *install.mutable_source() = g.src;
    *install.mutable_destination() = g.dst;
    install.set_max_message_bytes(config_.max_message_bytes);
    install.set_step_bytes(config_.staging_bytes / 2);
    install.set_no_routing(!config_.routing);
    install.set_max_relay_depth(config_.max_relay_depth);
    install.set_zero_copy_min_bytes(config_.zero_copy_min_bytes);
    install.set_nccl_register(config_.nccl_register);
    for (const auto& [node, info] : nodes_) {
      if (!info.alive) continue;
      v1::NodeAddress* a = install.add_nodes();
      a->set_node(node);
      a->set_data_address(info.data_address);
    }
    for (int32_t n : nodes) {
      if (g.installed_epoch[n] != epoch) to_install.push_back(n);
    }
  }
  Publish(*stats);
  Logger("round")->info("group \"{}\" round {} -> version {} on nodes [{}]", group, round_id, version,
                        absl::StrJoin(nodes, ", "));

  // Runs `call` on every node in parallel. The first failure is the round's reason; during a
  // transfer it also aborts the others at once, so nobody waits for a dead peer's messages.
  std::atomic<bool> cancelled{false};
  auto abort_all = [&](const std::string& reason) {
    if (cancelled.exchange(true)) return;
    v1::PhaseRequest abort;
    abort.set_phase(v1::PhaseRequest::ABORT);
    abort.set_group(group);
    abort.set_round_id(round_id);
    abort.set_version(version);
    abort.set_epoch(epoch);
    abort.set_reason(reason);
    std::vector<std::thread> threads;
    for (int32_t n : nodes) {
      threads.emplace_back([&, n] {
        v1::PhaseResponse ignored;
        CallPeer(n, abort, &ignored, config_.peer_timeout).IgnoreError();
      });
    }
    for (auto& t : threads) t.join();
  };
  auto on_all = [&](const std::vector<int32_t>& targets, auto call, bool cancel_on_error) -> absl::Status {
    std::mutex m;
    absl::Status first;
    std::vector<std::thread> threads;
    // Remote nodes first, this node last: the peers' requests are on their way before this
    // node's own part starts (in a transfer, whoever starts first waits for the rest in NCCL).
    std::vector<int32_t> order;
    for (int32_t n : targets) {
      if (n != config_.node) order.push_back(n);
    }
    for (int32_t n : targets) {
      if (n == config_.node) order.push_back(n);
    }
    for (int32_t n : order) {
      threads.emplace_back([&, n] {
        absl::Status s = call(n);
        if (s.ok()) return;
        {
          std::lock_guard<std::mutex> lock(m);
          if (!first.ok()) return;
          first = s;
        }
        if (cancel_on_error) abort_all(std::string(s.message()));
      });
    }
    for (auto& t : threads) t.join();
    return first;
  };
  absl::Status status;
  if (!to_install.empty()) {  // a new membership: a new communicator (cuda backend)
    auto id = backend_->NewCommunicatorId();
    if (id.ok()) install.set_nccl_id(*id); else status = id.status();
  }
  if (status.ok()) status = on_all(to_install, [&](int32_t n) { return CallInstall(n, install); }, false);
  if (status.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int32_t n : to_install) groups_[group].installed_epoch[n] = epoch;
  }
  auto phase = [&](v1::PhaseRequest::Phase p, absl::Duration timeout, std::atomic<int64_t>* bytes) {
    v1::PhaseRequest r;
    r.set_phase(p);
    r.set_group(group);
    r.set_round_id(round_id);
    r.set_version(version);
    r.set_epoch(epoch);
    r.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    return on_all(nodes, [&, r](int32_t n) {
      v1::PhaseResponse out;
      absl::Status s = CallPeer(n, r, &out, timeout);
      if (bytes) *bytes += out.bytes_received() + out.bytes_local();
      return s;
    // A failed PREPARE (a refusal, a worker gone) or TRANSFER aborts every node at once: nobody
    // waits out the phase's deadline for a round that cannot commit.
    }, p == v1::PhaseRequest::TRANSFER || p == v1::PhaseRequest::PREPARE);
  };
  absl::Time t = absl::Now();
  if (status.ok()) status = phase(v1::PhaseRequest::PREPARE, config_.prepare_timeout, nullptr);
  stats->set_prepare_seconds(absl::ToDoubleSeconds(absl::Now() - t));
  std::atomic<int64_t> bytes{0};
  if (status.ok()) {
    stats->set_state(v1::RoundStats::TRANSFERRING);
    Publish(*stats);
    t = absl::Now();
    status = phase(v1::PhaseRequest::TRANSFER, config_.transfer_timeout, &bytes);
    stats->set_transfer_seconds(absl::ToDoubleSeconds(absl::Now() - t));
  }
  if (status.ok()) {
    t = absl::Now();
    status = phase(v1::PhaseRequest::COMMIT, config_.commit_timeout, nullptr);
    stats->set_commit_seconds(absl::ToDoubleSeconds(absl::Now() - t));
  }
  stats->set_bytes(bytes);
  stats->set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  if (status.ok()) {
    stats->set_state(v1::RoundStats::COMMITTED);
    Logger("round")->info("group \"{}\" round {}: version {} committed, {} bytes in {:.3f} s", group,
                          round_id, version, stats->bytes(), stats->seconds());
  } else {
    abort_all(std::string(status.message()));
    {
      // The next round installs the plan again, with a fresh communicator: an aborted one is gone.
      std::lock_guard<std::mutex> lock(mu_);
      groups_[group].installed_epoch.clear();
    }
    stats->set_state(v1::RoundStats::ABORTED);
    stats->set_reason(std::string(status.message()));
    Logger("round")->warn("group \"{}\" round {} aborted: {}", group, round_id, std::string(status.message()));
  }
  Publish(*stats);
  return status.ok() ? status : absl::AbortedError(absl::StrCat("round ", round_id, " of group \"", group,
                                                                "\" aborted: ", status.message()));
}

namespace {

// Forwards a unary operator call to the coordinator.
template <typename Request, typename Response, typename Method>
absl::Status Forward(v1::RefitControl::Stub* stub, Method method, const Request& request,
                     Response* response, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(timeout));
  return FromGrpc((stub->*method)(&ctx, request, response));
}

}  // namespace

absl::Status Daemon::Refit(const v1::RefitRequest& request, v1::RoundStats* stats) {
  const absl::Duration round_timeout = config_.prepare_timeout + config_.transfer_timeout +
                                       config_.commit_timeout + config_.peer_timeout * 6;
  if (!config_.is_coordinator()) {
    return Forward(CoordinatorStub(), &v1::RefitControl::Stub::Refit, request, stats, round_timeout);
  }
  auto round_id = BeginRound(request);
  if (!round_id.ok()) return round_id.status();
  return FinishRound(request, *round_id, stats);
}

absl::StatusOr<int64_t> Daemon::BeginRound(const v1::RefitRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = groups_.find(request.group());
  if (it == groups_.end()) {
    std::vector<std::string> known;
    for (const auto& [name, g] : groups_) known.push_back(name);
    return absl::NotFoundError(absl::StrCat("no model group \"", request.group(), "\" (known: ",
                                            known.empty() ? "none" : absl::StrJoin(known, ", "), ")"));
  }
  GroupState& g = it->second;
  if (request.version() <= 0) return absl::InvalidArgumentError("version must be positive");
  if (g.busy) {
    return absl::AbortedError(absl::StrCat("group \"", request.group(), "\" is already running a round"));
  }
  if (request.version() <= g.version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "version ", request.version(), " is not newer than group \"", request.group(),
        "\"'s committed version ", g.version));
  }
  if (auto s = EnsurePlan(request.group()); !s.ok()) return s;
  g.busy = true;
  return next_round_++;
}

absl::Status Daemon::FinishRound(const v1::RefitRequest& request, int64_t round_id,
                                 v1::RoundStats* stats) {
  const absl::Status s = RunRound(request.group(), round_id, request.version(), stats);
  std::lock_guard<std::mutex> lock(mu_);
  GroupState& g = groups_[request.group()];
  g.busy = false;
  if (s.ok()) g.version = request.version();
  return s;
}

absl::Status Daemon::StartRefit(const v1::RefitRequest& request, v1::StartRefitResponse* response) {
  if (!config_.is_coordinator()) {
    return Forward(CoordinatorStub(), &v1::RefitControl::Stub::StartRefit, request, response,
                   config_.peer_timeout);
  }
  // Checked now (a stale version is refused here); run on a thread the daemon joins at shutdown.
  auto round_id = BeginRound(request);
  if (!round_id.ok()) return round_id.status();
  response->set_round_id(*round_id);
  std::lock_guard<std::mutex> lock(mu_);
  background_.emplace_back([this, request, id = *round_id] {
    v1::RoundStats stats;
    FinishRound(request, id, &stats).IgnoreError();  // the outcome goes to WatchRounds
  });
  return absl::OkStatus();
}

absl::Status Daemon::WatchRounds(grpc::ServerContext* context, const v1::WatchRoundsRequest& request,
                                 grpc::ServerWriter<v1::RoundStats>* writer) {
  if (!config_.is_coordinator()) {
    grpc::ClientContext ctx;
    auto reader = CoordinatorStub()->WatchRounds(&ctx, request);
    v1::RoundStats s;
    while (!context->IsCancelled() && reader->Read(&s)) {
      if (!writer->Write(s)) break;
    }
    ctx.TryCancel();
    return absl::OkStatus();
  }
  int64_t next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    next = round_log_start_ + static_cast<int64_t>(round_log_.size());
  }
  while (true) {
    std::vector<v1::RoundStats> batch;
    {
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait_for(lock, std::chrono::milliseconds(200), [&] {
        return stopping_ || round_log_start_ + static_cast<int64_t>(round_log_.size()) > next;
      });
      if (stopping_ || context->IsCancelled()) return absl::OkStatus();
      next = std::max(next, round_log_start_);
      for (; next < round_log_start_ + static_cast<int64_t>(round_log_.size()); ++next) {
        const v1::RoundStats& s = round_log_[next - round_log_start_];
        if (request.group().empty() || request.group() == s.group()) batch.push_back(s);
      }
    }
    for (const auto& s : batch) {
      if (!writer->Write(s)) return absl::OkStatus();
    }
  }
}

absl::Status Daemon::Status(v1::StatusResponse* response) {
  if (!config_.is_coordinator()) {
    return Forward(CoordinatorStub(), &v1::RefitControl::Stub::Status, v1::StatusRequest(), response,
                   config_.peer_timeout);
  }
  std::lock_guard<std::mutex> lock(mu_);
  response->set_coordinator(address_);
  for (const auto& [node, info] : nodes_) {
    v1::NodeStatus* n = response->add_nodes();
    n->set_node(node);
    n->set_address(info.control_address);
    n->set_alive(info.alive);
    n->set_workers(static_cast<int32_t>(info.workers.size()));
  }
  for (auto& [name, g] : groups_) {
    const absl::Status s = EnsurePlan(name);
    v1::GroupStatus* out = response->add_groups();
    out->set_name(name);
    out->set_ready(s.ok());
    if (!s.ok()) out->set_not_ready_reason(std::string(s.message()));
    out->set_trainers(g.trainers);
    out->set_inference_workers(g.inference);
    out->set_version(g.version);
    if (s.ok()) *out->mutable_plan() = SummaryToProto(g.stats, false);
    out->set_planned_at_membership(g.planned_epoch);
  }
  return absl::OkStatus();
}

absl::Status Daemon::ListWorkers(const v1::ListWorkersRequest& request, v1::ListWorkersResponse* response) {
  if (!config_.is_coordinator()) {
    return Forward(CoordinatorStub(), &v1::RefitControl::Stub::ListWorkers, request, response,
                   config_.peer_timeout);
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [node, info] : nodes_) {
    if (!info.alive) continue;
    for (const auto& w : info.workers) {
      if (!request.group().empty() && w.group() != request.group()) continue;
      v1::WorkerInfo* out = response->add_workers();
      out->set_worker_id(absl::StrCat(w.group(), "/", w.worker().name()));
      out->set_group(w.group());
      out->set_role(w.role());
      out->set_node(node);
      out->set_gpu(w.worker().gpu());
      out->set_buffers(w.worker().buffers_size());
      int32_t pieces = 0;
      int64_t bytes = 0;
      for (const auto& b : w.worker().buffers()) {
        pieces += b.pieces_size();
        int64_t n = 1;
        for (int64_t d : b.shape()) n *= d;
        auto dtype = ParseDType(b.dtype());
        bytes += n * (dtype.ok() ? DTypeSize(*dtype) : 0);
      }
      out->set_pieces(pieces);
      out->set_bytes(bytes);
      out->set_connected(true);
    }
  }
  return absl::OkStatus();
}

absl::Status Daemon::GetPlan(const v1::GetPlanRequest& request, v1::PlanSummary* response) {
  if (!config_.is_coordinator()) {
    return Forward(CoordinatorStub(), &v1::RefitControl::Stub::GetPlan, request, response,
                   config_.peer_timeout);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!groups_.contains(request.group())) {
    return absl::NotFoundError(absl::StrCat("no model group \"", request.group(), "\""));
  }
  REFIT_RETURN_IF_ERROR(EnsurePlan(request.group()));
  *response = SummaryToProto(groups_[request.group()].stats, false);
  return absl::OkStatus();
}

}  // namespace refit
