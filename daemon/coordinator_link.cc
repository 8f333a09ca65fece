#include "daemon/coordinator_link.h"

#include "absl/strings/str_cat.h"
#include "daemon/logging.h"

namespace refit {
namespace {

std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoNanoseconds(d);
}

// A coordinator that restarts is reached again within a second, not after gRPC's default
// reconnect back-off (1 s doubling up to 120 s: peers took 6-25 s to rejoin).
grpc::ChannelArguments ChannelArgs(int64_t max_rpc_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(max_rpc_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(max_rpc_bytes));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return args;
}

}  // namespace

CoordinatorLink::CoordinatorLink(CoordinatorLinkOptions options) : options_(std::move(options)) {}

CoordinatorLink::~CoordinatorLink() { Stop(); }

v1::RefitPeer::Stub* CoordinatorLink::Peer() {
  absl::MutexLock lock(&mu_);
  if (!peer_) {
    peer_ = v1::RefitPeer::NewStub(grpc::CreateCustomChannel(options_.coordinator, grpc::InsecureChannelCredentials(),
                                                             ChannelArgs(options_.max_rpc_bytes)));
  }
  return peer_.get();
}

v1::RefitControl::Stub* CoordinatorLink::Control() {
  absl::MutexLock lock(&mu_);
  if (!control_) {
    control_ = v1::RefitControl::NewStub(grpc::CreateCustomChannel(
        options_.coordinator, grpc::InsecureChannelCredentials(), ChannelArgs(options_.max_rpc_bytes)));
  }
  return control_.get();
}

absl::Status CoordinatorLink::Join(const std::string& control_address, const std::string& data_address) {
  join_.set_node(options_.node);
  join_.set_control_address(control_address);
  join_.set_data_address(data_address);
  join_.set_incarnation(options_.incarnation);
  absl::Status joined = absl::UnavailableError("not tried");
  const absl::Time until = absl::Now() + options_.peer_timeout * 4;
  while (absl::Now() < until) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(options_.peer_timeout));
    v1::JoinResponse out;
    joined = FromGrpc(Peer()->Join(&ctx, join_, &out));
    if (joined.ok()) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  if (!joined.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot join the coordinator at ", options_.coordinator, ": ", joined.message()));
  }
  heartbeat_ = std::thread([this] { HeartbeatLoop(); });
  return absl::OkStatus();
}

absl::Status CoordinatorLink::Sync(std::vector<v1::WorkerRefusal>* refused) {
  absl::MutexLock order(&sync_order_);
  v1::SyncWorkersRequest sync;
  sync.set_node(options_.node);
  sync.set_incarnation(options_.incarnation);
  for (v1::RegisterWorkerRequest& w : options_.snapshot()) *sync.add_workers() = std::move(w);
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(options_.peer_timeout));
  v1::SyncWorkersResponse out;
  const absl::Status s = FromGrpc(Peer()->SyncWorkers(&ctx, sync, &out));
  for (const v1::WorkerRefusal& r : out.refused()) {
    Logger("rpc")->warn("the coordinator did not admit {}: {}", r.worker_id(), r.reason());
    if (refused != nullptr) refused->push_back(r);
  }
  return s;
}

void CoordinatorLink::HeartbeatLoop() {
  bool lost = false;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (!stopping_) stop_.WaitWithTimeout(&mu_, options_.heartbeat);
      if (stopping_) return;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(options_.peer_timeout));
    ctx.set_wait_for_ready(true);  // a coordinator coming back is joined as soon as it listens
    v1::JoinResponse out;
    const absl::Status s = FromGrpc(Peer()->Join(&ctx, join_, &out));
    if (!s.ok()) {
      Logger("rpc")->warn("heartbeat to the coordinator at {} failed: {}", options_.coordinator, std::string(s.message()));
      lost = true;
      continue;
    }
    if (lost) Logger("rpc")->info("the coordinator at {} answers again", options_.coordinator);
    lost = false;
    if (options_.on_answer) options_.on_answer(out.resync());
    if (out.resync()) Sync().IgnoreError();  // the coordinator restarted, or declared this node dead
  }
}

void CoordinatorLink::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    stop_.SignalAll();
  }
  if (heartbeat_.joinable()) heartbeat_.join();
}

void CoordinatorLink::ForwardWatch(const v1::WatchRoundsRequest& request, const std::function<bool()>& cancelled,
                                   const std::function<bool(const v1::RoundStats&)>& write) {
  grpc::ClientContext ctx;
  auto reader = Control()->WatchRounds(&ctx, request);
  v1::RoundStats s;
  while (!cancelled() && reader->Read(&s)) {
    if (!write(s)) break;
  }
  ctx.TryCancel();
}

}  // namespace refit
