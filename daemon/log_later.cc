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
  std::function<std::string()> text;
};

void Write(const Line& line) {
  ScopedLogContext context(line.context.group, line.context.round);
  Logger(line.logger)->log(line.time, spdlog::source_loc{}, line.level, line.text());
}

// The writer wakes every kPeriod, or at once when the lines waiting fill half its capacity or a
// flush is asked for: a line logged does not wake it (a wake-up cost the logging thread 5-40 us,
// the price this is here to avoid).
constexpr absl::Duration kPeriod = absl::Milliseconds(20);

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
    ++flushing_;
    auto written = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return written_ >= target; };
    const bool done = mu_.AwaitWithTimeout(absl::Condition(&written), timeout);
    --flushing_;
    return done;
  }

 private:
  void Run() {
    while (true) {
      std::deque<Line> batch;
      {
        absl::MutexLock lock(&mu_);
        auto urgent = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return flushing_ > 0 || waiting_.size() >= kLaterCapacity / 2;
        };
        mu_.AwaitWithTimeout(absl::Condition(&urgent), kPeriod);
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
  int flushing_ ABSL_GUARDED_BY(mu_) = 0;  // callers of Flush waiting
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

namespace log_later_internal {
void Add(const std::string& logger, spdlog::level::level_enum level, std::function<std::string()> text) {
  TheWriter().Add(Line{logger, level, spdlog::log_clock::now(), CurrentLogContext(), std::move(text)});
}
}  // namespace log_later_internal

void LogLater(const std::string& logger, spdlog::level::level_enum level, std::string text) {
  if (!LogLaterEnabled(logger, level)) return;
  log_later_internal::Add(logger, level, [text = std::move(text)] { return text; });
}

bool FlushLaterLogs(absl::Duration timeout) { return TheWriter().Flush(timeout); }

}  // namespace refit
