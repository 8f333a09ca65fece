#include "daemon/base/log_later.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/base/logging.h"

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
  std::string text;
  try {  // as spdlog does for its own formatting: a bad line must not end the process
    text = line.text();
  } catch (const std::exception& e) {
    text = std::string("[a log line could not be formatted: ") + e.what() + "]";
  }
  ScopedLogContext context(line.context.group, line.context.round);
  Logger(line.logger)->log(line.time, spdlog::source_loc{}, line.level, text);
}

// While lines come, the writer wakes every kPeriod, or at once when the lines waiting fill half
// its capacity or a flush waits for lines: a line logged does not wake it (a wake-up cost the
// logging thread 5-40 us, the price this is here to avoid). After a period with nothing to write
// it sleeps until a line comes (the first one wakes it, once a burst): an idle daemon does not
// wake 50 times a second for nothing.
constexpr absl::Duration kPeriod = absl::Milliseconds(20);

class Writer {
 public:
  Writer() : thread_([this] { Run(); }) {
    pthread_setname_np(thread_.native_handle(), "log-later");  // for top -H and the tests
    thread_.detach();
  }

  void Add(Line line) {
    if (!Here()) {  // a child forked from this process: the writer thread is not in it
      Write(line);
      return;
    }
    mu_.Lock();
    if (!stopped_ &&
        waiting_.size() < kLaterCapacity) {  // the common case, without a deadline to compute
      waiting_.push_back(std::move(line));
      ++added_;
      mu_.Unlock();
      return;
    }
    // Room, or a caller stuck behind a writer that cannot write (stderr blocked): then it writes
    // itself rather than wait on; the order of lines may suffer, never their number. After the
    // process began to exit (Stop), every caller writes its own lines.
    auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopped_ || waiting_.size() < kLaterCapacity;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&room), absl::Seconds(1)) || stopped_) {
      mu_.Unlock();
      Write(line);
      return;
    }
    waiting_.push_back(std::move(line));
    ++added_;
    mu_.Unlock();
  }

  bool Flush(absl::Duration timeout) {
    if (!Here()) return true;
    absl::MutexLock lock(&mu_);
    const uint64_t target = added_;
    ++flushing_;
    auto written = [this, target]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return written_ >= target; };
    const bool done = mu_.AwaitWithTimeout(absl::Condition(&written), timeout);
    --flushing_;
    return done;
  }

  // At exit (std::atexit, before spdlog's registry is destroyed): what waits is written, the
  // writer thread ends, and later lines are written by their callers.
  void Stop() {
    if (!Here()) return;
    const bool flushed = Flush(absl::Seconds(5));
    std::deque<Line> rest;
    {
      absl::MutexLock lock(&mu_);
      stopped_ = true;
      if (!flushed) rest.swap(waiting_);  // a writer stuck (on stderr): try them here
    }
    for (const Line& line : rest) Write(line);
  }

 private:
  void Run() {
    bool idle = false;  // the last period had nothing to write
    while (true) {
      std::deque<Line> batch;
      bool stop = false;
      {
        absl::MutexLock lock(&mu_);
        auto urgent = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopped_ || (flushing_ > 0 && !waiting_.empty()) ||
                 waiting_.size() >= kLaterCapacity / 2;
        };
        auto any = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopped_ || !waiting_.empty(); };
        // Idle: until a line comes (the hour only bounds the wait), then a period to gather the
        // lines that follow it.
        if (idle && !mu_.AwaitWithTimeout(absl::Condition(&any), absl::Hours(1))) continue;
        mu_.AwaitWithTimeout(absl::Condition(&urgent), kPeriod);
        stop = stopped_;
        batch.swap(waiting_);
      }
      idle = batch.empty();
      for (const Line& line : batch) Write(line);  // without the lock: callers keep adding
      if (!batch.empty()) {
        absl::MutexLock lock(&mu_);
        written_ += batch.size();
      }
      if (stop) return;
    }
  }

  absl::Mutex mu_;
  std::deque<Line> waiting_ ABSL_GUARDED_BY(mu_);
  uint64_t added_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  int flushing_ ABSL_GUARDED_BY(mu_) = 0;  // callers of Flush waiting
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  // False in a child forked from this process (getpid is a system call each time: 1 us).
  static inline std::atomic<bool> forked_{false};
  static void AtFork() { forked_.store(true, std::memory_order_relaxed); }
  const bool registered_ = pthread_atfork(nullptr, nullptr, &Writer::AtFork) == 0;
  bool Here() const { return !forked_.load(std::memory_order_relaxed); }
  std::thread thread_;  // last: starts once the members above exist
};

Writer& TheWriter() {
  static Writer* writer = [] {
    // spdlog's registry first, so that it is destroyed after the exit handler below has run.
    (void)spdlog::default_logger();
    auto* w = new Writer;  // never destroyed: lines may be logged while the process exits
    std::atexit([] { TheWriter().Stop(); });
    return w;
  }();
  return *writer;
}

}  // namespace

namespace log_later_internal {
void Add(const std::string& logger, spdlog::level::level_enum level,
         std::function<std::string()> text) {
  TheWriter().Add(
      Line{logger, level, spdlog::log_clock::now(), CurrentLogContext(), std::move(text)});
}
}  // namespace log_later_internal

bool LogLaterEnabled(const std::string& logger, spdlog::level::level_enum level) {
  return Logger(logger)->should_log(level);
}

void LogLater(const std::string& logger, spdlog::level::level_enum level, std::string text) {
  if (!LogLaterEnabled(logger, level)) return;
  log_later_internal::Add(logger, level, [text = std::move(text)] { return text; });
}

void LogLaterMade(const std::string& logger, spdlog::level::level_enum level,
                  std::function<std::string()> make_text) {
  if (!LogLaterEnabled(logger, level)) return;
  log_later_internal::Add(logger, level, std::move(make_text));
}

bool FlushLaterLogs(absl::Duration timeout) { return TheWriter().Flush(timeout); }

}  // namespace refit
