#include "daemon/ops/memory_trim.h"

#include <malloc.h>

#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace refit {
namespace {

class Trimmer {
 public:
  Trimmer() : thread_([this] { Run(); }) {}
  ~Trimmer() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Request() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    requested_ = true;
  }

 private:
  bool RequestedOrStopped() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return requested_ || stop_; }

  void Run() ABSL_LOCKS_EXCLUDED(mu_) {
    mu_.Lock();
    while (true) {
      mu_.Await(absl::Condition(this, &Trimmer::RequestedOrStopped));
      // Once the requests stop for 200 ms: a trim of a large heap holds glibc's locks for a
      // while, so it waits for the work that asked to be over.
      while (requested_ && !stop_) {
        requested_ = false;
        mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(200));
      }
      if (stop_) break;
      mu_.Unlock();  // the trim runs outside the lock: requests keep coming meanwhile
      malloc_trim(0);
      mu_.Lock();
    }
    mu_.Unlock();
  }

  absl::Mutex mu_;
  bool requested_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the rest exists
};

}  // namespace

void RequestTrim() {
  static Trimmer* trimmer = new Trimmer;  // never destroyed: requests may come during exit
  trimmer->Request();
}

}  // namespace refit
