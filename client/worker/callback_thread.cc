#include "client/worker/callback_thread.h"

#include <utility>

namespace refit {

CallbackThread::CallbackThread() : thread_([this] { Run(); }) {}

CallbackThread::~CallbackThread() {
  Stop();
  if (thread_.joinable()) thread_.join();  // Stop() from a task left the join to here
}

void CallbackThread::Post(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  if (!stopping_) tasks_.push_back(std::move(task));
}

void CallbackThread::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (!OnThread() && thread_.joinable()) thread_.join();
}

void CallbackThread::Run() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CallbackThread* t)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu_) { return t->stopping_ || !t->tasks_.empty(); },
          this));
      if (tasks_.empty()) return;  // stopping, and everything queued ran
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();  // without the lock: a task may Post
  }
}

}  // namespace refit
