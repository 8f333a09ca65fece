// Logs a collector can index: every JSON line parses, carries the node and, inside a round, its
// group and round; hostile message text (quotes, newlines, control bytes, broken UTF-8) cannot
// break a line or forge a field.
#include "daemon/base/logging.h"

#include <catch2/catch.hpp>

#include "daemon/base/json_log_formatter.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace refit {
namespace {

google::protobuf::Struct Line(JsonLogFormatter& f, const std::string& logger,
                              spdlog::level::level_enum level, const std::string& message) {
  spdlog::details::log_msg msg(logger, level, message);
  spdlog::memory_buf_t out;
  f.format(msg, out);
  const std::string line(out.data(), out.size());
  REQUIRE(!line.empty());
  CHECK(line.back() == '\n');
  CHECK(line.find('\n') == line.size() - 1);  // one line, whatever the message holds
  google::protobuf::Struct s;
  REQUIRE(google::protobuf::util::JsonStringToMessage(line, &s).ok());
  return s;
}

TEST_CASE("json logs: one object a line with time, level, logger, node, group, round, message") {
  JsonLogFormatter f(3);
  google::protobuf::Struct outside = Line(f, "rpc", spdlog::level::warn, "heartbeat failed");
  CHECK(outside.fields().at("level").string_value() == "warning");
  CHECK(outside.fields().at("logger").string_value() == "rpc");
  CHECK(outside.fields().at("node").number_value() == 3);
  CHECK(outside.fields().at("message").string_value() == "heartbeat failed");
  CHECK(outside.fields().count("group") == 0);
  CHECK(outside.fields().count("round") == 0);
  const std::string time = outside.fields().at("time").string_value();
  CHECK(time.size() == std::string("2026-12-01T11:31:14.123456Z").size());
  CHECK(time[4] == '-');
  CHECK(time[10] == 'T');
  CHECK(time.back() == 'Z');
  {
    ScopedLogContext context("policy", 7);
    google::protobuf::Struct inside = Line(f, "round", spdlog::level::info, "moved");
    CHECK(inside.fields().at("group").string_value() == "policy");
    CHECK(inside.fields().at("round").number_value() == 7);
    {
      ScopedLogContext nested("reward", 2);
      CHECK(Line(f, "round", spdlog::level::info, "x").fields().at("group").string_value() ==
            "reward");
    }
    CHECK(Line(f, "round", spdlog::level::info, "x").fields().at("group").string_value() ==
          "policy");
  }
  CHECK(Line(f, "round", spdlog::level::info, "x").fields().count("group") == 0);
}

TEST_CASE("json logs: message text cannot break the line or forge fields") {
  JsonLogFormatter f(0);
  const std::string hostile =
      "worker \"a\"\",\"level\":\"info\nsecond line\\\t\x01\x7f broken \xff\xfe end";
  ScopedLogContext context("g\"roup\n", 1);
  google::protobuf::Struct s = Line(f, "worker", spdlog::level::err, hostile);
  CHECK(s.fields().at("level").string_value() == "error");
  CHECK(s.fields().at("group").string_value() == "g\"roup\n");
  const std::string message = s.fields().at("message").string_value();
  CHECK(message.find("worker \"a\"\",\"level\":\"info\nsecond line\\\t\x01\x7f broken ") == 0);
  CHECK(message.find("\xef\xbf\xbd\xef\xbf\xbd end") !=
        std::string::npos);  // each bad byte -> U+FFFD
  CHECK(JsonEscape("caf\xc3\xa9 \xe2\x82\xac") == "caf\xc3\xa9 \xe2\x82\xac");  // valid UTF-8 kept
}

TEST_CASE("log level and format: unknown names refused") {
  CHECK(SetLogLevel("warn"));
  CHECK_FALSE(SetLogLevel("verbose"));
  CHECK(SetLogLevel("info"));
  CHECK(SetLogFormat("json", 1));
  CHECK_FALSE(SetLogFormat("yaml", 1));
  CHECK(SetLogFormat("text", 1));
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST_CASE(
    "UtcTimeOfDay prints what absl::FormatTime prints in UTC, before 1970 and at midnight too") {
  for (int64_t us :
       {int64_t{0}, int64_t{1}, int64_t{86399999999}, int64_t{86400000000},
        int64_t{1796192918815999}, int64_t{-1}, int64_t{-86400000001}, int64_t{4102444799999999}}) {
    const absl::Time t = absl::FromUnixMicros(us);
    INFO(us);
    CHECK(UtcTimeOfDay(t) == absl::FormatTime("%H:%M:%E6S", t, absl::UTCTimeZone()));
  }
  CHECK(UtcTimeOfDay(absl::FromUnixMicros(3723000004)) == "01:02:03.000004");
}

}  // namespace
}  // namespace refit
