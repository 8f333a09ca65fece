// Every round's state changes (preparing, transferring, committed or aborted), kept for
// WatchRounds: the last 1,024, each with a sequence number.
//
// Lock: `mu_` guards the log; a watcher copies what it sends and writes outside it.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "proto/refit.pb.h"

namespace refit {

class RoundLog {
 public:
  // Also tells every listener (after the log's lock is released, on the publishing thread).
  void Publish(const v1::RoundStats& stats);
  // Called with every change published from now on (daemon/ops/metrics.h counts rounds so).
  void AddListener(std::function<void(const v1::RoundStats&)> listener);
  // Sends every change from now on (of `group`, or all when empty) to `write` until it returns
  // false, `cancelled()` is true or the log stops. Checks `cancelled` at least every 200 ms.
  // `opened` is called once "from now on" is fixed: every change published after it is sent.
  void Watch(const std::string& group, const std::function<bool()>& cancelled,
             const std::function<bool(const v1::RoundStats&)>& write,
             const std::function<void()>& opened);
  void Stop();
  // The last `limit` rounds (of `group`, or all when empty), each in its latest state, oldest
  // first: what is still in the log (its last 1,024 state changes).
  std::vector<v1::RoundStats> Recent(const std::string& group, size_t limit) const;

 private:
  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::deque<v1::RoundStats> log_ ABSL_GUARDED_BY(mu_);
  int64_t start_ ABSL_GUARDED_BY(mu_) = 0;  // sequence number of log_.front()
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::function<void(const v1::RoundStats&)>> listeners_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
