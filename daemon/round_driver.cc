#include "daemon/round_driver.h"

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/culprit.h"
#include "daemon/logging.h"
#include "daemon/node_agent.h"
#include "daemon/plan_slices.h"
#include "proto/plan_codec.h"

namespace refit {

// One call on each of several nodes at once, through the PeerClient. The first failure is kept
// and handed to `on_failure` once (outside the lock: it may start more calls). Everything the
// calls touch lives here, shared with their callbacks, so a wait that gives up leaves nothing
// dangling.
class RoundDriver::FanOut {
 public:
  using Call = std::function<void(int32_t node, v1::PhaseResponse* response, PeerClient::Done done)>;

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
    for (int32_t n : fan->nodes_) {
      call(n, &fan->responses_.at(n), [fan, n](absl::Status s) { fan->Done(n, std::move(s)); });
    }
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
    return WithCulprit(absl::DeadlineExceededError(absl::StrCat("node", pending_.size() > 1 ? "s " : " ",
                                                                absl::StrJoin(pending_, ", "), " did not answer ",
                                                                what, " within ", absl::FormatDuration(timeout))),
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
  if (it->second.busy) return absl::AbortedError(absl::StrCat("group \"", group, "\" is already running a round"));
  if (version <= it->second.version) {
    return absl::FailedPreconditionError(absl::StrCat("version ", version, " is not newer than group \"", group,
                                                      "\"'s committed version ", it->second.version));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> RoundDriver::BeginRound(const v1::RefitRequest& request) {
  const std::vector<std::string> known = membership_->GroupNames();
  if (std::find(known.begin(), known.end(), request.group()) == known.end()) {
    return absl::NotFoundError(absl::StrCat("no model group \"", request.group(), "\" (known: ",
                                            known.empty() ? "none" : absl::StrJoin(known, ", "), ")"));
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
    if (draining_) return absl::UnavailableError("the coordinator is draining (shutting down): no new rounds");
    if (auto s = CheckVersion(request.group(), request.version()); !s.ok()) return s;  // raced meanwhile
    groups_[request.group()].busy = true;
  }
  // Persisted before it is used (outside the lock: the store writes a file).
  auto id = state_->ReserveRoundId();
  if (!id.ok()) {
    absl::MutexLock lock(&mu_);
    groups_[request.group()].busy = false;
    return absl::UnavailableError(absl::StrCat("the coordinator cannot start a round: ", id.status().message()));
  }
  {
    absl::MutexLock lock(&mu_);
    groups_[request.group()].round_id = *id;
  }
  return *id;
}

absl::Status RoundDriver::FinishRound(const v1::RefitRequest& request, int64_t round_id, v1::RoundStats* stats) {
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
  if (!pause.has_value() || pause->ended < start || pause->length() < options_.blame_pause) return failure;
  Logger("round")->warn("group \"{}\" round {} failed after the coordinator itself did not run for {}: {}", group,
                        round_id, absl::FormatDuration(pause->length()), std::string(failure.message()));
  const std::optional<v1::Culprit> named = CulpritOf(failure);
  return WithCulprit(
      absl::AbortedError(absl::StrCat(
          "node ", options_.self, " (the coordinator) did not run for ",
          absl::FormatDuration(absl::Trunc(pause->length(), absl::Milliseconds(1))), " during round ", round_id,
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

absl::Status RoundDriver::RunRound(const std::string& group, int64_t round_id, int64_t version,
                                   v1::RoundStats* stats) {
  ScopedLogContext log_context(group, round_id);
  const absl::Time start = clock_->Now();
  stats->set_group(group);
  stats->set_round_id(round_id);
  stats->set_version(version);
  stats->set_state(v1::RoundStats::PREPARING);
  const std::shared_ptr<const GroupPlan> plan = planner_->Get(group);
  if (!plan->status.ok()) return plan->status;
  const int64_t epoch = plan->epoch;
  const std::vector<int32_t> nodes = Order(plan->nodes);
  auto install = std::make_shared<v1::InstallPlanRequest>();
  install->set_group(group);
  install->set_epoch(epoch);
  install->set_max_message_bytes(options_.max_message_bytes);
  install->set_step_bytes(options_.step_bytes);
  install->set_no_routing(!options_.routing);
  install->set_max_relay_depth(options_.max_relay_depth);
  install->set_zero_copy_min_bytes(options_.zero_copy_min_bytes);
  install->set_nccl_register(options_.nccl_register);
  for (v1::NodeAddress& a : membership_->DataAddresses()) *install->add_nodes() = std::move(a);
  std::vector<int32_t> to_install;
  {
    absl::MutexLock lock(&mu_);
    GroupRounds& g = groups_[group];
    for (int32_t n : nodes) {
      if (g.installed_epoch[n] != epoch) to_install.push_back(n);
    }
  }
  log_->Publish(*stats);
  Logger("round")->info("group \"{}\" round {} -> version {} on nodes [{}]", group, round_id, version,
                        absl::StrJoin(plan->nodes, ", "));

  // The first failure is the round's reason; during PREPARE and TRANSFER it also aborts every
  // node at once, so nobody waits out a deadline for a round that cannot commit. Shared with
  // the calls' callbacks, which may outlive a wait that gave up.
  struct Abort {
    absl::Mutex mu;
    std::shared_ptr<FanOut> calls ABSL_GUARDED_BY(mu);  // set once: the abort started
  };
  auto aborter = std::make_shared<Abort>();
  PeerClient* peers = peers_;
  const absl::Duration peer_timeout = options_.peer_timeout;
  auto abort_all = [aborter, peers, nodes, group, round_id, version, epoch, peer_timeout](const std::string& reason) {
    std::shared_ptr<FanOut> calls;
    {
      absl::MutexLock lock(&aborter->mu);
      if (aborter->calls != nullptr) return;
      calls = aborter->calls = FanOut::Make(nodes, nullptr);
    }
    v1::PhaseRequest abort;
    abort.set_phase(v1::PhaseRequest::ABORT);
    abort.set_group(group);
    abort.set_round_id(round_id);
    abort.set_version(version);
    abort.set_epoch(epoch);
    abort.set_reason(reason);
    FanOut::Run(calls, [peers, abort, peer_timeout](int32_t n, v1::PhaseResponse* out, PeerClient::Done done) {
      peers->RunPhase(n, abort, peer_timeout, out, std::move(done));
    });
  };

  absl::Status status;
  if (!to_install.empty()) {  // a new membership: a new communicator (cuda backend)
    auto id = options_.new_communicator_id ? options_.new_communicator_id() : absl::StatusOr<std::string>("");
    if (id.ok()) install->set_nccl_id(*id); else status = id.status();
  }
  if (status.ok() && !to_install.empty()) {
    // Each node its own slice of the plan, made here (the plan's memory is read, not copied).
    const absl::Time slicing = clock_->Now();
    auto requests =
        std::make_shared<std::map<int32_t, std::shared_ptr<const v1::InstallPlanRequest>>>(
            SliceRequests(
                *install, *plan, to_install, KeepRemoteMinBytes(options_.zero_copy_min_bytes),
                static_cast<int>(std::min(8u, std::max(1u, std::thread::hardware_concurrency())))));
    int64_t largest = 0, total = 0;
    for (const auto& [n, r] : *requests) {
      largest = std::max<int64_t>(largest, static_cast<int64_t>(r->slice().size()));
      total += static_cast<int64_t>(r->slice().size());
    }
    Logger("plan")->info(
        "group \"{}\" epoch {}: sliced plan {} for {} nodes in {:.3f} s ({} bytes, the largest {})",
        group, epoch, ShortHex(plan->digest), to_install.size(),
        absl::ToDoubleSeconds(clock_->Now() - slicing), total, largest);
    const absl::Duration install_timeout = InstallTimeout(peer_timeout, largest);
    auto calls = FanOut::Start(
        to_install,
        [peers, requests, timeout = install_timeout](int32_t n, v1::PhaseResponse*,
                                                     PeerClient::Done done) {
          peers->InstallPlan(n, requests->at(n), timeout, std::move(done));
        },
        nullptr);
    status = calls->Wait(install_timeout + absl::Seconds(1), "InstallPlan");
  }
  if (status.ok()) {
    absl::MutexLock lock(&mu_);
    for (int32_t n : to_install) groups_[group].installed_epoch[n] = epoch;
  }
  // When each node was called and its answer came (the TRANSFER's NodeTransfer.request_sent_unix_us
  // and answer_received_unix_us).
  struct SentTimes {
    absl::Mutex mu;
    std::map<int32_t, absl::Time> at ABSL_GUARDED_BY(mu);
    std::map<int32_t, absl::Time> answered ABSL_GUARDED_BY(mu);
  };
  auto phase = [&](v1::PhaseRequest::Phase p, absl::Duration timeout, int64_t* bytes,
                   std::map<int32_t, absl::Status>* not_confirmed = nullptr) {
    auto sent = std::make_shared<SentTimes>();
    v1::PhaseRequest r;
    r.set_phase(p);
    r.set_group(group);
    r.set_round_id(round_id);
    r.set_version(version);
    r.set_epoch(epoch);
    r.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    if (p == v1::PhaseRequest::PREPARE)
      r.set_plan_digest(plan->digest);  // every node runs this plan
    const bool abort_on_failure = p == v1::PhaseRequest::TRANSFER || p == v1::PhaseRequest::PREPARE;
    auto calls = FanOut::Start(
        nodes,
        [peers, r, timeout, sent](int32_t n, v1::PhaseResponse* out, PeerClient::Done done) {
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
        abort_on_failure ? std::function<void(const absl::Status&)>(
                               [abort_all](const absl::Status& s) { abort_all(std::string(s.message())); })
                         : nullptr);
    // Each call has the phase's deadline plus the peer allowance; the wait adds a margin.
    absl::Status s = calls->Wait(timeout + peer_timeout + absl::Seconds(1), PhaseName(p));
    if (bytes != nullptr) *bytes = calls->BytesIn();
    if (not_confirmed != nullptr) *not_confirmed = calls->NotConfirmed();
    if (p == v1::PhaseRequest::TRANSFER && s.ok()) {
      absl::MutexLock lock(&sent->mu);
      for (const auto& [n, response] : calls->Responses()) {
        v1::NodeTransfer* node = stats->add_nodes();
        node->set_node(n);
        node->set_bytes_sent(response.bytes_sent());
        node->set_bytes_received(response.bytes_received());
        node->set_bytes_local(response.bytes_local());
        node->set_bytes_nvlink(response.bytes_nvlink());
        node->set_data_plane_ms(response.data_plane_ms());
        node->set_started_after_request_ms(response.started_after_request_ms());
        node->set_request_arrived_unix_us(response.request_arrived_unix_us());
        if (auto at = sent->at.find(n); at != sent->at.end())
          node->set_request_sent_unix_us(absl::ToUnixMicros(at->second));
        node->set_answered_unix_us(response.answered_unix_us());
        if (auto at = sent->answered.find(n); at != sent->answered.end()) {
          node->set_answer_received_unix_us(absl::ToUnixMicros(at->second));
        }
      }
    }
    return s;
  };
  absl::Time t = clock_->Now();
  if (status.ok()) status = phase(v1::PhaseRequest::PREPARE, options_.prepare_timeout, nullptr);
  stats->set_prepare_seconds(absl::ToDoubleSeconds(clock_->Now() - t));
  int64_t bytes = 0;
  if (status.ok()) {
    stats->set_state(v1::RoundStats::TRANSFERRING);
    log_->Publish(*stats);
    t = clock_->Now();
    status = phase(v1::PhaseRequest::TRANSFER, options_.transfer_timeout, &bytes);
    stats->set_transfer_seconds(absl::ToDoubleSeconds(clock_->Now() - t));
  }
  if (status.ok()) {
    // Write-ahead: the version is in the state file before any node is told to COMMIT it, so a
    // restarted coordinator never reports a lower one nor accepts it again. Not recorded: not
    // committed (the round aborts, every node told).
    if (auto s = state_->RecordVersion(group, version); !s.ok()) {
      status = WithCulprit(
          absl::Status(s.code(), absl::StrCat("the coordinator cannot commit: ", s.message())),
          CoordinatorCulprit(options_.self, PhaseName(v1::PhaseRequest::COMMIT)));
    }
  }
  if (status.ok()) {
    // The commit point: every node finished its TRANSFER, so every destination buffer of the plan
    // holds `version`. The round is committed from here on: COMMIT goes to every node, which
    // delivers it to every worker of the plan still there, and no ABORT of this round follows
    // (docs/ROUNDS.md, "Replicas and commit"). A worker or node that is gone or does not confirm
    // in time is noted, not a reason to abort: what it was sent stands, and a worker that left
    // makes its replica incomplete (it no longer counts, and holds no version until refit whole).
    for (const std::string& r : plan->planned) stats->add_replicas(r);
    for (const std::string& r : plan->incomplete) stats->add_incomplete_replicas(r);
    t = clock_->Now();
    std::map<int32_t, absl::Status> not_confirmed;
    const absl::Status confirmed =
        phase(v1::PhaseRequest::COMMIT, options_.commit_timeout, nullptr, &not_confirmed);
    stats->set_commit_seconds(absl::ToDoubleSeconds(clock_->Now() - t));
    // A replica holds the version only once every rank of it confirmed. A node that failed for
    // one worker (the culprit it names) confirmed the others; one that failed otherwise, or did
    // not answer, confirmed none of its ranks. The replicas left hold no version as far as anyone
    // can tell (a node cut off aborts the round when its lease ends): status shows them so, and
    // the next round refits them whole.
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
    std::vector<std::string> whole, unconfirmed;
    for (const std::string& name : plan->planned) {
      const auto view = std::find_if(plan->replicas.begin(), plan->replicas.end(),
                                     [&](const ReplicaView& v) { return v.name == name; });
      bool all = view != plan->replicas.end();
      if (all) {
        for (int32_t n : view->nodes) all = all && silent_nodes.count(n) == 0;
        for (const std::string& w : view->workers)
          all = all && failed_workers.count(absl::StrCat(group, "/", w)) == 0;
      }
      (all ? whole : unconfirmed).push_back(name);
    }
    for (const std::string& r : unconfirmed) stats->add_unconfirmed_replicas(r);
    if (!confirmed.ok()) {
      stats->set_commit_note(std::string(confirmed.message()));
      Logger("round")->warn(
          "group \"{}\" round {}: committed, but not every worker confirmed; replicas [{}] hold "
          "no version until a round refits them: {}",
          group, round_id, absl::StrJoin(unconfirmed, ", "), std::string(confirmed.message()));
    }
    membership_->RecordCommit(group, epoch, whole, version);
    membership_->RecordCommit(group, epoch, unconfirmed, 0);
    Logger("round")->info("group \"{}\" round {}: version {} to replicas [{}]{}", group, round_id,
                          version, absl::StrJoin(whole, ", "),
                          plan->incomplete.empty()
                              ? std::string()
                              : absl::StrCat("; not to the incomplete [",
                                             absl::StrJoin(plan->incomplete, ", "), "]"));
  }
  stats->set_bytes(bytes);
  stats->set_seconds(absl::ToDoubleSeconds(clock_->Now() - start));
  if (status.ok()) {
    stats->set_state(v1::RoundStats::COMMITTED);
    Logger("round")->info("group \"{}\" round {}: version {} committed, {} bytes in {:.3f} s", group, round_id,
                          version, stats->bytes(), stats->seconds());
  } else {
    status = BlamePause(group, round_id, start, status);
    abort_all(std::string(status.message()));
    std::shared_ptr<FanOut> aborts;
    {
      absl::MutexLock lock(&aborter->mu);
      aborts = aborter->calls;
    }
    // Every node has its ABORT (or gave up on it) before the round is reported over.
    if (aborts != nullptr) aborts->Wait(peer_timeout * 2 + absl::Seconds(1), "ABORT").IgnoreError();
    {
      // The next round installs the plan again, with a fresh communicator: an aborted one is gone.
      absl::MutexLock lock(&mu_);
      groups_[group].installed_epoch.clear();
    }
    stats->set_state(v1::RoundStats::ABORTED);
    stats->set_reason(std::string(status.message()));
    if (auto culprit = CulpritOf(status)) *stats->mutable_culprit() = *std::move(culprit);
    Logger("round")->warn("group \"{}\" round {} aborted: {}", group, round_id, std::string(status.message()));
  }
  log_->Publish(*stats);
  return status.ok() ? status
                     : Rewrap(status, absl::StatusCode::kAborted,
                              absl::StrCat("round ", round_id, " of group \"", group, "\" aborted: ", status.message()));
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
