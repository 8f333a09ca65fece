#include "daemon/node/coordinator_link.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "common/watch_protocol.h"
#include "daemon/base/logging.h"

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

constexpr absl::string_view kFilePrefix = "file:";

// The target named in `path` (first line, trimmed); empty when it cannot be read or is empty.
std::string ReadTarget(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  return std::string(absl::StripAsciiWhitespace(line));
}

}  // namespace

CoordinatorLink::CoordinatorLink(CoordinatorLinkOptions options) : options_(std::move(options)) {
  absl::string_view path = options_.coordinator;
  if (absl::ConsumePrefix(&path, kFilePrefix)) {
    target_ = ReadTarget(std::string(path));
    if (target_.empty()) {
      Logger("rpc")->warn("{} names no coordinator yet; joining waits for it", std::string(path));
    }
  } else {
    target_ = options_.coordinator;
  }
}

std::string CoordinatorLink::Target() {
  absl::MutexLock lock(&mu_);
  return target_;
}

void CoordinatorLink::Refresh() {
  absl::string_view path = options_.coordinator;
  if (!absl::ConsumePrefix(&path, kFilePrefix)) return;
  const std::string now = ReadTarget(std::string(path));
  if (now.empty()) return;  // a file being rewritten, or removed: keep the last target
  absl::MutexLock lock(&mu_);
  if (now == target_) return;
  Logger("rpc")->info("{} now names the coordinator at {} (was {})", std::string(path), now,
                      target_.empty() ? "none" : target_);
  target_ = now;
  peer_.reset();  // calls in flight keep their stubs (shared)
  sync_peer_.reset();
  control_.reset();
}

CoordinatorLink::~CoordinatorLink() { Stop(); }

std::shared_ptr<grpc::Channel> CoordinatorLink::NewChannel(bool own_connection) {
  grpc::ChannelArguments args = ChannelArgs(options_.max_rpc_bytes);
  // Syncs travel on a connection of their own: a list of hundreds of MB on the heartbeats'
  // connection held them up past the death verdict.
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (options_.tls != nullptr) return options_.tls->Channel(target_, args);
  return grpc::CreateCustomChannel(target_, grpc::InsecureChannelCredentials(), args);
}

KnownCoordinator CoordinatorLink::Coordinator() {
  absl::MutexLock lock(&mu_);
  return coordinator_;
}

absl::Status CoordinatorLink::Answered(const grpc::ClientContext& ctx,
                                       const v1::JoinResponse& out) {
  // With --coordinator-node, only that node's certificate is obeyed as the coordinator; without
  // it, the answer's own certificate must be the node the answer names.
  if (options_.coordinator_node >= 0 && out.coordinator_node() != options_.coordinator_node) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the daemon at ", Target(), " answers as coordinator node ", out.coordinator_node(),
        "; --coordinator-node is ", options_.coordinator_node));
  }
  if (options_.tls != nullptr) {
    if (auto s = CheckServerNode(*options_.tls, ctx, out.coordinator_node()); !s.ok()) {
      return absl::PermissionDeniedError(
          absl::StrCat("the coordinator at ", Target(), ": ", s.message()));
    }
  }
  absl::MutexLock lock(&mu_);
  if (coordinator_.incarnation != out.coordinator_incarnation() && coordinator_.node >= 0) {
    Logger("rpc")->info(
        "the coordinator is node {} incarnation {} now (was node {} incarnation {})",
        out.coordinator_node(), out.coordinator_incarnation(), coordinator_.node,
        coordinator_.incarnation);
  }
  coordinator_ = KnownCoordinator{out.coordinator_node(), out.coordinator_incarnation()};
  if (out.resync()) ++resyncs_seen_;
  return absl::OkStatus();
}

std::shared_ptr<v1::RefitPeer::Stub> CoordinatorLink::Peer() {
  absl::MutexLock lock(&mu_);
  if (!peer_) {
    peer_ = v1::RefitPeer::NewStub(NewChannel(/*own_connection=*/false));
  }
  return peer_;
}

std::shared_ptr<v1::RefitPeer::Stub> CoordinatorLink::SyncPeer() {
  absl::MutexLock lock(&mu_);
  if (!sync_peer_) {
    sync_peer_ = v1::RefitPeer::NewStub(NewChannel(/*own_connection=*/true));
  }
  return sync_peer_;
}

std::shared_ptr<v1::RefitControl::Stub> CoordinatorLink::Control() {
  absl::MutexLock lock(&mu_);
  if (!control_) {
    control_ = v1::RefitControl::NewStub(NewChannel(/*own_connection=*/false));
  }
  return control_;
}

v1::JoinRequest CoordinatorLink::JoinRequestNow() {
  v1::JoinRequest out = join_;
  absl::MutexLock lock(&mu_);
  out.set_resyncs_seen(resyncs_seen_);
  return out;
}

absl::Status CoordinatorLink::Join(const std::string& control_address,
                                   const std::string& data_address) {
  join_.set_node(options_.node);
  join_.set_control_address(control_address);
  join_.set_data_address(data_address);
  join_.set_incarnation(options_.incarnation);
  // A coordinator not up yet (started after this daemon, restarting, its DNS name not yet
  // resolvable) is waited for, with a back-off of 200 ms doubling to 5 s, logged every 10 s:
  // exiting would put a Kubernetes pod into CrashLoopBackOff. Bounded by options_.join_timeout
  // when set; Stop() ends the wait.
  absl::Status joined = absl::UnavailableError("not tried");
  const absl::Time start = absl::Now();
  absl::Time logged = absl::InfinitePast();
  absl::Duration backoff = absl::Milliseconds(200);
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(options_.peer_timeout));
    v1::JoinResponse out;
    joined =
        Target().empty()
            ? absl::UnavailableError(absl::StrCat(options_.coordinator, " names no coordinator"))
            : FromGrpc(Peer()->Join(&ctx, JoinRequestNow(), &out));
    if (joined.ok()) joined = Answered(ctx, out);
    if (joined.ok()) {
      if (attempt > 1)
        Logger("rpc")->info("joined the coordinator at {} after {} attempts", Target(), attempt);
      break;
    }
    if (options_.join_timeout > absl::ZeroDuration() &&
        absl::Now() - start >= options_.join_timeout)
      break;
    if (absl::Now() - logged >= absl::Seconds(10)) {
      Logger("rpc")->warn("waiting for the coordinator at {} (attempt {}, next in {}): {}",
                          Target().empty() ? options_.coordinator : Target(), attempt,
                          absl::FormatDuration(backoff), std::string(joined.message()));
      logged = absl::Now();
    }
    {
      absl::MutexLock lock(&mu_);
      if (!stopping_) stop_.WaitWithTimeout(&mu_, backoff);
      if (stopping_) return absl::CancelledError("stopped while waiting for the coordinator");
    }
    backoff = std::min(backoff * 2, absl::Seconds(5));
    Refresh();
  }
  if (!joined.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "cannot join the coordinator at ", options_.coordinator,
        Target() != options_.coordinator ? " (" + Target() + ")" : "", ": ", joined.message()));
  }
  {
    absl::MutexLock lock(&mu_);
    resyncs_handled_ = resyncs_seen_;  // nothing of this node's to abort yet
  }
  heartbeat_ = std::thread([this] { HeartbeatLoop(); });
  syncer_ = std::thread([this] { SyncLoop(); });
  return absl::OkStatus();
}

v1::SyncWorkersRequest CoordinatorLink::NumberedRequest() {
  v1::SyncWorkersRequest sync;
  sync.set_node(options_.node);
  sync.set_incarnation(options_.incarnation);
  sync.set_sequence(++last_sequence_);
  absl::MutexLock lock(&mu_);
  sync.set_resyncs_seen(resyncs_handled_);
  return sync;
}

absl::Duration CoordinatorLink::SyncTimeout(int64_t bytes) const {
  return options_.peer_timeout + absl::Seconds(static_cast<double>(bytes) / kSyncBytesPerSecond);
}

absl::Status CoordinatorLink::Send(const v1::SyncWorkersRequest& sync,
                                   std::vector<v1::WorkerRefusal>* refused) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(SyncTimeout(static_cast<int64_t>(sync.ByteSizeLong()))));
  v1::SyncWorkersResponse out;
  const absl::Status s = FromGrpc(SyncPeer()->SyncWorkers(&ctx, sync, &out));  // kept for the call
  for (const v1::WorkerRefusal& r : out.refused()) {
    Logger("rpc")->warn("the coordinator did not admit {}: {}", r.worker_id(), r.reason());
    if (refused != nullptr) refused->push_back(r);
  }
  // A change refused for its base leaves the list held as it was: the whole list follows at once.
  if (s.code() == absl::StatusCode::kAborted && sync.delta()) return s;
  // Under `sync_order_`: the last sync's outcome is what the coordinator holds. A failed one may
  // still have been applied; sending the whole list again is harmless. A change refused because
  // this node has not (re)joined was not applied at all: the coordinator still holds, or keeps
  // aside while the node is dead, the list it was based on, and a change onto that list revives
  // it, rather than the whole list again (tens of MB for a node of large workers).
  const bool not_applied = s.code() == absl::StatusCode::kFailedPrecondition && sync.delta();
  if (!not_applied) acked_sequence_ = s.ok() ? sync.sequence() : 0;
  absl::MutexLock lock(&mu_);
  sync_owed_ = !s.ok();
  if (sync_owed_) {
    // Sent again once a heartbeat is answered: if the coordinator does not know this node, that
    // answer rejoins it; if it is unreachable, a list sent now would fail as well.
    sync_after_answers_ = answers_ + 1;
    sync_wake_.Signal();
  }
  return s;
}

absl::Status CoordinatorLink::SyncAllLocked(std::vector<v1::WorkerRefusal>* refused) {
  unsent_removals_.clear();  // the whole list is without them
  v1::SyncWorkersRequest sync = NumberedRequest();
  for (v1::RegisterWorkerRequest& w : options_.snapshot()) *sync.add_workers() = std::move(w);
  return Send(sync, refused);
}

absl::Status CoordinatorLink::Sync(std::vector<v1::WorkerRefusal>* refused) {
  absl::MutexLock order(&sync_order_);
  return SyncAllLocked(refused);
}

absl::Status CoordinatorLink::SyncChange(v1::RegisterWorkerRequest* added,
                                         const std::string& removed,
                                         std::vector<v1::WorkerRefusal>* refused) {
  absl::MutexLock order(&sync_order_);
  // Also after this node was declared dead, or the coordinator restarted: the coordinator may
  // still hold (or have kept aside) the list of the last sync, and says so by applying the change.
  if (acked_sequence_ > 0) {
    v1::SyncWorkersRequest sync = NumberedRequest();
    sync.set_delta(true);
    sync.set_base_sequence(acked_sequence_);
    // Moved, not copied: a registration is as large as its pieces, and while it is sent the node
    // already holds it kept (LocalWorker::wire), as received and as gRPC serialized it.
    if (added != nullptr) *sync.add_workers() = std::move(*added);
    for (const std::string& id : unsent_removals_) sync.add_removed(id);
    if (!removed.empty()) sync.add_removed(removed);
    const absl::Status s = Send(sync, refused);
    if (s.code() == absl::StatusCode::kFailedPrecondition) {
      // Not applied: this node has not joined (again) yet. A departure goes with the next change;
      // a registration is refused to its worker, which registers again.
      if (!removed.empty() && std::find(unsent_removals_.begin(), unsent_removals_.end(),
                                        removed) == unsent_removals_.end())
        unsent_removals_.push_back(removed);
      return s;
    }
    if (s.ok()) unsent_removals_.clear();
    if (s.code() != absl::StatusCode::kAborted) return s;
    Logger("rpc")->info(
        "the coordinator holds another list of this node's workers ({}); sending "
        "the whole list",
        std::string(s.message()));
  }
  // The whole list holds the added worker again (the snapshot's copy): this one goes first.
  if (added != nullptr) v1::RegisterWorkerRequest().Swap(added);
  return SyncAllLocked(refused);
}

absl::Status CoordinatorLink::SyncAdded(v1::RegisterWorkerRequest added,
                                        std::vector<v1::WorkerRefusal>* refused) {
  return SyncChange(&added, "", refused);
}

absl::Status CoordinatorLink::SyncRemoved(const std::string& id) {
  return SyncChange(nullptr, id, nullptr);
}

std::optional<v1::JoinResponse> CoordinatorLink::Heartbeat(bool* lost) {
  grpc::ClientContext ctx;
  // A moved coordinator is found within a heartbeat of its file naming it (one small read per
  // heartbeat), and a heartbeat waits for a connection a second at most, not --peer-timeout:
  // one to a coordinator that vanished would otherwise hold up the next look at the file.
  Refresh();
  ctx.set_deadline(Deadline(
      std::min(options_.peer_timeout, std::max(options_.heartbeat * 2, absl::Seconds(1)))));
  ctx.set_wait_for_ready(true);  // a coordinator coming back is joined as soon as it listens
  v1::JoinResponse out;
  absl::Status s = FromGrpc(Peer()->Join(&ctx, JoinRequestNow(), &out));
  if (s.ok()) s = Answered(ctx, out);
  if (!s.ok()) {
    if (!*lost) {
      Logger("rpc")->warn("heartbeat to the coordinator at {} failed: {}", Target(),
                          std::string(s.message()));
    }
    *lost = true;
    return std::nullopt;
  }
  if (*lost) Logger("rpc")->info("the coordinator at {} answers again", Target());
  *lost = false;
  return out;
}

void CoordinatorLink::HeartbeatLoop() {
  bool lost = false;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (!stopping_) stop_.WaitWithTimeout(&mu_, options_.heartbeat);
      if (stopping_) return;
    }
    const std::optional<v1::JoinResponse> answer = Heartbeat(&lost);
    // Unanswered: the next answer says whether the coordinator lacks this node's list.
    if (!answer.has_value()) continue;
    if (options_.on_answer) options_.on_answer(*answer);
    absl::MutexLock lock(&mu_);
    ++answers_;
    // Acted on (its rounds aborted): a list taken from now on shows the coordinator that this
    // node heard it was admitted again.
    resyncs_handled_ = resyncs_seen_;
    // The coordinator restarted or declared this node dead, and no list of this incarnation
    // reached it since: it asks in every answer until one does.
    if (answer->resync()) sync_owed_ = true;
    if (sync_owed_) sync_wake_.Signal();
  }
}

void CoordinatorLink::SyncLoop() {
  // A sync owed is sent on this thread, not the heartbeat's: a list of many large workers may take
  // seconds to send and apply, and a node that stopped heartbeating meanwhile would be declared
  // dead for it (then asked for the list again, which took as long: for good). One that failed is
  // tried again after the next answered heartbeat, with a back-off.
  absl::Duration backoff = kFirstSyncRetry;
  absl::Time not_before = absl::InfinitePast();
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto due = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ ||
               (sync_owed_ && answers_ >= sync_after_answers_ && absl::Now() >= not_before);
      };
      while (!due()) {
        const absl::Time wake = sync_owed_ && answers_ >= sync_after_answers_
                                    ? not_before
                                    : absl::Now() + options_.heartbeat;
        sync_wake_.WaitWithDeadline(&mu_, wake);
      }
      if (stopping_) return;
    }
    std::vector<v1::WorkerRefusal> refused;
    const absl::Status s = SyncChange(nullptr, "", &refused);  // nothing changed: the list again
    if (!refused.empty() && options_.on_refused) options_.on_refused(refused);
    if (s.ok()) {
      backoff = kFirstSyncRetry;
      not_before = absl::InfinitePast();
      continue;
    }
    Logger("rpc")->warn(
        "sending this node's workers to the coordinator at {} failed (again in {} at the "
        "earliest, after a heartbeat is answered): {}",
        Target(), absl::FormatDuration(backoff), std::string(s.message()));
    not_before = absl::Now() + backoff;
    backoff = std::min(backoff * 2, kLastSyncRetry);
  }
}

void CoordinatorLink::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    stop_.SignalAll();
    sync_wake_.SignalAll();
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  if (syncer_.joinable()) syncer_.join();
}

absl::Status CoordinatorLink::ForwardWatch(const v1::WatchRoundsRequest& request,
                                           const std::function<bool()>& cancelled,
                                           const std::function<bool(const v1::RoundStats&)>& write,
                                           const std::function<void()>& opened) {
  grpc::ClientContext ctx;
  std::shared_ptr<v1::RefitControl::Stub> stub = Control();  // outlives the stream
  auto reader = stub->WatchRounds(&ctx, request);
  // The upstream read blocks until the coordinator sends a round: a side thread cancels it as soon
  // as the downstream caller is gone or the link stops, so that neither daemon keeps a thread
  // (and a node can drain) for a watcher that left.
  absl::Notification done;
  std::thread watchdog([&] {
    while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
      bool stopping;
      {
        absl::MutexLock lock(&mu_);
        stopping = stopping_;
      }
      if (stopping || cancelled()) {
        ctx.TryCancel();
        return;
      }
    }
  });
  reader->WaitForInitialMetadata();  // or the stream's end (the watchdog cancels it if need be)
  const auto& metadata = ctx.GetServerInitialMetadata();
  auto open = metadata.find(kWatchOpenKey);
  if (open != metadata.end() && open->second == kWatchOpenValue) opened();
  v1::RoundStats s;
  bool downstream_gone = false;
  while (reader->Read(&s)) {
    if (!write(s)) {
      downstream_gone = true;
      break;
    }
  }
  const bool ended_by_coordinator = !downstream_gone && !cancelled();
  ctx.TryCancel();
  done.Notify();
  watchdog.join();
  const grpc::Status status = reader->Finish();
  // The coordinator's own end of the stream (a refusal: too many watches, not allowed) is the
  // caller's answer; one we cancelled because the caller left is nobody's.
  return ended_by_coordinator ? FromGrpc(status) : absl::OkStatus();
}

}  // namespace refit
