// Log lines written by a thread of their own, for the data plane's hot path. A round's report
// (how long it moved, where the time went on each GPU) is worth a line each round, but writing
// the lines to stderr before the node answered TRANSFER cost a colocated refit 0.06-0.09 ms of a
// 0.4 ms transfer phase (one H200). LogLater keeps everything a line says as it was
// when logged (its arguments, its time, the thread's LogContext: the group and round in JSON logs)
// and leaves formatting and writing to the writer thread, which writes what waits every 20 ms (a
// line does not wake it: that cost the logging thread more than writing). So a data plane's lines
// may follow lines logged up to 20 ms after them; each carries the time it was logged at.
// Bounded: past kLaterCapacity lines waiting, the caller waits for room (never drops a line, never
// grows). Lines still waiting when the process is killed are lost; at exit (std::exit, returning
// from main) they are written.
// Why not spdlog's async logger: it formats on its own thread without this thread's LogContext,
// and every logger would become asynchronous where only the hot path needs it.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "absl/time/time.h"
#include "spdlog/fmt/fmt.h"
#include "spdlog/spdlog.h"

namespace refit {

inline constexpr size_t kLaterCapacity = 4096;

// `text` through the named logger (daemon/base/logging.h), written soon by the writer thread.
void LogLater(const std::string& logger, spdlog::level::level_enum level, std::string text);
// True when `logger` would write a line at `level` (to skip formatting one that would not).
bool LogLaterEnabled(const std::string& logger, spdlog::level::level_enum level);
namespace log_later_internal {
void Add(const std::string& logger, spdlog::level::level_enum level,
         std::function<std::string()> text);

// An argument as the line keeps it until it is formatted: text that a pointer or a view refers
// to is copied (its owner may be gone by then); other pointers are refused at compile time.
template <typename T>
auto Owned(T&& value) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, char*> || std::is_same_v<D, const char*>) {
    return value != nullptr ? std::string(value) : std::string("(null)");
  } else if constexpr (std::is_same_v<D, std::string_view> || std::is_same_v<D, fmt::string_view>) {
    return std::string(value.data(), value.size());
  } else {
    static_assert(
        !std::is_pointer_v<D> || std::is_same_v<D, const void*> || std::is_same_v<D, void*>,
        "LogLater formats later: pass what the pointer points to, not the pointer");
    return D(std::forward<T>(value));
  }
}
}  // namespace log_later_internal

// The same, formatted by the writer thread too: the arguments are copied now, text behind
// pointers and views included (formatting a line took 10-15 us of a thread that had just woken,
// more than anything else it did after a round's data plane). The format string is checked at
// compile time; a line that fails to format at run time is written as a note saying so.
template <typename... Args>
void LogLater(const std::string& logger, spdlog::level::level_enum level,
              fmt::format_string<Args...> format, Args&&... args) {
  if (!LogLaterEnabled(logger, level)) return;
  log_later_internal::Add(logger, level,
                          [format = static_cast<fmt::string_view>(format),
                           ... args = log_later_internal::Owned(std::forward<Args>(args))] {
                            return fmt::vformat(format, fmt::make_format_args(args...));
                          });
}
// A line whose text `make_text` makes on the writer thread, from what it captured (by value: it
// runs later, on another thread). For a line of many parts that only the caller can put together,
// formatted off the hot path all the same.
void LogLaterMade(const std::string& logger, spdlog::level::level_enum level,
                  std::function<std::string()> make_text);

// Blocks until every line logged before the call is written, or `timeout` passed (false then).
bool FlushLaterLogs(absl::Duration timeout = absl::Seconds(5));

}  // namespace refit
