// A serial executor: tasks run one at a time, in the order posted, on one thread of their own.
//
// The worker library runs its users' callbacks here rather than on the session's reading thread:
// gRPC's synchronous client polls a channel (answers keepalive pings, reads frames) only while a
// thread waits in a call on it, so a callback that took longer than the keepalive timeout (1 s)
// on the reading thread made the library itself declare the daemon gone and drop the session.
#pragma once

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace refit {

class CallbackThread {
 public:
  CallbackThread();
  ~CallbackThread();  // Stop()
  CallbackThread(const CallbackThread&) = delete;
  CallbackThread& operator=(const CallbackThread&) = delete;

  // Queues `task`; dropped once Stop() was called. Never blocks on a running task.
  void Post(std::function<void()> task);
  // Runs what is queued, then ends the thread and joins it. From a task on this very thread it
  // only asks the thread to end after that task (it cannot join itself); the destructor joins.
  void Stop();
  bool OnThread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  void Run();

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace refit
