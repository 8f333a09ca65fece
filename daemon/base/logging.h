// spdlog loggers, one per subsystem: "rpc", "round", "plan", "xfer", "worker".
// Text lines carry the date and time in UTC ("[2026-12-01T11:31:14.123Z] [round] [info] ...");
// `--log-format json` writes one JSON object a line (daemon/base/json_log_formatter.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace refit {

// The named logger, created on first use (stderr, in the current format).
std::shared_ptr<spdlog::logger> Logger(const std::string& name);
// Sets every logger's level: trace, debug, info, warn, error, off. False for anything else.
bool SetLogLevel(const std::string& level);
// Sets every logger's format: "text" or "json" (with `node` in each object). False otherwise.
bool SetLogFormat(const std::string& format, int32_t node);

// "HH:MM:SS.uuuuuu": `t`'s time of day in UTC, as every log line's time is printed. For the hot
// path: absl::FormatTime took 9 us (one H200 host's VM and this 2-core one alike), this 0.2.
std::string UtcTimeOfDay(absl::Time t);

// What this thread is doing, for structured logs: the group and round of the phase it runs.
struct LogContext {
  std::string group;
  int64_t round = -1;
};
const LogContext& CurrentLogContext();

// Sets the thread's LogContext for its lifetime (restores the previous one after).
class ScopedLogContext {
 public:
  ScopedLogContext(std::string group, int64_t round);
  ~ScopedLogContext();
  ScopedLogContext(const ScopedLogContext&) = delete;
  ScopedLogContext& operator=(const ScopedLogContext&) = delete;

 private:
  LogContext saved_;
};

}  // namespace refit
