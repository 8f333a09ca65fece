// Lines logged for later are written as they were logged: every one of them, in order, with the
// time they were logged at and the group and round of the thread that logged them; more lines
// than the writer holds make the caller wait, not lose any.
#include "daemon/base/log_later.h"

#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "daemon/base/json_log_formatter.h"
#include "daemon/base/logging.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "spdlog/sinks/ostream_sink.h"

namespace refit {
namespace {

// First in this file: the child must be the process that starts the writer (a child forked after
// the parent started it writes its lines itself).
TEST_CASE("log later: lines still waiting are written when the process exits") {
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    for (int i = 0; i < 500; ++i)
      LogLater("exit_test", spdlog::level::info, "exit line {} of 500", i);
    std::exit(0);  // no flush: the exit handler writes them
  }
  close(fds[1]);
  std::string got;
  char buffer[4096];
  for (ssize_t n; (n = read(fds[0], buffer, sizeof buffer)) > 0;)
    got.append(buffer, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  int lines = 0;
  for (size_t at = 0; (at = got.find(" of 500", at)) != std::string::npos; ++at) ++lines;
  CHECK(lines == 500);
  CHECK(got.find("exit line 499 of 500") != std::string::npos);
}

// Arguments are copied when the line is logged and formatted later: text behind a pointer or a
// view whose owner is gone by then, numbers with their precision.
TEST_CASE("log later: arguments formatted later are the ones logged") {
  std::ostringstream out;
  auto logger = std::make_shared<spdlog::logger>(
      "later_args", std::make_shared<spdlog::sinks::ostream_sink_mt>(out));
  logger->set_pattern("%v");
  spdlog::register_logger(logger);
  {
    std::string owner = "policy-7";
    const char* pointer = owner.c_str();
    const std::string_view view = owner;
    LogLater("later_args", spdlog::level::info, "{} {} {} {:.3f} {}", std::string("temporary"),
             pointer, view, 2.0 / 3, 42);
    owner.assign(owner.size(), 'x');  // what a later reader of the pointer or view would see
  }
  const char* none = nullptr;
  LogLater("later_args", spdlog::level::info, "none: {}", none);
  REQUIRE(FlushLaterLogs(absl::Seconds(10)));
  CHECK(out.str() == "temporary policy-7 policy-7 0.667 42\nnone: (null)\n");
  spdlog::drop("later_args");
}

// A line made on the writer thread: from what its maker captured, in order with the others, and
// not at all below the logger's level (not even made).
TEST_CASE("log later: a line made later is made from what was captured, in order") {
  std::ostringstream out;
  auto logger = std::make_shared<spdlog::logger>(
      "later_made", std::make_shared<spdlog::sinks::ostream_sink_mt>(out));
  logger->set_pattern("%v");
  spdlog::register_logger(logger);
  std::vector<int> parts = {1, 2, 3};
  LogLater("later_made", spdlog::level::info, "before");
  LogLaterMade("later_made", spdlog::level::info, [parts] {
    std::string line = "parts:";
    for (int p : parts) line += " " + std::to_string(p);
    return line;
  });
  parts.push_back(4);  // after the line was logged: not in it
  bool made = false;
  LogLaterMade("later_made", spdlog::level::debug, [&made] {
    made = true;
    return std::string("below the level");
  });
  LogLater("later_made", spdlog::level::info, "after");
  REQUIRE(FlushLaterLogs(absl::Seconds(10)));
  CHECK(out.str() == "before\nparts: 1 2 3\nafter\n");
  CHECK_FALSE(made);
  spdlog::drop("later_made");
}

// The writer thread's voluntary context switches so far (-1: no thread named log-later).
int64_t WriterWakeUps() {
  const std::string task = "/proc/self/task/";
  for (const auto& entry : std::filesystem::directory_iterator(task)) {
    std::ifstream comm(entry.path() / "comm");
    std::string name;
    std::getline(comm, name);
    if (name != "log-later") continue;
    std::ifstream status(entry.path() / "status");
    for (std::string line; std::getline(status, line);) {
      int64_t n = 0;
      if (absl::StartsWith(line, "voluntary_ctxt_switches:") &&
          absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(line.find(':') + 1)), &n)) {
        return n;
      }
    }
  }
  return -1;
}

// An idle daemon's writer sleeps until a line comes (it woke every 20 ms, 50 times a second, for
// nothing); the first line after the quiet still gets written, unflushed, within a period or two.
TEST_CASE("log later: an idle writer does not wake, and the next line still comes out") {
  std::ostringstream out;
  auto logger = std::make_shared<spdlog::logger>(
      "later_idle", std::make_shared<spdlog::sinks::ostream_sink_mt>(out));
  logger->set_pattern("%v");
  spdlog::register_logger(logger);
  LogLater("later_idle", spdlog::level::info, "first");
  REQUIRE(FlushLaterLogs(absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(100));  // a period with nothing to write: idle
  const int64_t before = WriterWakeUps();
  REQUIRE(before >= 0);
  absl::SleepFor(absl::Milliseconds(500));
  CHECK(WriterWakeUps() - before <= 2);  // 25 at one wake-up every 20 ms
  LogLater("later_idle", spdlog::level::info, "after the quiet");
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (out.str().find("after the quiet") == std::string::npos && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  CHECK(out.str() == "first\nafter the quiet\n");
  spdlog::drop("later_idle");
}

TEST_CASE("log later: every line, in order, with its time and its thread's group and round") {
  std::ostringstream out;
  auto logger = std::make_shared<spdlog::logger>(
      "later_test", std::make_shared<spdlog::sinks::ostream_sink_mt>(out));
  logger->set_formatter(std::make_unique<JsonLogFormatter>(4));
  logger->set_level(spdlog::level::info);
  spdlog::register_logger(logger);

  constexpr int kLines = static_cast<int>(kLaterCapacity) * 3;  // past the capacity: callers wait
  absl::Time logged_by;
  {
    ScopedLogContext context("policy", 9);
    CHECK(LogLaterEnabled("later_test", spdlog::level::info));
    CHECK_FALSE(LogLaterEnabled("later_test", spdlog::level::debug));
    LogLater("later_test", spdlog::level::debug, "below the level: never written");
    for (int i = 0; i < kLines; ++i)
      LogLater("later_test", spdlog::level::info, "line " + std::to_string(i));
    logged_by = absl::Now();
  }
  LogLater("later_test", spdlog::level::warn, "outside any round");
  absl::SleepFor(
      absl::Milliseconds(20));  // a writer stamping lines when it writes them would show it
  REQUIRE(FlushLaterLogs(absl::Seconds(10)));

  std::vector<std::string> lines = absl::StrSplit(out.str(), '\n', absl::SkipEmpty());
  REQUIRE(lines.size() == static_cast<size_t>(kLines) + 1);
  for (int i = 0; i <= kLines; ++i) {
    google::protobuf::Struct s;
    REQUIRE(google::protobuf::util::JsonStringToMessage(lines[i], &s).ok());
    const auto& f = s.fields();
    CHECK(f.at("node").number_value() == 4);
    absl::Time time;
    std::string err;
    REQUIRE(absl::ParseTime(absl::RFC3339_full, f.at("time").string_value(), &time, &err));
    if (i < kLines) {
      REQUIRE(f.at("message").string_value() == "line " + std::to_string(i));
      CHECK(f.at("group").string_value() == "policy");
      CHECK(f.at("round").number_value() == 9);
      CHECK(time <= logged_by);
    } else {
      CHECK(f.at("message").string_value() == "outside any round");
      CHECK(f.at("level").string_value() == "warning");
      CHECK(f.count("group") == 0);
    }
  }
  spdlog::drop("later_test");
}

}  // namespace
}  // namespace refit
