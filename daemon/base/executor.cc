#include "daemon/base/executor.h"

namespace refit {

Executor::Executor(int max_threads) : max_threads_(max_threads < 1 ? 1 : max_threads) {}

Executor::~Executor() { Stop(); }

bool Executor::Submit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return false;
  queue_.push_back(std::move(task));
  wake_.Signal();
  if (idle_ < static_cast<int>(queue_.size()) && static_cast<int>(threads_.size()) < max_threads_) {
    threads_.emplace_back([this] { Loop(); });
  }
  return true;
}

void Executor::Loop() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      ++idle_;
      // Woken by Submit or Stop; the timeout only bounds the wait (nothing waits forever).
      while (queue_.empty() && !stopping_) wake_.WaitWithTimeout(&mu_, absl::Seconds(1));
      --idle_;
      if (queue_.empty()) return;  // stopping, and nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void Executor::Stop() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    threads.swap(threads_);
    wake_.SignalAll();
  }
  for (std::thread& t : threads) t.join();
}

int Executor::threads() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(threads_.size());
}

}  // namespace refit
