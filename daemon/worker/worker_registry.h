// The workers registered on this node: a registration validated and its memory mapped, looked
// up by id, dropped when it unregisters or its session ends. It owns each worker's mappings,
// its session outbox and what the worker answered (prepared, resumed, refused), and waits for
// those answers with a deadline (AwaitWorkers).
//
// Locks: `mu_` guards the id -> worker map; each LocalWorker's `mu` guards that worker's session
// state. Never both at once: the map lock is released before a worker's is taken. A session's
// `notify` is called with neither held, so the session may take its own lock and then call back
// into the registry (NextForSession) without a cycle.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/dataplane/backend.h"
#include "daemon/security/worker_admission.h"
#include "daemon/worker/handle_inbox.h"
#include "daemon/worker/registration_check.h"
#include "daemon/worker/registration_limits.h"
#include "proto/refit.pb.h"

namespace refit {

// A worker registered on this node. What it registered (request, buffers) never changes; its
// session state is guarded by `mu`.
struct LocalWorker {
  std::string id;                     // "<group>/<name>"
  v1::RegisterWorkerRequest request;  // worker.node (and worker.gpu, from gpu_uuid) filled in;
                                      // its buffers without their pieces, which are in `wire`
  std::string wire;  // the whole registration, encoded, no memory handles (KeepRegistration)
  v1::RegisterWorkerRequest Full()
      const;  // decodes `wire`: every piece as a message (12x its size)
  // `wire` with its worker as `worker_encoded` (AppendWithWorkerEncoded), held undecoded as
  // unknown fields (its accessors read nothing): what a sync sends, at the cost of one copy of its
  // bytes, and what the coordinator then reads as one string per worker rather than a message
  // per piece.
  v1::RegisterWorkerRequest Encoded() const;
  // The same with every field but the worker decoded: what the coordinator's own membership
  // keeps of one of its node's workers (Membership::AddLocal).
  v1::RegisterWorkerRequest WithWorkerEncoded() const;
  std::vector<std::unique_ptr<MappedBuffer>> buffers;
  absl::flat_hash_map<std::string, int> buffer_index;  // by name: a trainer may hold 100k buffers
  // This registration's secret (worker_admission.h): its session's hello and its Unregister
  // present it. Set before the worker is added, never changed; never logged or synced.
  std::string session_key;
  // When the registry added it (set before, never changed): its session must attach within
  // --worker-attach-timeout of this (ExpireUnattached).
  absl::Time registered_at;
  int64_t added = 0;  // its place in the order of registrations (set before, never changed)

  const std::string& group() const { return request.group(); }

  absl::Mutex mu;
  bool has_session ABSL_GUARDED_BY(mu) = false;  // a session attached (it stays true after)
  // No session attached in time (ExpireUnattached): none ever will; it is being dropped.
  bool attach_expired ABSL_GUARDED_BY(mu) = false;
  // Set by its session at Attach: "look again" (an event queued, the worker gone, stopping).
  std::function<void()> notify ABSL_GUARDED_BY(mu);
  bool gone ABSL_GUARDED_BY(mu) = false;  // unregistered or its session ended: never used again
  std::deque<v1::RoundEvent> outbox ABSL_GUARDED_BY(mu);
  int64_t prepared_round ABSL_GUARDED_BY(mu) = -1;
  int64_t resumed_round ABSL_GUARDED_BY(mu) = -1;
  int64_t refused_round ABSL_GUARDED_BY(mu) = -1;  // the worker refused PREPARE of this round,
  std::string refused_reason ABSL_GUARDED_BY(mu);  // in its own words
};

struct Registration {
  std::shared_ptr<LocalWorker> worker;
  size_t pieces = 0;       // in its layout
  size_t descriptors = 0;  // handed over under its token
  pid_t pid = 0;           // of the connection that handed them over
  uid_t uid = 0;
};

class WorkerRegistry {
 public:
  // `backend` maps memory; `handles` holds descriptors handed over before registration; `gpus`:
  // the GPUs this daemon serves (empty: any). All outlive the registry.
  WorkerRegistry(int32_t node, std::vector<int32_t> gpus, DataBackend* backend,
                 HandleInbox* handles);
  // What one registration may hold (daemon/worker/registration_limits.h); set before serving.
  void SetLimits(const RegistrationLimits& limits) { limits_ = limits; }
  // Who may register (daemon/security/worker_admission.h); set before serving. Default: this
  // process' own uid and root.
  void SetAdmission(WorkerAdmission admission) { admission_ = std::move(admission); }

  // Claims its descriptors, admits (worker_admission.h: by `transport` and the delivery's uid),
  // validates a registration, maps its memory and adds the worker with a fresh session key
  // (ALREADY_EXISTS for a name registered on this node: it belongs to its registration until
  // that is dropped). A worker that declares a tensor otherwise than a worker of its group and
  // side registered here before it (shape, dtype, quantization) is refused, FAILED_PRECONDITION
  // naming both (CheckSameTensors): the first keeps the group, which could not be planned with
  // both; nothing of the refused one is kept, its memory is not mapped.
  absl::StatusOr<Registration> Register(const v1::RegisterWorkerRequest& request,
                                        WorkerTransport transport);
  std::shared_ptr<LocalWorker> Find(const std::string& id) const;
  // Removes a worker and wakes its session; returns it (nullptr: there was none).
  std::shared_ptr<LocalWorker> Drop(const std::string& id);
  // What this node tells the coordinator: every worker, memory handles stripped, each as
  // LocalWorker::Encoded (undecoded: to be sent, not read).
  std::vector<v1::RegisterWorkerRequest> Snapshot() const;

  // OK when `key` is worker `id`'s session key (NOT_FOUND, PERMISSION_DENIED).
  absl::Status CheckKey(const std::string& id, absl::string_view key) const;

  // Sessions. Attach checks `key` (CheckKey), marks the worker's one session (ALREADY_EXISTS) and
  // keeps `notify`, called (no registry lock held, on the caller's thread, possibly concurrently)
  // when an event is queued for it, it is dropped, or the registry stops; the session then asks
  // NextForSession. Detach forgets `notify` (a call already started may still be running).
  absl::StatusOr<std::shared_ptr<LocalWorker>> Attach(const std::string& id, absl::string_view key,
                                                      std::function<void()> notify);
  void Detach(LocalWorker& w);
  // The ids of the workers registered at or before `now - timeout` whose session never
  // attached; each is marked so that no session attaches to it any more (Attach: NOT_FOUND),
  // and the caller drops it as a worker that left (Daemon::DropWorker: the coordinator is told).
  // A registration that never opens its session (a worker that crashed between Register and its
  // hello, or one parked on purpose) would otherwise keep its name, its mappings and its place
  // in the group for good.
  std::vector<std::string> ExpireUnattached(absl::Duration timeout, absl::Time now = absl::Now());
  struct SessionNext {
    std::optional<v1::RoundEvent> event;  // the oldest queued, taken off the outbox
    bool end = false;                     // the worker is gone or the registry stopping
  };
  // Never blocks; takes only the worker's lock.
  SessionNext NextForSession(LocalWorker& w);
  void Record(LocalWorker& w, const v1::WorkerMessage& message);
  bool Gone(LocalWorker& w);

  // Round events. Queues `event` for each of `ids` that is here (ABORTED naming the first that is
  // not; every other one got its event). `reset_prepared` / `reset_resumed` forget answers to an
  // earlier round of the same id first. With `unless_aborted`, the round's aborted-round mark
  // (set before its ABORT is queued), `event` is not queued for a worker once the mark names its
  // round: a PREPARE behind that round's ABORT would leave the worker prepared for a round whose
  // end it has already heard.
  absl::Status Send(const std::vector<std::string>& ids, const v1::RoundEvent& event,
                    bool reset_prepared, bool reset_resumed,
                    const std::atomic<int64_t>* unless_aborted = nullptr);
  // Queues `event` for every worker of `group`.
  void SendToGroup(const std::string& group, const v1::RoundEvent& event);
  // Until each of `ids` answered `round_id` (resumed: COMMIT, else PREPARE), or one left or
  // refused, or `*aborted` (may be null) equals round_id, or the deadline. Errors name the workers.
  absl::Status AwaitWorkers(const std::string& group, const std::vector<std::string>& ids,
                            int64_t round_id, bool resumed, absl::Duration timeout,
                            const char* phase, const std::atomic<int64_t>* aborted);
  // Something an AwaitWorkers may be waiting for changed elsewhere (an abort).
  void Notify();
  // Tells every session to end (they end asynchronously; the gRPC server's shutdown waits).
  void Stop();
  bool stopping() const { return stopping_.load(); }

 private:
  void Changed();
  // Register's steps: the descriptors handed over under the request's token (claimed whatever
  // happens next); the worker's GPU as this daemon numbers it, and served here; the worker added
  // unless its id is taken or a worker added meanwhile conflicts with it.
  absl::StatusOr<HandleDelivery> TakeDelivery(const v1::RegisterWorkerRequest& request,
                                              const std::string& name);
  absl::StatusOr<int32_t> ServedGpu(const v1::RegisterWorkerRequest& request) const;
  absl::Status Add(std::shared_ptr<LocalWorker> worker, const v1::RegisterWorkerRequest& request,
                   const TensorsByName& tensors, int64_t checked_up_to);
  // CheckSameTensors against each worker of `request`'s group and side added after `after`: without
  // the lock held while comparing (`checked_up_to`: the last added then), or with it held.
  absl::Status CheckAgainstGroup(const v1::RegisterWorkerRequest& request,
                                 const TensorsByName& tensors, int64_t after,
                                 int64_t* checked_up_to) const;
  absl::Status CheckAgainstGroupLocked(const v1::RegisterWorkerRequest& request,
                                       const TensorsByName& tensors, int64_t after) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::shared_ptr<LocalWorker>> SameSideLocked(const v1::RegisterWorkerRequest& request,
                                                           int64_t after) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Calls `w`'s session notify, if any, outside every lock.
  static void NotifySession(LocalWorker& w);

  const int32_t node_;
  RegistrationLimits limits_;  // set before any registration, read only after
  WorkerAdmission admission_;  // likewise
  const std::vector<int32_t> gpus_;
  DataBackend* const backend_;
  HandleInbox* const handles_;
  std::atomic<bool> stopping_{false};

  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // an answer, a worker gone, an abort, stopping
  std::map<std::string, std::shared_ptr<LocalWorker>> workers_ ABSL_GUARDED_BY(mu_);
  int64_t changes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t added_ ABSL_GUARDED_BY(mu_) = 0;  // registrations added so far
};

}  // namespace refit
