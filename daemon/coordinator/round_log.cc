#include "daemon/coordinator/round_log.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

namespace refit {

void RoundLog::Publish(const v1::RoundStats& stats) {
  std::vector<std::function<void(const v1::RoundStats&)>> listeners;
  {
    absl::MutexLock lock(&mu_);
    log_.push_back(stats);
    while (log_.size() > 1024) {
      log_.pop_front();
      ++start_;
    }
    changed_.SignalAll();
    listeners = listeners_;
  }
  for (const auto& listen : listeners) listen(stats);
}

void RoundLog::AddListener(std::function<void(const v1::RoundStats&)> listener) {
  absl::MutexLock lock(&mu_);
  listeners_.push_back(std::move(listener));
}

void RoundLog::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  changed_.SignalAll();
}

void RoundLog::Watch(const std::string& group, const std::function<bool()>& cancelled,
                     const std::function<bool(const v1::RoundStats&)>& write,
                     const std::function<void()>& opened) {
  int64_t next;
  {
    absl::MutexLock lock(&mu_);
    next = start_ + static_cast<int64_t>(log_.size());
  }
  opened();
  while (true) {
    std::vector<v1::RoundStats> batch;
    {
      absl::MutexLock lock(&mu_);
      if (!stopping_ && start_ + static_cast<int64_t>(log_.size()) <= next) {
        changed_.WaitWithTimeout(&mu_, absl::Milliseconds(200));
      }
      if (stopping_ || cancelled()) return;
      next = std::max(next, start_);
      for (; next < start_ + static_cast<int64_t>(log_.size()); ++next) {
        const v1::RoundStats& s = log_[next - start_];
        if (group.empty() || group == s.group()) batch.push_back(s);
      }
    }
    for (const auto& s : batch) {
      if (!write(s)) return;
    }
  }
}

std::vector<v1::RoundStats> RoundLog::Recent(const std::string& group, size_t limit) const {
  std::vector<v1::RoundStats> rounds;  // each round's latest state, in the order rounds began
  std::map<std::pair<std::string, int64_t>, size_t> at;
  absl::MutexLock lock(&mu_);
  for (const v1::RoundStats& s : log_) {
    if (!group.empty() && s.group() != group) continue;
    auto [it, fresh] = at.try_emplace({s.group(), s.round_id()}, rounds.size());
    if (fresh) {
      rounds.push_back(s);
    } else {
      rounds[it->second] = s;
    }
  }
  if (rounds.size() > limit)
    rounds.erase(rounds.begin(), rounds.end() - static_cast<std::ptrdiff_t>(limit));
  return rounds;
}

}  // namespace refit
