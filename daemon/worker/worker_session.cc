#include "daemon/worker/worker_session.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/base/grpc_status.h"
#include "daemon/base/logging.h"

namespace refit {

struct WorkerSessions::Shared {
  WorkerRegistry* registry = nullptr;
  WorkerLostFn lost;
  mutable absl::Mutex mu;
  int live ABSL_GUARDED_BY(mu) = 0;
};

namespace {

class SessionReactor final : public grpc::ServerBidiReactor<v1::WorkerMessage, v1::RoundEvent> {
 public:
  explicit SessionReactor(std::shared_ptr<WorkerSessions::Shared> shared)
      : shared_(std::move(shared)) {}

  // `self` owns this reactor until OnDone; the registry's notify holds only a weak reference, so
  // a notify racing OnDone finds either a live reactor (that ignores it) or nothing.
  void Begin(std::shared_ptr<SessionReactor> self) {
    self_ = std::move(self);
    StartReading();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-closed, or the call is over
      End(attached()
              ? grpc::Status::OK
              : ToGrpc(absl::InvalidArgumentError("a session starts with hello(worker_id)")));
      return;
    }
    std::shared_ptr<LocalWorker> w = worker();
    if (w == nullptr) {
      if (in_.kind_case() != v1::WorkerMessage::kHello) {
        End(ToGrpc(absl::InvalidArgumentError("a session starts with hello(worker_id)")));
        return;
      }
      std::weak_ptr<SessionReactor> weak = self_;
      // The hello presents the registration's session key: a name belongs to whoever registered it.
      auto attached = shared_->registry->Attach(in_.hello(), in_.session_key(), [weak] {
        if (std::shared_ptr<SessionReactor> r = weak.lock()) r->Step();
      });
      if (!attached.ok()) {
        End(ToGrpc(attached.status()));
        return;
      }
      absl::MutexLock lock(&mu_);
      worker_ = *std::move(attached);
    } else {
      shared_->registry->Record(*w, in_);
    }
    StartReading();  // then Step: after the hello, what was queued before it
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok)
        EndLocked(grpc::Status::OK);  // the stream is broken: nothing more reaches the worker
    }
    Step();
  }

  void OnCancel() override {
    End(grpc::Status(grpc::StatusCode::CANCELLED, "the session was cancelled"));
  }

  void OnDone() override {
    std::shared_ptr<LocalWorker> w;
    {
      absl::MutexLock lock(&mu_);
      w = std::move(worker_);
      worker_ = nullptr;
    }
    WorkerRegistry& registry = *shared_->registry;
    if (w != nullptr) {
      registry.Detach(*w);
      if (!registry.Gone(*w))
        shared_->lost(w->id, "its session ended (process exited or connection lost)");
    }
    w.reset();  // before the count drops: the last reference unmaps through the backend
    std::shared_ptr<WorkerSessions::Shared> shared = shared_;
    {
      absl::MutexLock lock(&shared->mu);
      --shared->live;
    }
    std::shared_ptr<SessionReactor> me = std::move(self_);  // may delete this: nothing after it
  }

  // Writes the next queued event if none is in flight, or finishes the call once it should end
  // and nothing is in flight. Called by the registry's notify, after each read and write.
  void Step() {
    bool write = false;
    bool finish = false;
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      if (!ending_ && !writing_ && worker_ != nullptr) {
        // Reactor lock -> worker lock, the one order (the registry notifies with no lock held).
        WorkerRegistry::SessionNext next = shared_->registry->NextForSession(*worker_);
        if (next.end) {
          EndLocked(shared_->registry->stopping()
                        ? ToGrpc(absl::UnavailableError("the daemon is shutting down"))
                        : grpc::Status::OK);  // dropped: unregistered
        } else if (next.event.has_value()) {
          out_ = *std::move(next.event);
          writing_ = true;
          write = true;
        }
      }
      if (ending_ && !writing_ && starting_reads_ == 0 && !finished_) {
        finished_ = true;
        finish = true;
        status = status_;
      }
    }
    if (write) StartWrite(&out_);  // out_ is left alone until OnWriteDone
    if (finish) Finish(status);
  }

 private:
  bool attached() {
    absl::MutexLock lock(&mu_);
    return worker_ != nullptr;
  }
  std::shared_ptr<LocalWorker> worker() {
    absl::MutexLock lock(&mu_);
    return worker_;
  }
  // `starting_reads_` covers only the start of a read, not the wait for the worker: Finish must
  // not race a StartRead, but may be called with a read pending (the call's end completes it).
  // A count, not a flag: the read may complete (and start the next) before StartRead returns.
  void StartReading() {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      ++starting_reads_;
    }
    StartRead(&in_);
    {
      absl::MutexLock lock(&mu_);
      --starting_reads_;
    }
    Step();  // a Finish held back while the read started
  }
  void End(grpc::Status status) {
    {
      absl::MutexLock lock(&mu_);
      EndLocked(std::move(status));
    }
    Step();
  }
  void EndLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ending_) return;
    ending_ = true;
    status_ = std::move(status);
  }

  const std::shared_ptr<WorkerSessions::Shared> shared_;
  std::shared_ptr<SessionReactor> self_;  // set by Begin, dropped by OnDone
  v1::WorkerMessage in_;                  // one read at a time: only OnReadDone looks at it
  v1::RoundEvent out_;                    // one write at a time: set only while none is in flight

  absl::Mutex mu_;
  std::shared_ptr<LocalWorker> worker_ ABSL_GUARDED_BY(mu_);  // from the hello on, until OnDone
  int starting_reads_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish called
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

WorkerSessions::WorkerSessions(WorkerRegistry* registry, WorkerLostFn lost)
    : shared_(std::make_shared<Shared>()) {
  shared_->registry = registry;
  shared_->lost = std::move(lost);
}

WorkerSessions::~WorkerSessions() {
  // The server's shutdown finished every call; a session still in its OnDone (calling `lost`)
  // is waited for, so that it never reaches a registry that is gone.
  if (!WaitIdle(absl::Seconds(10))) {
    Logger("worker")->error("{} worker sessions still not done at shutdown", live());
  }
}

grpc::ServerBidiReactor<v1::WorkerMessage, v1::RoundEvent>* WorkerSessions::Start(
    grpc::CallbackServerContext*) {
  {
    absl::MutexLock lock(&shared_->mu);
    ++shared_->live;
  }
  auto reactor = std::make_shared<SessionReactor>(shared_);
  SessionReactor* raw = reactor.get();
  raw->Begin(std::move(reactor));
  return raw;
}

int WorkerSessions::live() const {
  absl::MutexLock lock(&shared_->mu);
  return shared_->live;
}

bool WorkerSessions::WaitIdle(absl::Duration timeout) const {
  absl::MutexLock lock(&shared_->mu);
  return shared_->mu.AwaitWithTimeout(absl::Condition(
                                          +[](int* live) { return *live == 0; }, &shared_->live),
                                      timeout);
}

}  // namespace refit
