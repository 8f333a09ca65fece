#include "daemon/node/watch_hub.h"

#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace refit {
namespace {

absl::Status Stopping() { return absl::UnavailableError("WatchRounds: the daemon is stopping"); }

}  // namespace

WatchHub::WatchHub(Upstream upstream) : upstream_(std::move(upstream)) {
  thread_ = std::thread([this] { Loop(); });
}

WatchHub::~WatchHub() { Stop(); }

void WatchHub::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (Watcher* w : watchers_) w->end = Stopping();
    changed_.SignalAll();
    // The watches end within a wait of theirs (they hold pointers into this hub until they do).
    const absl::Time give_up = absl::Now() + absl::Seconds(5);
    while (!watchers_.empty() && absl::Now() < give_up) changed_.WaitWithDeadline(&mu_, give_up);
  }
  if (thread_.joinable()) thread_.join();
}

void WatchHub::Loop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      while (!stopping_ && watchers_.empty()) changed_.Wait(&mu_);
      if (stopping_) return;
      streaming_ = true;
      stream_open_ = false;
      ++streams_opened_;
    }
    // Called from the stream's own watchdog thread too.
    std::atomic<bool> stopped_here{false};
    auto stop = [&] {
      absl::MutexLock lock(&mu_);
      const bool stop = stopping_ || watchers_.empty();
      if (stop) stopped_here = true;
      return stop;
    };
    auto opened = [&] {
      absl::MutexLock lock(&mu_);
      stream_open_ = true;
      for (Watcher* w : watchers_) w->open = true;
      changed_.SignalAll();
    };
    auto deliver = [&](const v1::RoundStats& s) {
      Deliver(s);
      return true;
    };
    absl::Status status = upstream_(stop, deliver, opened);
    absl::MutexLock lock(&mu_);
    streaming_ = false;
    stream_open_ = false;
    if (stopping_) status = Stopping();
    if (status.ok() && stopped_here) {
      // Closed for want of watchers; one that came meanwhile is served by the next stream.
      for (Watcher* w : watchers_) w->open = false;
    } else {
      // Ended under its watchers (the coordinator refused it, restarted, or closed it): theirs
      // end as it did.
      for (Watcher* w : watchers_) {
        if (!w->end.has_value()) w->end = status;
      }
    }
    changed_.SignalAll();
  }
}

void WatchHub::Deliver(const v1::RoundStats& s) {
  absl::MutexLock lock(&mu_);
  for (Watcher* w : watchers_) {
    if (!w->open || w->end.has_value()) continue;
    if (!w->group.empty() && w->group != s.group()) continue;
    if (w->queued.size() >= kMaxQueued) {
      w->queued.clear();
      w->end = absl::ResourceExhaustedError(
          absl::StrCat("WatchRounds: this watch fell ", kMaxQueued,
                       " rounds behind the coordinator's stream and was dropped; watch again"));
      continue;
    }
    w->queued.push_back(s);
  }
  changed_.SignalAll();
}

absl::Status WatchHub::Watch(const std::string& group, const std::function<bool()>& cancelled,
                             const std::function<bool(const v1::RoundStats&)>& write,
                             const std::function<void()>& opened) {
  Watcher me;
  me.group = group;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return Stopping();
    me.open = stream_open_;
    watchers_.insert(&me);
    changed_.SignalAll();
  }
  auto leave = [&](absl::Status status) {
    absl::MutexLock lock(&mu_);
    watchers_.erase(&me);
    changed_.SignalAll();
    return status;
  };
  bool told_open = false;
  while (true) {
    std::deque<v1::RoundStats> batch;
    std::optional<absl::Status> end;
    bool open;
    {
      absl::MutexLock lock(&mu_);
      if (me.queued.empty() && !me.end.has_value() && me.open == told_open)
        changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
      batch.swap(me.queued);
      end = me.end;
      open = me.open;
    }
    if (open && !told_open) {
      opened();
      told_open = true;
    }
    for (const v1::RoundStats& s : batch) {
      if (!write(s)) return leave(absl::OkStatus());
    }
    if (!batch.empty()) continue;  // what came meanwhile, or an end, is taken on the next pass
    if (end.has_value()) return leave(*end);
    if (cancelled()) return leave(absl::OkStatus());
  }
}

int WatchHub::watchers() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(watchers_.size());
}

int64_t WatchHub::streams_opened() const {
  absl::MutexLock lock(&mu_);
  return streams_opened_;
}

}  // namespace refit
