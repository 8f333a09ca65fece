// A bounded pool of threads that runs queued tasks, joined when it stops: work that must not
// block its caller (a round started by StartRefit, this node's part of a phase) runs here
// instead of on a thread of its own that nobody joins.
#pragma once

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace refit {

class Executor {
 public:
  // Threads start as tasks need them, at most `max_threads`; tasks beyond wait in order.
  explicit Executor(int max_threads);
  ~Executor();  // Stop()
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `task`; false (and `task` dropped) once stopping.
  bool Submit(std::function<void()> task);
  // Runs what is queued, then joins every thread. Idempotent.
  void Stop();
  int threads() const;

 private:
  void Loop();

  const int max_threads_;
  mutable absl::Mutex mu_;
  absl::CondVar wake_;  // a task queued, or stopping
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
