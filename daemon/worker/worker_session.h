// A worker's session: the bidirectional stream over which its daemon sends round events
// (PREPARE, COMMIT, ABORT) and the worker answers (prepared, resumed, refused). The session
// ending means the worker is gone.
//
// On gRPC's callback API: one ServerBidiReactor per session and no thread of its own. The first
// read is the hello (registry.Attach); every later read is recorded (registry.Record) and the
// next read started from OnReadDone. Events reach the session as the registry's notify (called by
// whoever queued the event, no registry lock held); the reactor takes them from the outbox with
// one write in flight at a time, the next from OnWriteDone. The session ends when the worker
// half-closes or vanishes (a read or write fails), the call is cancelled (the client, its
// connection, or the server's shutdown deadline), the worker is dropped (unregistered: no `lost`)
// or the registry stops; Finish is called once, after the write in flight (if any) completed, and
// OnDone calls `lost(id, reason)` exactly once unless the worker had been dropped already.
// Keepalive is the server's channel arguments' business (daemon.cc), as on the sync API.
//
// Locks: the reactor's one mutex guards its state. It is held across registry.NextForSession
// (which takes only that worker's lock, and the registry never calls a session with any of its
// locks held: the order is reactor -> worker, never back), and never across a call into gRPC
// (StartRead, StartWrite, Finish), Attach, Record or `lost`, which may re-enter the reactor (a
// drop notifies it) or block.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/worker/worker_registry.h"
#include "proto/refit.grpc.pb.h"

namespace refit {

using WorkerLostFn = std::function<void(const std::string& id, const std::string& reason)>;

// The sessions of one RefitWorker service: makes their reactors and knows how many are not done,
// so that the service can wait for the last one to leave the registry before the registry goes.
class WorkerSessions {
 public:
  // `registry` outlives every session; `lost` runs when a session ended without the worker
  // having been dropped, from OnDone on a gRPC callback thread: what blocks belongs elsewhere
  // (the RefitWorker service hands the drop to its executor).
  WorkerSessions(WorkerRegistry* registry, WorkerLostFn lost);
  ~WorkerSessions();  // waits (bounded) for sessions still finishing
  WorkerSessions(const WorkerSessions&) = delete;
  WorkerSessions& operator=(const WorkerSessions&) = delete;

  // The reactor for one Session call; it deletes itself once gRPC is done with it.
  grpc::ServerBidiReactor<v1::WorkerMessage, v1::RoundEvent>* Start(
      grpc::CallbackServerContext* context);
  // Sessions whose OnDone has not finished.
  int live() const;
  // Until none is live, at most `timeout`; false if some still are.
  bool WaitIdle(absl::Duration timeout) const;

  struct Shared;  // what the reactors share with their maker (they may outlive it)

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace refit
