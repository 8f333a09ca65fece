#include "daemon/log_later.h"

#include <cstdint>
#include <deque>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/logging.h"

namespace refit {
namespace {

struct Line {
  std::string logger;
  spdlog::level::level_enum level;
  spdlog::log_clock::time_point time;
  LogContext context;
  std::string text;
};

void Write(const Line& line) {
  ScopedLogContext context(line.context.group, line.context.round);
  Logger(line.logger)->log(line.time, spdlog::source_loc{}, line.level, line.text);
}

class Writer {
 public:
  Writer() : thread_([this] { Run(); }) { thread_.detach(); }  // lives as long as the process

  void Add(Line line) {
    absl::MutexLock lock(&mu_);
    // Room, or a caller stuck behind a writer that cannot write (stderr blocked): then it writes
    // itself rather than hang; the order of lines may suffer, never their number.
    auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return waiting_.size() < kLaterCapacity; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&room), absl::Seconds(1))) {
      mu_.Unlock();
      Write(line);
      mu_.Lock();
      return;
    }
    waiting_.push_back(std::move(line));
    ++added_;
  }

  bool Flush(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const uint64_t target = added_;
    auto written = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return written_ >= target; };
    return mu_.AwaitWithTimeout(absl::Condition(&written), timeout);
  }

 private:
  void Run() {
    while (true) {
      std::deque<Line> batch;
      {
        absl::MutexLock lock(&mu_);
        auto any = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !waiting_.empty(); };
        mu_.Await(absl::Condition(&any));  // an idle thread's wait for work: no deadline to keep
        batch.swap(waiting_);
      }
      for (const Line& line : batch) Write(line);  // without the lock: callers keep adding
      absl::MutexLock lock(&mu_);
      written_ += batch.size();
    }
  }

  absl::Mutex mu_;
  std::deque<Line> waiting_ ABSL_GUARDED_BY(mu_);
  uint64_t added_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

Writer& TheWriter() {
  static Writer* writer = new Writer;  // never destroyed: lines may be logged during exit
  return *writer;
}

}  // namespace

bool LogLaterEnabled(const std::string& logger, spdlog::level::level_enum level) {
  return Logger(logger)->should_log(level);
}

void LogLater(const std::string& logger, spdlog::level::level_enum level, std::string text) {
  if (!LogLaterEnabled(logger, level)) return;
  TheWriter().Add(Line{logger, level, spdlog::log_clock::now(), CurrentLogContext(), std::move(text)});
}

bool FlushLaterLogs(absl::Duration timeout) { return TheWriter().Flush(timeout); }

}  // namespace refit
