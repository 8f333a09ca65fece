#include "daemon/ops/memory_trim.h"

#include <malloc.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace refit {
namespace {

class Trimmer {
 public:
  Trimmer() : thread_([this] { Run(); }) {}
  ~Trimmer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Request() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      requested_ = true;
    }
    cv_.notify_all();
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return requested_ || stop_; });
      // Once the requests stop for 200 ms: a trim of a large heap holds glibc's locks for a
      // while, so it waits for the work that asked to be over.
      while (requested_ && !stop_) {
        requested_ = false;
        cv_.wait_for(lock, std::chrono::milliseconds(200), [&] { return stop_; });
      }
      if (stop_) return;
      lock.unlock();
      malloc_trim(0);
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool requested_ = false, stop_ = false;
  std::thread thread_;  // last: started once the rest exists
};

}  // namespace

void RequestTrim() {
  static Trimmer* trimmer = new Trimmer;  // never destroyed: requests may come during exit
  trimmer->Request();
}

}  // namespace refit
