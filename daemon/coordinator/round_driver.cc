#include "daemon/coordinator/round_driver.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/base/culprit.h"
#include "daemon/base/log_later.h"
#include "daemon/base/logging.h"
#include "daemon/base/round_protocol.h"
#include "daemon/coordinator/plan_slices.h"
#include "proto/plan_codec.h"

namespace refit {

// Below 2 x this many peers a phase's calls start on one thread: handing a share to another
// costs about as much as starting a few calls (65 us each).
constexpr size_t kPeersPerStarter = 8;

// One call on each of several nodes at once, through the PeerClient. The first failure is kept
// and handed to `on_failure` once (outside the lock: it may start more calls). Everything the
// calls touch lives here, shared with their callbacks, so a wait that gives up leaves nothing
// dangling.
class RoundDriver::FanOut {
 public:
  using Call =
      std::function<void(int32_t node, v1::PhaseResponse* response, PeerClient::Done done)>;

  // The calls of `nodes`, pending until Run starts them.
  static std::shared_ptr<FanOut> Make(const std::vector<int32_t>& nodes,
                                      std::function<void(const absl::Status&)> on_failure) {
    auto fan = std::make_shared<FanOut>();
    fan->on_failure_ = std::move(on_failure);
    fan->nodes_ = nodes;
    absl::MutexLock lock(&fan->mu_);
    for (int32_t n : nodes) {
      fan->pending_.insert(n);
      fan->responses_[n];
    }
    return fan;
  }
  static std::shared_ptr<FanOut> Start(const std::vector<int32_t>& nodes, const Call& call,
                                       std::function<void(const absl::Status&)> on_failure) {
    auto fan = Make(nodes, std::move(on_failure));
    Run(fan, call);
    return fan;
  }
  static void Run(const std::shared_ptr<FanOut>& fan, const Call& call) {
    StartCalls(fan, call, 0, fan->nodes_.size());
  }
  // The same with the peers' calls started by `threads` threads at once: this one and
  // threads - 1 of `starters`, each a contiguous share of at least kPeersPerStarter. The last
  // node (the coordinator's own, Order()) starts on this thread after every other call started,
  // as with Run, or after `wait` if a starter is late (its calls then follow).
  static void RunSpread(const std::shared_ptr<FanOut>& fan, const Call& call, Executor* starters,
                        int threads, absl::Duration wait) {
    const size_t peers = fan->nodes_.empty() ? 0 : fan->nodes_.size() - 1;
    const size_t shares =
        std::min<size_t>(static_cast<size_t>(std::max(threads, 1)), peers / kPeersPerStarter);
    if (starters == nullptr || shares <= 1) {
      Run(fan, call);
      return;
    }
    struct Started {
      absl::Mutex mu;
      size_t shares ABSL_GUARDED_BY(mu) = 0;
    };
    auto started = std::make_shared<Started>();
    auto shared_call = std::make_shared<const Call>(call);  // a late starter outlives this frame
    const LogContext context = CurrentLogContext();  // the round's, for the starters' lines too
    for (size_t k = 1; k < shares; ++k) {
      const size_t begin = peers * k / shares, end = peers * (k + 1) / shares;
      auto task = [fan, shared_call, started, begin, end, context] {
        ScopedLogContext log_context(context.group, context.round);
        StartCalls(fan, *shared_call, begin, end);
        absl::MutexLock lock(&started->mu);
        ++started->shares;
      };
      if (!starters->Submit(task)) task();  // stopping: here, in turn
    }
    StartCalls(fan, call, 0, peers / shares);
    bool all_started = false;
    {
      absl::MutexLock lock(&started->mu);
      ++started->shares;
      auto all = [&started, shares]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(started->mu) {
        return started->shares == shares;
      };
      all_started = started->mu.AwaitWithTimeout(absl::Condition(&all), wait);
    }
    if (all_started) {
      LogLater("round", spdlog::level::info, "calls to {} peers started from {} threads", peers,
               shares);
    } else {
      // Starters busy with other rounds' calls: this node's own part goes ahead of some peers'.
      Logger("round")->warn(
          "calls to {} peers: not every one of {} threads started its share within {}; the "
          "coordinator's own node is called now",
          peers, shares, absl::FormatDuration(wait));
    }
    StartCalls(fan, call, peers, fan->nodes_.size());
  }

  // The first failure, once every call ended; DEADLINE_EXCEEDED naming the nodes that did not
  // answer within `timeout` (their calls have deadlines of their own: this one only bounds the
  // wait).
  absl::Status Wait(absl::Duration timeout, const std::string& what) {
    const absl::Time deadline = absl::Now() + timeout;
    absl::MutexLock lock(&mu_);
    while (!pending_.empty() && absl::Now() < deadline) done_.WaitWithDeadline(&mu_, deadline);
    if (pending_.empty()) return first_;
    if (!first_.ok()) return first_;
    return WithCulprit(absl::DeadlineExceededError(absl::StrCat(
                           "node", pending_.size() > 1 ? "s " : " ", absl::StrJoin(pending_, ", "),
                           " did not answer ", what, " within ", absl::FormatDuration(timeout))),
                       NodeCulprit(*pending_.begin(), "", what));
  }

  // Bytes that landed on the nodes (after a Wait that saw every call end).
  int64_t BytesIn() {
    absl::MutexLock lock(&mu_);
    int64_t bytes = 0;
    if (!pending_.empty()) return bytes;
    for (const auto& [n, r] : responses_) bytes += r.bytes_received() + r.bytes_local();
    return bytes;
  }
  // The nodes whose call failed (with its failure) or has not ended yet (DEADLINE_EXCEEDED).
  std::map<int32_t, absl::Status> NotConfirmed() {
    absl::MutexLock lock(&mu_);
    std::map<int32_t, absl::Status> out = failed_;
    for (int32_t n : pending_) out.emplace(n, absl::DeadlineExceededError("no answer"));
    return out;
  }
  // Every node's answer (after a Wait that saw every call end; empty otherwise).
  std::map<int32_t, v1::PhaseResponse> Responses() {
    absl::MutexLock lock(&mu_);
    if (!pending_.empty()) return {};
    return responses_;
  }

 private:
  // The calls of nodes_[begin, end), in order.
  static void StartCalls(const std::shared_ptr<FanOut>& fan, const Call& call, size_t begin,
                         size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const int32_t n = fan->nodes_[i];
      call(n, &fan->responses_.at(n), [fan, n](absl::Status s) { fan->Done(n, std::move(s)); });
    }
  }

  void Done(int32_t node, absl::Status s) {
    bool report = false;
    {
      absl::MutexLock lock(&mu_);
      pending_.erase(node);
      if (!s.ok()) failed_[node] = s;
      if (!s.ok() && first_.ok()) {
        first_ = s;
        report = true;
      }
      done_.SignalAll();
    }
    if (report && on_failure_) on_failure_(s);
  }

  absl::Mutex mu_;
  absl::CondVar done_;
  std::set<int32_t> pending_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, absl::Status> failed_ ABSL_GUARDED_BY(mu_);
  absl::Status first_ ABSL_GUARDED_BY(mu_);
  // One per node, made before any call starts and never rehashed (std::map): each call writes
  // only its own.
  std::map<int32_t, v1::PhaseResponse> responses_;
  std::function<void(const absl::Status&)> on_failure_;
  std::vector<int32_t> nodes_;
};

RoundDriver::RoundDriver(RoundDriverOptions options, Membership* membership, GroupPlanner* planner,
                         PeerClient* peers, RoundLog* log, const Clock* clock)
    : options_(std::move(options)),
      membership_(membership),
      planner_(planner),
      peers_(peers),
      log_(log),
      clock_(clock),
      background_(options_.max_background_rounds),
      fanout_threads_(
          options_.fanout_threads > 0
              ? options_.fanout_threads
              : static_cast<int>(std::clamp(std::thread::hardware_concurrency() / 4, 1u, 4u))),
      starters_(std::max(1, fanout_threads_ - 1)),
      own_state_(options_.state == nullptr ? *StateStore::Open("") : nullptr),
      state_(options_.state != nullptr ? options_.state : own_state_.get()) {
  absl::MutexLock lock(&mu_);
  for (const auto& [group, version] : state_->Versions()) groups_[group].version = version;
}

RoundDriver::~RoundDriver() { Stop(); }

void RoundDriver::Stop() { background_.Stop(); }

bool RoundDriver::Drain(absl::Duration deadline) {
  const absl::Time until = absl::Now() + deadline;
  absl::MutexLock lock(&mu_);
  draining_ = true;
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [group, g] : groups_) {
      if (g.busy) return false;
    }
    return true;
  };
  mu_.AwaitWithDeadline(absl::Condition(&idle), until);
  return idle();
}

int64_t RoundDriver::CommittedVersion(const std::string& group) const {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(group);
  return it == groups_.end() ? 0 : it->second.version;
}

std::vector<int32_t> RoundDriver::Order(const std::vector<int32_t>& nodes) const {
  std::vector<int32_t> order;
  for (int32_t n : nodes) {
    if (n != options_.self) order.push_back(n);
  }
  for (int32_t n : nodes) {
    if (n == options_.self) order.push_back(n);
  }
  return order;
}

absl::Status RoundDriver::CheckVersion(const std::string& group, int64_t version) const {
  auto it = groups_.find(group);
  if (it == groups_.end()) return absl::OkStatus();
  if (it->second.busy)
    return absl::AbortedError(absl::StrCat("group \"", group, "\" is already running a round"));
  if (version <= it->second.version) {
    return absl::FailedPreconditionError(
        absl::StrCat("version ", version, " is not newer than group \"", group,
                     "\"'s committed version ", it->second.version));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> RoundDriver::BeginRound(const v1::RefitRequest& request) {
  const std::vector<std::string> known = membership_->GroupNames();
  if (std::find(known.begin(), known.end(), request.group()) == known.end()) {
    return absl::NotFoundError(
        absl::StrCat("no model group \"", request.group(),
                     "\" (known: ", known.empty() ? "none" : absl::StrJoin(known, ", "), ")"));
  }
  if (auto s = CheckVersionBound(request.version()); !s.ok()) return s;
  {
    absl::MutexLock lock(&mu_);
    if (auto s = CheckVersion(request.group(), request.version()); !s.ok()) return s;
  }
  // Planned (or read from the cache) with no lock held.
  if (auto plan = planner_->Get(request.group()); !plan->status.ok()) return plan->status;
  {
    absl::MutexLock lock(&mu_);
    if (draining_)
      return absl::UnavailableError("the coordinator is draining (shutting down): no new rounds");
    if (auto s = CheckVersion(request.group(), request.version()); !s.ok())
      return s;  // raced meanwhile
    groups_[request.group()].busy = true;
  }
  // Persisted before it is used (outside the lock: the store writes a file).
  auto id = state_->ReserveRoundId();
  if (!id.ok()) {
    absl::MutexLock lock(&mu_);
    groups_[request.group()].busy = false;
    return absl::UnavailableError(
        absl::StrCat("the coordinator cannot start a round: ", id.status().message()));
  }
  {
    absl::MutexLock lock(&mu_);
    groups_[request.group()].round_id = *id;
  }
  return *id;
}

absl::Status RoundDriver::FinishRound(const v1::RefitRequest& request, int64_t round_id,
                                      v1::RoundStats* stats) {
  const absl::Status s = RunRound(request.group(), round_id, request.version(), stats);
  absl::MutexLock lock(&mu_);
  GroupRounds& g = groups_[request.group()];
  g.busy = false;
  g.round_id = 0;
  if (s.ok()) g.version = request.version();
  return s;
}

absl::Status RoundDriver::Refit(const v1::RefitRequest& request, v1::RoundStats* stats) {
  auto round_id = BeginRound(request);
  if (!round_id.ok()) return round_id.status();
  return FinishRound(request, *round_id, stats);
}

absl::StatusOr<int64_t> RoundDriver::StartRefit(const v1::RefitRequest& request) {
  auto round_id = BeginRound(request);
  if (!round_id.ok()) return round_id.status();
  const bool queued = background_.Submit([this, request, id = *round_id] {
    v1::RoundStats stats;
    FinishRound(request, id, &stats).IgnoreError();  // the outcome goes to WatchRounds
  });
  if (!queued) {
    absl::MutexLock lock(&mu_);
    groups_[request.group()].busy = false;
    groups_[request.group()].round_id = 0;
    return absl::UnavailableError("the coordinator is shutting down");
  }
  return *round_id;
}

absl::Status RoundDriver::BlamePause(const std::string& group, int64_t round_id, absl::Time start,
                                     const absl::Status& failure) const {
  if (options_.pause == nullptr) return failure;
  options_.pause->Tick();  // this thread may be the first to run since the pause
  const std::optional<PauseDetector::Pause> pause = options_.pause->LastPause();
  if (!pause.has_value() || pause->ended < start || pause->length() < options_.blame_pause)
    return failure;
  Logger("round")->warn(
      "group \"{}\" round {} failed after the coordinator itself did not run for {}: {}", group,
      round_id, absl::FormatDuration(pause->length()), std::string(failure.message()));
  const std::optional<v1::Culprit> named = CulpritOf(failure);
  return WithCulprit(
      absl::AbortedError(absl::StrCat(
          "node ", options_.self, " (the coordinator) did not run for ",
          absl::FormatDuration(absl::Trunc(pause->length(), absl::Milliseconds(1))),
          " during round ", round_id,
          " (stopped or starved: its clock jumped); what failed meanwhile is its own fault")),
      CoordinatorCulprit(options_.self, named.has_value() ? named->phase() : ""));
}

namespace {

// A node's install decodes, checks and indexes its slice: work in proportion to the slice's
// bytes (over 100 MB/s on this small machine: DeepSeek-V3's largest slice, ~10 MB, installs in
// under 0.1 s; docs/PLANNING.md). The deadline allows 10 MB/s, so that a node that
// overruns it is stuck, not slow, and is named as such.
constexpr absl::Duration kInstallPerByte = absl::Nanoseconds(100);

absl::Duration InstallTimeout(absl::Duration peer_timeout, int64_t largest_slice_bytes) {
  return peer_timeout * 4 + kInstallPerByte * largest_slice_bytes;
}

// The descriptors of other nodes' network messages a slice keeps: the cuda backend's zero-copy
// threshold (0: its default, 16 MiB), which cuts every node's network steps.
int64_t KeepRemoteMinBytes(int64_t zero_copy_min_bytes) {
  return zero_copy_min_bytes > 0 ? zero_copy_min_bytes : int64_t{16} << 20;
}

}  // namespace

// ABORT to every node of a round, at most once, whoever asks first: a failing call of PREPARE
// or TRANSFER (from a callback, which may outlive the round's wait) or the round itself.
class RoundDriver::Aborter {
 public:
  Aborter(PeerClient* peers, std::vector<int32_t> nodes, v1::PhaseRequest request,
          absl::Duration peer_timeout)
      : peers_(peers),
        nodes_(std::move(nodes)),
        request_(std::move(request)),
        peer_timeout_(peer_timeout) {}

  void Start(const std::string& reason) {
    std::shared_ptr<FanOut> calls;
    {
      absl::MutexLock lock(&mu_);
      if (calls_ != nullptr) return;
      calls = calls_ = FanOut::Make(nodes_, nullptr);
    }
    v1::PhaseRequest abort = request_;
    abort.set_reason(reason);
    FanOut::Run(calls, [peers = peers_, abort, timeout = peer_timeout_](
                           int32_t n, v1::PhaseResponse* out, PeerClient::Done done) {
      peers->RunPhase(n, abort, timeout, out, std::move(done));
    });
  }

  // Every node has its ABORT, or gave up on it (null: none was started).
  void Wait() {
    std::shared_ptr<FanOut> calls;
    {
      absl::MutexLock lock(&mu_);
      calls = calls_;
    }
    if (calls != nullptr) calls->Wait(peer_timeout_ * 2 + absl::Seconds(1), "ABORT").IgnoreError();
  }

 private:
  PeerClient* const peers_;
  const std::vector<int32_t> nodes_;
  const v1::PhaseRequest request_;  // ABORT of the round, without its reason
  const absl::Duration peer_timeout_;
  absl::Mutex mu_;
  std::shared_ptr<FanOut> calls_ ABSL_GUARDED_BY(mu_);  // set once: the abort started
};

// One round, step by step: install the plan where needed, PREPARE, TRANSFER, record the version,
// COMMIT, settle which replicas hold it; or abort every node, naming the first failure.
class RoundDriver::Round {
 public:
  Round(RoundDriver* driver, const std::string& group, int64_t round_id, int64_t version,
        v1::RoundStats* stats)
      : d_(*driver), group_(group), round_id_(round_id), version_(version), stats_(stats) {}

  absl::Status Run() {
    ScopedLogContext log_context(group_, round_id_);
    start_ = d_.clock_->Now();
    if (absl::Status s = Begin(); !s.ok()) return s;
    absl::Status status = Install();
    // From PREPARE on, the planned replicas' engines hold no version until COMMIT: one aborted
    // drops to none, and status must not show the one before.
    if (status.ok()) d_.membership_->RecordCommit(group_, epoch_, plan_->planned, 0);
    absl::Time t = d_.clock_->Now();
    if (status.ok())
      status = Phase(v1::PhaseRequest::PREPARE, d_.options_.prepare_timeout, nullptr, nullptr);
    stats_->set_prepare_seconds(absl::ToDoubleSeconds(d_.clock_->Now() - t));
    int64_t bytes = 0;
    if (status.ok()) {
      stats_->set_state(v1::RoundStats::TRANSFERRING);
      d_.log_->Publish(*stats_);
      t = d_.clock_->Now();
      status = Phase(v1::PhaseRequest::TRANSFER, d_.options_.transfer_timeout, &bytes, nullptr);
      stats_->set_transfer_seconds(absl::ToDoubleSeconds(d_.clock_->Now() - t));
    }
    if (status.ok()) status = RecordVersion();
    if (status.ok()) Commit();
    stats_->set_bytes(bytes);
    stats_->set_seconds(absl::ToDoubleSeconds(d_.clock_->Now() - start_));
    if (status.ok()) {
      stats_->set_state(v1::RoundStats::COMMITTED);
      Logger("round")->info("group \"{}\" round {}: version {} committed, {} bytes in {:.3f} s",
                            group_, round_id_, version_, stats_->bytes(), stats_->seconds());
    } else {
      status = Abort(status);
    }
    d_.log_->Publish(*stats_);
    return status.ok() ? status
                       : Rewrap(status, absl::StatusCode::kAborted,
                                absl::StrCat("round ", round_id_, " of group \"", group_,
                                             "\" aborted: ", status.message()));
  }

 private:
  // When each node was called and its answer came (the TRANSFER's
  // NodeTransfer.request_sent_unix_us and answer_received_unix_us).
  struct SentTimes {
    absl::Mutex mu;
    std::map<int32_t, absl::Time> at ABSL_GUARDED_BY(mu);
    std::map<int32_t, absl::Time> answered ABSL_GUARDED_BY(mu);
  };

  // The plan, its nodes, the nodes that must install it; the round published as PREPARING.
  absl::Status Begin() {
    stats_->set_group(group_);
    stats_->set_round_id(round_id_);
    stats_->set_version(version_);
    stats_->set_state(v1::RoundStats::PREPARING);
    plan_ = d_.planner_->Get(group_);
    if (!plan_->status.ok()) return plan_->status;
    epoch_ = plan_->epoch;
    nodes_ = d_.Order(plan_->nodes);
    {
      absl::MutexLock lock(&d_.mu_);
      GroupRounds& g = d_.groups_[group_];
      for (int32_t n : nodes_) {
        if (g.installed_epoch[n] != epoch_) to_install_.push_back(n);
      }
    }
    // The first failure is the round's reason; during PREPARE and TRANSFER it also aborts every
    // node at once, so nobody waits out a deadline for a round that cannot commit.
    aborter_ = std::make_shared<Aborter>(d_.peers_, nodes_, Request(v1::PhaseRequest::ABORT),
                                         d_.options_.peer_timeout);
    d_.log_->Publish(*stats_);
    Logger("round")->info("group \"{}\" round {} -> version {} on nodes [{}]", group_, round_id_,
                          version_, absl::StrJoin(plan_->nodes, ", "));
    return absl::OkStatus();
  }

  v1::PhaseRequest Request(v1::PhaseRequest::Phase p) const {
    v1::PhaseRequest r;
    r.set_phase(p);
    r.set_group(group_);
    r.set_round_id(round_id_);
    r.set_version(version_);
    r.set_epoch(epoch_);
    return r;
  }

  // Each node of a new membership its own slice of the plan (made here: the plan's memory is
  // read, not copied), with a fresh communicator (cuda backend).
  absl::Status Install() {
    if (to_install_.empty()) return absl::OkStatus();
    auto install = std::make_shared<v1::InstallPlanRequest>();
    install->set_group(group_);
    install->set_epoch(epoch_);
    install->set_max_message_bytes(d_.options_.max_message_bytes);
    install->set_step_bytes(d_.options_.step_bytes);
    install->set_no_routing(!d_.options_.routing);
    install->set_max_relay_depth(d_.options_.max_relay_depth);
    install->set_zero_copy_min_bytes(d_.options_.zero_copy_min_bytes);
    install->set_nccl_register(d_.options_.nccl_register);
    for (v1::NodeAddress& a : d_.membership_->DataAddresses()) *install->add_nodes() = std::move(a);
    if (d_.options_.new_communicator_id) {
      absl::StatusOr<std::string> id = d_.options_.new_communicator_id();
      if (!id.ok()) return id.status();
      install->set_nccl_id(*id);
    }
    const absl::Time slicing = d_.clock_->Now();
    auto requests =
        std::make_shared<std::map<int32_t, std::shared_ptr<const v1::InstallPlanRequest>>>(
            SliceRequests(
                *install, *plan_, to_install_, KeepRemoteMinBytes(d_.options_.zero_copy_min_bytes),
                static_cast<int>(std::min(8u, std::max(1u, std::thread::hardware_concurrency())))));
    int64_t largest = 0, total = 0;
    for (const auto& [n, r] : *requests) {
      largest = std::max<int64_t>(largest, static_cast<int64_t>(r->slice().size()));
      total += static_cast<int64_t>(r->slice().size());
    }
    Logger("plan")->info(
        "group \"{}\" epoch {}: sliced plan {} for {} nodes in {:.3f} s ({} bytes, the largest {})",
        group_, epoch_, ShortHex(plan_->digest), to_install_.size(),
        absl::ToDoubleSeconds(d_.clock_->Now() - slicing), total, largest);
    const absl::Duration timeout = InstallTimeout(d_.options_.peer_timeout, largest);
    auto calls = FanOut::Start(
        to_install_,
        [peers = d_.peers_, requests, timeout](int32_t n, v1::PhaseResponse*,
                                               PeerClient::Done done) {
          peers->InstallPlan(n, requests->at(n), timeout, std::move(done));
        },
        nullptr);
    if (absl::Status s = calls->Wait(timeout + absl::Seconds(1), "InstallPlan"); !s.ok()) return s;
    absl::MutexLock lock(&d_.mu_);
    for (int32_t n : to_install_) d_.groups_[group_].installed_epoch[n] = epoch_;
    return absl::OkStatus();
  }

  // One phase on every node. PREPARE and TRANSFER abort the round at their first failure.
  absl::Status Phase(v1::PhaseRequest::Phase p, absl::Duration timeout, int64_t* bytes,
                     std::map<int32_t, absl::Status>* not_confirmed) {
    auto sent = std::make_shared<SentTimes>();
    v1::PhaseRequest r = Request(p);
    r.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    if (p == v1::PhaseRequest::PREPARE)
      r.set_plan_digest(plan_->digest);  // every node runs this plan
    const bool abort_on_failure = p == v1::PhaseRequest::TRANSFER || p == v1::PhaseRequest::PREPARE;
    auto calls =
        FanOut::Make(nodes_, abort_on_failure ? std::function<void(const absl::Status&)>(
                                                    [aborter = aborter_](const absl::Status& s) {
                                                      aborter->Start(std::string(s.message()));
                                                    })
                                              : nullptr);
    FanOut::RunSpread(
        calls,
        [peers = d_.peers_, r, timeout, sent](int32_t n, v1::PhaseResponse* out,
                                              PeerClient::Done done) {
          {
            absl::MutexLock lock(&sent->mu);
            sent->at[n] = absl::Now();
          }
          peers->RunPhase(n, r, timeout, out, [sent, n, done = std::move(done)](absl::Status s) {
            {
              absl::MutexLock lock(&sent->mu);
              sent->answered[n] = absl::Now();
            }
            done(std::move(s));
          });
        },
        &d_.starters_, d_.fanout_threads_, d_.options_.peer_timeout);
    // Each call has the phase's deadline plus the peer allowance; the wait adds a margin.
    absl::Status s =
        calls->Wait(timeout + d_.options_.peer_timeout + absl::Seconds(1), PhaseName(p));
    if (bytes != nullptr) *bytes = calls->BytesIn();
    if (not_confirmed != nullptr) *not_confirmed = calls->NotConfirmed();
    if (p == v1::PhaseRequest::TRANSFER && s.ok()) RecordNodeTransfers(calls->Responses(), *sent);
    return s;
  }

  void RecordNodeTransfers(const std::map<int32_t, v1::PhaseResponse>& responses, SentTimes& sent) {
    absl::MutexLock lock(&sent.mu);
    for (const auto& [n, response] : responses) {
      v1::NodeTransfer* node = stats_->add_nodes();
      node->set_node(n);
      node->set_bytes_sent(response.bytes_sent());
      node->set_bytes_received(response.bytes_received());
      node->set_bytes_local(response.bytes_local());
      node->set_bytes_nvlink(response.bytes_nvlink());
      node->set_data_plane_ms(response.data_plane_ms());
      node->set_started_after_request_ms(response.started_after_request_ms());
      node->set_request_arrived_unix_us(response.request_arrived_unix_us());
      if (auto at = sent.at.find(n); at != sent.at.end())
        node->set_request_sent_unix_us(absl::ToUnixMicros(at->second));
      node->set_answered_unix_us(response.answered_unix_us());
      if (auto at = sent.answered.find(n); at != sent.answered.end()) {
        node->set_answer_received_unix_us(absl::ToUnixMicros(at->second));
      }
    }
  }

  // Write-ahead: the version is in the state file before any node is told to COMMIT it, so a
  // restarted coordinator never reports a lower one nor accepts it again. Not recorded: not
  // committed (the round aborts, every node told).
  absl::Status RecordVersion() {
    absl::Status s = d_.state_->RecordVersion(group_, version_);
    if (s.ok()) return s;
    return WithCulprit(
        absl::Status(s.code(), absl::StrCat("the coordinator cannot commit: ", s.message())),
        CoordinatorCulprit(d_.options_.self, PhaseName(v1::PhaseRequest::COMMIT)));
  }

  // The commit point: every node finished its TRANSFER, so every destination buffer of the plan
  // holds the version. The round is committed from here on: COMMIT goes to every node, which
  // delivers it to every worker of the plan still there, and no ABORT of this round follows
  // (docs/ROUNDS.md, "Replicas and commit"). A worker or node that is gone or does not confirm in
  // time is noted, not a reason to abort: what it was sent stands, and a worker that left makes
  // its replica incomplete (it no longer counts, and holds no version until refit whole).
  void Commit() {
    for (const std::string& r : plan_->planned) stats_->add_replicas(r);
    for (const std::string& r : plan_->incomplete) stats_->add_incomplete_replicas(r);
    const absl::Time t = d_.clock_->Now();
    std::map<int32_t, absl::Status> not_confirmed;
    const absl::Status confirmed =
        Phase(v1::PhaseRequest::COMMIT, d_.options_.commit_timeout, nullptr, &not_confirmed);
    stats_->set_commit_seconds(absl::ToDoubleSeconds(d_.clock_->Now() - t));
    std::vector<std::string> whole, unconfirmed;
    SplitByConfirmation(not_confirmed, &whole, &unconfirmed);
    for (const std::string& r : unconfirmed) stats_->add_unconfirmed_replicas(r);
    if (!confirmed.ok()) {
      stats_->set_commit_note(std::string(confirmed.message()));
      Logger("round")->warn(
          "group \"{}\" round {}: committed, but not every worker confirmed; replicas [{}] hold "
          "no version until a round refits them: {}",
          group_, round_id_, absl::StrJoin(unconfirmed, ", "), std::string(confirmed.message()));
    }
    d_.membership_->RecordCommit(group_, epoch_, whole, version_);
    d_.membership_->RecordCommit(group_, epoch_, unconfirmed, 0);
    Logger("round")->info("group \"{}\" round {}: version {} to replicas [{}]{}", group_, round_id_,
                          version_, absl::StrJoin(whole, ", "),
                          plan_->incomplete.empty()
                              ? std::string()
                              : absl::StrCat("; not to the incomplete [",
                                             absl::StrJoin(plan_->incomplete, ", "), "]"));
  }

  // A replica holds the version only once every rank of it confirmed. A node that failed for one
  // worker (the culprit it names) confirmed the others; one that failed otherwise, or did not
  // answer, confirmed none of its ranks. The replicas left hold no version as far as anyone can
  // tell (a node cut off aborts the round when its lease ends): status shows them so, and the
  // next round refits them whole.
  void SplitByConfirmation(const std::map<int32_t, absl::Status>& not_confirmed,
                           std::vector<std::string>* whole,
                           std::vector<std::string>* unconfirmed) const {
    std::set<int32_t> silent_nodes;
    std::set<std::string> failed_workers;
    for (const auto& [n, failure] : not_confirmed) {
      const std::optional<v1::Culprit> culprit = CulpritOf(failure);
      if (culprit.has_value() && culprit->kind() == v1::Culprit::WORKER) {
        failed_workers.insert(culprit->worker_id());
      } else {
        silent_nodes.insert(n);
      }
    }
    for (const std::string& name : plan_->planned) {
      const auto view = std::find_if(plan_->replicas.begin(), plan_->replicas.end(),
                                     [&](const ReplicaView& v) { return v.name == name; });
      bool all = view != plan_->replicas.end();
      if (all) {
        for (int32_t n : view->nodes) all = all && silent_nodes.count(n) == 0;
        for (const std::string& w : view->workers)
          all = all && failed_workers.count(absl::StrCat(group_, "/", w)) == 0;
      }
      (all ? whole : unconfirmed)->push_back(name);
    }
  }

  // Every node told, the round reported over: ABORTED with its reason and culprit.
  absl::Status Abort(const absl::Status& failure) {
    const absl::Status status = d_.BlamePause(group_, round_id_, start_, failure);
    aborter_->Start(std::string(status.message()));
    aborter_->Wait();
    {
      // The next round installs the plan again, with a fresh communicator: an aborted one is gone.
      absl::MutexLock lock(&d_.mu_);
      d_.groups_[group_].installed_epoch.clear();
    }
    stats_->set_state(v1::RoundStats::ABORTED);
    stats_->set_reason(std::string(status.message()));
    if (auto culprit = CulpritOf(status)) *stats_->mutable_culprit() = *std::move(culprit);
    Logger("round")->warn("group \"{}\" round {} aborted: {}", group_, round_id_,
                          std::string(status.message()));
    return status;
  }

  RoundDriver& d_;
  const std::string group_;
  const int64_t round_id_, version_;
  v1::RoundStats* const stats_;
  absl::Time start_;
  std::shared_ptr<const GroupPlan> plan_;
  int64_t epoch_ = 0;
  std::vector<int32_t> nodes_;       // remote nodes first, this one last
  std::vector<int32_t> to_install_;  // nodes without this plan's epoch installed
  std::shared_ptr<Aborter> aborter_;
};

absl::Status RoundDriver::RunRound(const std::string& group, int64_t round_id, int64_t version,
                                   v1::RoundStats* stats) {
  return Round(this, group, round_id, version, stats).Run();
}

std::map<std::string, int64_t> RoundDriver::RunningRounds() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int64_t> out;
  for (const auto& [group, g] : groups_) {
    if (g.busy && g.round_id > 0) out[group] = g.round_id;
  }
  return out;
}

void RoundDriver::ForgetGroup(const std::string& group) {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(group);
  if (it == groups_.end() || it->second.busy) return;  // a round running ends by itself
  // Its committed version stays (a few bytes): versions of a group name never go back.
  it->second.installed_epoch.clear();
}

}  // namespace refit
