// Lines logged for later are written as they were logged: every one of them, in order, with the
// time they were logged at and the group and round of the thread that logged them; more lines
// than the writer holds make the caller wait, not lose any.
#include "daemon/log_later.h"

#include <catch2/catch.hpp>

#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "daemon/json_log_formatter.h"
#include "daemon/logging.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "spdlog/sinks/ostream_sink.h"

namespace refit {
namespace {

TEST_CASE("log later: every line, in order, with its time and its thread's group and round") {
  std::ostringstream out;
  auto logger = std::make_shared<spdlog::logger>("later_test", std::make_shared<spdlog::sinks::ostream_sink_mt>(out));
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
    for (int i = 0; i < kLines; ++i) LogLater("later_test", spdlog::level::info, "line " + std::to_string(i));
    logged_by = absl::Now();
  }
  LogLater("later_test", spdlog::level::warn, "outside any round");
  absl::SleepFor(absl::Milliseconds(20));  // a writer stamping lines when it writes them would show it
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
