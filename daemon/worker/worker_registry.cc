#include "daemon/worker/worker_registry.h"

#include <malloc.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/base/culprit.h"
#include "daemon/base/logging.h"
#include "daemon/ops/memory_trim.h"
#include "daemon/worker/registration_check.h"
#include "google/protobuf/unknown_field_set.h"

namespace refit {

namespace {

// `worker "a"`, or `workers "a", "b"` (at most 16 named, then how many more): every worker of a
// phase's failure is named, not only the first.
std::string QuotedWorkers(const std::vector<std::string>& ids) {
  constexpr size_t kNamed = 16;
  std::string out = ids.size() > 1 ? "workers " : "worker ";
  for (size_t i = 0; i < ids.size() && i < kNamed; ++i) {
    absl::StrAppend(&out, i > 0 ? ", " : "", "\"", ids[i], "\"");
  }
  if (ids.size() > kNamed) absl::StrAppend(&out, " and ", ids.size() - kNamed, " more");
  return out;
}

}  // namespace

WorkerRegistry::WorkerRegistry(int32_t node, std::vector<int32_t> gpus, DataBackend* backend,
                               HandleInbox* handles)
    : node_(node), gpus_(std::move(gpus)), backend_(backend), handles_(handles) {}

absl::StatusOr<Registration> WorkerRegistry::Register(const v1::RegisterWorkerRequest& original,
                                                      WorkerTransport transport) {
  // The worker as its encoding, everything else as messages (registration_decoder.h): nothing
  // below decodes its pieces as messages. Cut, not decoded: its pieces are looked at only once
  // the caller is admitted.
  absl::StatusOr<SplitRegistration> split = SplitRegistration::Of(original);
  const std::string& name = split.ok() ? split->header().worker().name() : original.worker().name();
  // The descriptors handed over under the token are claimed first, whatever happens next: they
  // are closed when this returns (mapped memory stays mapped), so a registration that fails
  // leaves nothing behind; the worker hands them over again under a new token.
  auto delivery = TakeDelivery(original, name);
  if (!delivery.ok()) return delivery.status();
  if (!split.ok()) return split.status();
  const v1::RegisterWorkerRequest& request = split->header();
  // Who registers, before anything of the request is looked at further.
  if (auto s = admission_.Admit(request, transport, !request.fd_token().empty(), delivery->uid);
      !s.ok()) {
    Logger("worker")->warn("refused a registration of \"{}/{}\": {}", request.group(),
                           request.worker().name(), std::string(s.message()));
    return s;
  }
  // Its size and names, before anything of it is decoded or mapped.
  if (auto s = CheckRegistration(*split, limits_); !s.ok()) return s;
  // gRPC freed the request's receive buffers (its size, in small chunks) in its own threads'
  // arenas, which this thread's copies below cannot reuse: given back first, they do not add to
  // the peak. Quick now that nothing as large is decoded as messages (memory_trim.h).
  if (split->request_bytes() >= kTrimAfterBytes) malloc_trim(0);
  if (auto s = CheckRegistrationFields(request); !s.ok()) return s;
  const v1::Worker& w = request.worker();
  auto served = ServedGpu(request);
  if (!served.ok()) return served.status();
  const int32_t gpu = *served;
  auto checked =
      CheckRegistrationLayout(*split, node_, delivery->fds.size(), gpu);  // registration_check.h
  if (!checked.ok()) return checked.status();
  const size_t pieces = checked->layout.pieces.size();
  checked->layout = Layout();  // checked: what it holds is not needed any more
  // Before its memory is mapped: a worker that cannot join its group is refused with nothing kept.
  const TensorsByName tensors = IndexTensors(request);
  int64_t checked_up_to = 0;
  if (auto s = CheckAgainstGroup(request, tensors, 0, &checked_up_to); !s.ok()) return s;
  auto worker = std::make_shared<LocalWorker>();
  worker->id = absl::StrCat(request.group(), "/", w.name());
  auto kept = KeepRegistration(*split, node_, gpu);
  if (!kept.ok()) return kept.status();
  worker->request = std::move(kept->header);
  worker->wire = std::move(kept->wire);
  auto mapped = backend_->MapBuffers(worker->request, checked->buffer_bytes, delivery->fds);
  if (!mapped.ok()) {
    return absl::Status(mapped.status().code(), absl::StrCat("register: worker \"", w.name(),
                                                             "\": ", mapped.status().message()));
  }
  worker->buffers = *std::move(mapped);
  worker->session_key = NewSessionKey();
  for (int b = 0; b < w.buffers_size(); ++b) worker->buffer_index[w.buffers(b).name()] = b;
  if (auto s = Add(worker, request, tensors, checked_up_to); !s.ok()) return s;
  Registration out;
  out.worker = std::move(worker);
  out.pieces = pieces;
  out.descriptors = delivery->fds.size();
  out.pid = delivery->pid;
  out.uid = delivery->uid;
  return out;
}

absl::StatusOr<HandleDelivery> WorkerRegistry::TakeDelivery(
    const v1::RegisterWorkerRequest& request, const std::string& name) {
  HandleDelivery delivery;
  if (request.fd_token().empty()) return delivery;
  const std::string& token = request.fd_token();
  if (token.size() != kHandleTokenChars || !std::all_of(token.begin(), token.end(), [](char c) {
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
      })) {
    return absl::InvalidArgumentError(absl::StrCat("register: worker \"", name,
                                                   "\": fd_token must be ", kHandleTokenChars,
                                                   " lowercase hex digits"));
  }
  auto taken = handles_->Take(token);
  if (!taken.ok()) {
    return absl::Status(taken.status().code(), absl::StrCat("register: worker \"", name,
                                                            "\": ", taken.status().message()));
  }
  return *std::move(taken);
}

absl::StatusOr<int32_t> WorkerRegistry::ServedGpu(const v1::RegisterWorkerRequest& request) const {
  const v1::Worker& w = request.worker();
  int32_t gpu = w.gpu();
  if (!request.gpu_uuid().empty()) {
    // The worker's CUDA index is its own (CUDA_VISIBLE_DEVICES); the UUID is everyone's.
    auto index = backend_->GpuIndex(request.gpu_uuid());
    if (!index.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("register: worker \"", w.name(), "\": ", index.status().message()));
    }
    gpu = *index;
  }
  if (!gpus_.empty() && std::find(gpus_.begin(), gpus_.end(), gpu) == gpus_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("register: worker \"", w.name(), "\" is on GPU ", gpu, ", which node ", node_,
                     "'s daemon does not serve (--gpus ", absl::StrJoin(gpus_, ","), ")"));
  }
  return gpu;
}

absl::Status WorkerRegistry::Add(std::shared_ptr<LocalWorker> worker,
                                 const v1::RegisterWorkerRequest& request,
                                 const TensorsByName& tensors, int64_t checked_up_to) {
  absl::MutexLock lock(&mu_);
  if (workers_.contains(worker->id)) {
    return absl::AlreadyExistsError(absl::StrCat("worker \"", worker->id,
                                                 "\" is already registered on node ", node_,
                                                 "; unregister it first"));
  }
  // Only the workers added since Register's unlocked check: whoever was first keeps the group.
  if (auto s = CheckAgainstGroupLocked(request, tensors, checked_up_to); !s.ok()) return s;
  worker->registered_at = absl::Now();
  worker->added = ++added_;
  workers_[worker->id] = std::move(worker);
  return absl::OkStatus();
}

absl::Status WorkerRegistry::CheckAgainstGroup(const v1::RegisterWorkerRequest& request,
                                               const TensorsByName& tensors, int64_t after,
                                               int64_t* checked_up_to) const {
  std::vector<std::shared_ptr<LocalWorker>> same;
  {
    absl::MutexLock lock(&mu_);
    *checked_up_to = added_;
    same = SameSideLocked(request, after);
  }
  // Compared outside the lock: a group's tables may be large; what a worker registered never
  // changes.
  for (const auto& other : same) {
    if (auto s = CheckSameTensors(request, tensors, other->request, other->id); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status WorkerRegistry::CheckAgainstGroupLocked(const v1::RegisterWorkerRequest& request,
                                                     const TensorsByName& tensors,
                                                     int64_t after) const {
  for (const auto& other : SameSideLocked(request, after)) {
    if (auto s = CheckSameTensors(request, tensors, other->request, other->id); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::vector<std::shared_ptr<LocalWorker>> WorkerRegistry::SameSideLocked(
    const v1::RegisterWorkerRequest& request, int64_t after) const {
  std::vector<std::shared_ptr<LocalWorker>> out;
  const std::string id = absl::StrCat(request.group(), "/", request.worker().name());
  for (const auto& [other_id, w] : workers_) {
    // A registration under its own name is ALREADY_EXISTS, which a restarted worker waits out
    // while its predecessor's session ends; its predecessor's tensors are not the group's then.
    if (w->added <= after || other_id == id) continue;
    if (w->group() == request.group() && w->request.role() == request.role()) out.push_back(w);
  }
  return out;
}

std::shared_ptr<LocalWorker> WorkerRegistry::Find(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : it->second;
}

std::shared_ptr<LocalWorker> WorkerRegistry::Drop(const std::string& id) {
  std::shared_ptr<LocalWorker> w;
  {
    absl::MutexLock lock(&mu_);
    auto it = workers_.find(id);
    if (it == workers_.end()) return nullptr;
    w = std::move(it->second);
    workers_.erase(it);
  }
  {
    absl::MutexLock lock(&w->mu);
    w->gone = true;
  }
  NotifySession(*w);
  Changed();
  if (static_cast<int64_t>(w->wire.size()) >= kTrimAfterBytes)
    RequestTrim();  // once the caller let it go
  return w;
}

std::vector<v1::RegisterWorkerRequest> WorkerRegistry::Snapshot() const {
  std::vector<v1::RegisterWorkerRequest> out;
  absl::MutexLock lock(&mu_);
  out.reserve(workers_.size());
  for (const auto& [id, w] : workers_) {
    out.push_back(w->Encoded());  // handles stay on this node: `wire` has none
  }
  return out;
}

v1::RegisterWorkerRequest LocalWorker::Full() const {
  v1::RegisterWorkerRequest r;
  if (!r.ParseFromString(wire)) r = request;  // cannot happen: KeepRegistration wrote it
  return r;
}

v1::RegisterWorkerRequest LocalWorker::Encoded() const {
  v1::RegisterWorkerRequest r;
  std::string rest, worker;
  google::protobuf::UnknownFieldSet* fields = r.GetReflection()->MutableUnknownFields(&r);
  if (!SplitOutWorker(wire, &rest, &worker) || !fields->ParseFromString(rest))
    return Full();  // cannot happen, as above
  *fields->AddLengthDelimited(v1::RegisterWorkerRequest::kWorkerEncodedFieldNumber) =
      std::move(worker);
  return r;
}

v1::RegisterWorkerRequest LocalWorker::WithWorkerEncoded() const {
  v1::RegisterWorkerRequest r;
  std::string rest, worker;
  if (!SplitOutWorker(wire, &rest, &worker) || !r.ParseFromString(rest))
    return Full();  // cannot happen, as above
  r.set_worker_encoded(std::move(worker));
  return r;
}

namespace {

absl::Status KeyStatus(const LocalWorker& w, absl::string_view key) {
  if (SessionKeyMatches(w.session_key, key)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "worker \"", w.id, "\": ", key.empty() ? "no session key given" : "wrong session key",
      " (the session_key its Register answered: a worker's name belongs to its registration)"));
}

}  // namespace

absl::Status WorkerRegistry::CheckKey(const std::string& id, absl::string_view key) const {
  std::shared_ptr<LocalWorker> w = Find(id);
  if (w == nullptr)
    return absl::NotFoundError(absl::StrCat("no worker \"", id, "\" on node ", node_));
  return KeyStatus(*w, key);
}

absl::StatusOr<std::shared_ptr<LocalWorker>> WorkerRegistry::Attach(const std::string& id,
                                                                    absl::string_view key,
                                                                    std::function<void()> notify) {
  std::shared_ptr<LocalWorker> w = Find(id);
  if (w == nullptr)
    return absl::NotFoundError(absl::StrCat("no worker \"", id, "\" on node ", node_));
  if (auto s = KeyStatus(*w, key); !s.ok()) return s;  // this registration's key, not a later one's
  absl::MutexLock lock(&w->mu);
  if (w->attach_expired || w->gone) {
    // Being dropped (ExpireUnattached) or already dropped: its name is free again soon.
    return absl::NotFoundError(absl::StrCat("worker \"", w->id,
                                            "\" is no longer registered on node ", node_,
                                            " (its session did not open in time); register again"));
  }
  if (w->has_session)
    return absl::AlreadyExistsError(absl::StrCat("worker \"", w->id, "\" already has a session"));
  w->has_session = true;
  w->notify = std::move(notify);
  // Registering is over, its sync too: what they decoded and copied is freed (memory_trim.h).
  if (static_cast<int64_t>(w->wire.size()) >= kTrimAfterBytes) RequestTrim();
  return w;
}

std::vector<std::string> WorkerRegistry::ExpireUnattached(absl::Duration timeout, absl::Time now) {
  std::vector<std::shared_ptr<LocalWorker>> old;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, w] : workers_) {
      if (now - w->registered_at >= timeout) old.push_back(w);
    }
  }
  std::vector<std::string> out;
  for (const auto& w : old) {  // the map's lock released before a worker's is taken
    absl::MutexLock lock(&w->mu);
    if (w->has_session || w->gone) continue;
    w->attach_expired = true;
    out.push_back(w->id);
  }
  return out;
}

void WorkerRegistry::Detach(LocalWorker& w) {
  std::function<void()>
      old;  // destroyed outside the lock: it may hold the session's last reference
  absl::MutexLock lock(&w.mu);
  old = std::move(w.notify);
  w.notify = nullptr;
}

WorkerRegistry::SessionNext WorkerRegistry::NextForSession(LocalWorker& w) {
  SessionNext next;
  absl::MutexLock lock(&w.mu);
  // Events still queued for a worker that is gone are dropped, as is everything once stopping.
  if (w.gone || stopping()) {
    next.end = true;
    return next;
  }
  if (!w.outbox.empty()) {
    next.event = std::move(w.outbox.front());
    w.outbox.pop_front();
  }
  return next;
}

void WorkerRegistry::NotifySession(LocalWorker& w) {
  std::function<void()> notify;
  {
    absl::MutexLock lock(&w.mu);
    notify = w.notify;
  }
  if (notify) notify();
}

void WorkerRegistry::Record(LocalWorker& w, const v1::WorkerMessage& m) {
  {
    absl::MutexLock lock(&w.mu);
    if (m.kind_case() == v1::WorkerMessage::kPrepared) w.prepared_round = m.prepared();
    if (m.kind_case() == v1::WorkerMessage::kResumed) w.resumed_round = m.resumed();
    if (m.kind_case() == v1::WorkerMessage::kRefused) {
      w.refused_round = m.refused().round_id();
      w.refused_reason = m.refused().reason().substr(0, 4096);  // it reaches operators: bounded
      Logger("worker")->warn("worker {} refused round {}: {}", w.id, w.refused_round,
                             w.refused_reason);
    }
  }
  Changed();
}

bool WorkerRegistry::Gone(LocalWorker& w) {
  absl::MutexLock lock(&w.mu);
  return w.gone;
}

absl::Status WorkerRegistry::Send(const std::vector<std::string>& ids, const v1::RoundEvent& event,
                                  bool reset_prepared, bool reset_resumed,
                                  const std::atomic<int64_t>* unless_aborted) {
  std::vector<std::string> missing;
  for (const std::string& id : ids) {
    std::shared_ptr<LocalWorker> w = Find(id);
    if (w == nullptr) {
      // The others get theirs all the same: a COMMIT reaches every worker still here (a replica's
      // ranks on this node learn the version together), whoever left.
      missing.push_back(id);
      continue;
    }
    {
      absl::MutexLock lock(&w->mu);
      // Read under the worker's lock: an ABORT queued before this point was marked before it.
      if (unless_aborted != nullptr && unless_aborted->load() == event.round_id()) continue;
      if (reset_prepared) {
        w->prepared_round = -1;
        w->refused_round = -1;
      }
      if (reset_resumed) w->resumed_round = -1;
      w->outbox.push_back(event);
    }
    NotifySession(*w);
  }
  if (missing.empty()) return absl::OkStatus();
  const bool commit = event.kind() == v1::RoundEvent::COMMIT;
  return WithCulprit(
      absl::AbortedError(
          commit ? absl::StrCat(QuotedWorkers(missing), " left node ", node_, " before the commit")
                 : absl::StrCat(QuotedWorkers(missing), missing.size() > 1 ? " are" : " is",
                                " no longer on node ", node_)),
      WorkerCulprit(node_, missing.front(), commit ? "COMMIT" : "PREPARE"));
}

void WorkerRegistry::SendToGroup(const std::string& group, const v1::RoundEvent& event) {
  std::vector<std::shared_ptr<LocalWorker>> members;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, w] : workers_) {
      if (w->group() == group) members.push_back(w);
    }
  }
  for (const auto& w : members) {
    {
      absl::MutexLock lock(&w->mu);
      w->outbox.push_back(event);
    }
    NotifySession(*w);
  }
}

absl::Status WorkerRegistry::AwaitWorkers(const std::string& group,
                                          const std::vector<std::string>& ids, int64_t round_id,
                                          bool resumed, absl::Duration timeout, const char* phase,
                                          const std::atomic<int64_t>* aborted) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int64_t seen_changes;
    {
      absl::MutexLock lock(&mu_);
      seen_changes = changes_;
    }
    std::vector<std::string> waiting, left;
    for (const std::string& id : ids) {
      std::shared_ptr<LocalWorker> w = Find(id);
      if (w == nullptr) {
        // Before the commit point one departure ends the round. A COMMIT is already decided:
        // the others are still awaited, so that every worker that did not confirm is named.
        if (!resumed) {
          return WithCulprit(absl::AbortedError(absl::StrCat("worker \"", id, "\" on node ", node_,
                                                             " left during ", phase)),
                             WorkerCulprit(node_, id, phase));
        }
        left.push_back(id);
        continue;
      }
      absl::MutexLock lock(&w->mu);
      if (!resumed && w->refused_round == round_id) {  // the round cannot happen: end it now
        return WithCulprit(absl::AbortedError(absl::StrCat("worker \"", id, "\" on node ", node_,
                                                           " refused ", phase, " of round ",
                                                           round_id, ": ", w->refused_reason)),
                           WorkerCulprit(node_, id, phase));
      }
      const int64_t seen = resumed ? w->resumed_round : w->prepared_round;
      if (seen != round_id) waiting.push_back(id);
    }
    if (waiting.empty() && left.empty()) return absl::OkStatus();
    if (waiting.empty()) {
      return WithCulprit(absl::AbortedError(absl::StrCat(QuotedWorkers(left), " on node ", node_,
                                                         " left during ", phase)),
                         WorkerCulprit(node_, left.front(), phase));
    }
    if (aborted != nullptr && aborted->load() == round_id) {
      return absl::AbortedError(absl::StrCat("node ", node_, ": round ", round_id, " of group \"",
                                             group, "\" was aborted during ", phase));
    }
    if (stopping()) return absl::UnavailableError("daemon shutting down");
    if (absl::Now() >= deadline) {
      // The first of them is named the culprit (all are listed, and those that left).
      return WithCulprit(
          absl::DeadlineExceededError(
              absl::StrCat("node ", node_, ": ", QuotedWorkers(waiting), " did not confirm ", phase,
                           " of group \"", group, "\" within ", absl::FormatDuration(timeout),
                           left.empty() ? "" : absl::StrCat("; ", QuotedWorkers(left), " left"))),
          WorkerCulprit(node_, waiting.front(), phase));
    }
    absl::MutexLock lock(&mu_);
    if (changes_ == seen_changes) changed_.WaitWithTimeout(&mu_, absl::Milliseconds(50));
  }
}

void WorkerRegistry::Changed() {
  absl::MutexLock lock(&mu_);
  ++changes_;
  changed_.SignalAll();
}

void WorkerRegistry::Notify() { Changed(); }

void WorkerRegistry::Stop() {
  stopping_ = true;
  std::vector<std::shared_ptr<LocalWorker>> all;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, w] : workers_) all.push_back(w);
  }
  for (const auto& w : all) NotifySession(*w);
  Changed();
}

}  // namespace refit
