// Every round's state changes (preparing, transferring, committed or aborted), kept for
// WatchRounds: the last 1,024, each with a sequence number.
//
// Lock: `mu_` guards the log; a watcher copies what it sends and writes outside it.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "proto/refit.pb.h"

namespace refit {

class RoundLog {
 public:
  void Publish(const v1::RoundStats& stats);
  // Sends every change from now on (of `group`, or all when empty) to `write` until it returns
  // false, `cancelled()` is true or the log stops. Checks `cancelled` at least every 200 ms.
  void Watch(const std::string& group, const std::function<bool()>& cancelled,
             const std::function<bool(const v1::RoundStats&)>& write);
  void Stop();

 private:
  absl::Mutex mu_;
  absl::CondVar changed_;
  std::deque<v1::RoundStats> log_ ABSL_GUARDED_BY(mu_);
  int64_t start_ ABSL_GUARDED_BY(mu_) = 0;  // sequence number of log_.front()
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace refit
