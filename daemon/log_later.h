// Log lines written by a thread of their own, for the data plane's hot path. A round's report
// (how long it moved, where the time went on each GPU) is worth a line each round, but writing
// the lines to stderr before the node answered TRANSFER cost a colocated refit 0.06-0.09 ms of a
// 0.4 ms transfer phase (session 15, one H200). LogLater keeps everything a line says as it was
// when logged (its text, its time, the thread's LogContext: the group and round in JSON logs) and
// leaves only the write to the writer thread, which writes what waits every 20 ms (a line does
// not wake it: that cost the logging thread more than writing). Bounded: past kLaterCapacity lines
// waiting, the caller waits for room (never drops a line, never grows). Lines still waiting when
// the process is killed are lost; refitd flushes them on every orderly exit.
// Why not spdlog's async logger: it formats on its own thread, where this thread's LogContext is
// not, and every logger would become asynchronous where only the hot path needs it.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/time/time.h"
#include "spdlog/fmt/fmt.h"
#include "spdlog/spdlog.h"

namespace refit {

inline constexpr size_t kLaterCapacity = 4096;

// `text` through the named logger (daemon/logging.h), written soon by the writer thread.
void LogLater(const std::string& logger, spdlog::level::level_enum level, std::string text);
// True when `logger` would write a line at `level` (to skip formatting one that would not).
bool LogLaterEnabled(const std::string& logger, spdlog::level::level_enum level);
namespace log_later_internal {
void Add(const std::string& logger, spdlog::level::level_enum level, std::function<std::string()> text);
}  // namespace log_later_internal

// The same, formatted by the writer thread too: the arguments are copied now (formatting a line
// took 10-15 us of a thread that had just woken, more than anything else it did after a round's
// data plane). The format string is checked at compile time.
template <typename... Args>
void LogLater(const std::string& logger, spdlog::level::level_enum level, fmt::format_string<Args...> format,
              Args&&... args) {
  if (!LogLaterEnabled(logger, level)) return;
  log_later_internal::Add(logger, level,
                          [format = static_cast<fmt::string_view>(format),
                           ... args = std::decay_t<Args>(std::forward<Args>(args))] {
                            return fmt::vformat(format, fmt::make_format_args(args...));
                          });
}
// Blocks until every line logged before the call is written, or `timeout` passed (false then).
bool FlushLaterLogs(absl::Duration timeout = absl::Seconds(5));

}  // namespace refit
