// A node's WatchRounds callers share one stream from the coordinator. Each stream the coordinator
// serves holds one of its threads and one of its slots, and a node's daemon forwards for every
// local user at once: streamed one per caller, the callers of one node (8 users of the worker
// socket, 8 each) took every slot of the coordinator, and no one elsewhere could watch. Here the
// coordinator serves one stream per node whatever its callers, and each caller gets the rounds of
// its group from it.
//
// The stream (every group) is opened when the first caller comes and closed when the last leaves;
// when the coordinator ends it (a refusal, its restart), each caller's watch ends with that status.
// A caller that reads slower than rounds come is dropped once kMaxQueued rounds wait for it.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "proto/refit.pb.h"

namespace refit {

class WatchHub {
 public:
  static constexpr size_t kMaxQueued = 1024;

  // One upstream stream of every group's rounds: calls `opened` once the coordinator has it open,
  // `deliver` for each round; returns once `stop()` is true (OK) or the coordinator ended it (its
  // status). CoordinatorLink::ForwardWatch with an empty group.
  using Upstream = std::function<absl::Status(
      const std::function<bool()>& stop, const std::function<bool(const v1::RoundStats&)>& deliver,
      const std::function<void()>& opened)>;

  explicit WatchHub(Upstream upstream);
  ~WatchHub();  // Stop()
  // Ends every watch (UNAVAILABLE) and the stream; later watches are refused. Waits up to 5 s for
  // the watches to return.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  WatchHub(const WatchHub&) = delete;
  WatchHub& operator=(const WatchHub&) = delete;

  // As RoundLog::Watch: writes each round of `group` (empty: every group) until `cancelled()`,
  // a write fails (OK), or the stream ends (its status); `opened` once the stream is open.
  absl::Status Watch(const std::string& group, const std::function<bool()>& cancelled,
                     const std::function<bool(const v1::RoundStats&)>& write,
                     const std::function<void()>& opened) ABSL_LOCKS_EXCLUDED(mu_);

  int watchers() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t streams_opened() const ABSL_LOCKS_EXCLUDED(mu_);  // upstream streams, over time

 private:
  struct Watcher {
    std::string group;
    std::deque<v1::RoundStats> queued;
    bool open = false;                // the stream it belongs to is open
    std::optional<absl::Status> end;  // set when its watch must end
  };

  void Loop();
  void Deliver(const v1::RoundStats& s) ABSL_LOCKS_EXCLUDED(mu_);

  const Upstream upstream_;
  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // a watcher came or left, rounds queued, the stream opened or ended
  absl::flat_hash_set<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
  bool streaming_ ABSL_GUARDED_BY(mu_) = false;
  bool stream_open_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t streams_opened_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace refit
