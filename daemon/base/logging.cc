#include "daemon/base/logging.h"

#include <cstdio>
#include <mutex>

#include "daemon/base/json_log_formatter.h"
#include "spdlog/sinks/stdout_color_sinks.h"

namespace refit {
namespace {
std::mutex mu;
spdlog::level::level_enum level = spdlog::level::info;
bool json = false;
int32_t json_node = 0;
thread_local LogContext context;

constexpr char kPattern[] = "[%Y-%m-%dT%H:%M:%S.%eZ] [%n] [%l] %v";

void Format(spdlog::logger& l) {
  if (json) {
    l.set_formatter(std::make_unique<JsonLogFormatter>(json_node));
  } else {
    l.set_pattern(kPattern, spdlog::pattern_time_type::utc);
  }
}
}  // namespace

std::shared_ptr<spdlog::logger> Logger(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu);
  if (auto l = spdlog::get(name)) return l;
  auto l = spdlog::stderr_color_mt(name);
  l->set_level(level);
  Format(*l);
  return l;
}

bool SetLogLevel(const std::string& name) {
  const auto parsed = spdlog::level::from_str(name);
  if (parsed == spdlog::level::off && name != "off") return false;
  std::lock_guard<std::mutex> lock(mu);
  level = parsed;
  spdlog::set_level(parsed);
  return true;
}

bool SetLogFormat(const std::string& format, int32_t node) {
  if (format != "text" && format != "json") return false;
  std::lock_guard<std::mutex> lock(mu);
  json = format == "json";
  json_node = node;
  spdlog::apply_all([](const std::shared_ptr<spdlog::logger>& l) { Format(*l); });
  return true;
}

std::string UtcTimeOfDay(absl::Time t) {
  // Unix time has no leap seconds: a day is 86400 s, and the time of day is what is left over.
  constexpr int64_t kDay = int64_t{86400} * 1000000;
  const int64_t us = ((absl::ToUnixMicros(t) % kDay) + kDay) % kDay;
  const int64_t s = us / 1000000;
  char text[24];
  std::snprintf(text, sizeof(text), "%02d:%02d:%02d.%06d", static_cast<int>(s / 3600),
                static_cast<int>(s / 60 % 60), static_cast<int>(s % 60),
                static_cast<int>(us % 1000000));
  return text;
}

const LogContext& CurrentLogContext() { return context; }

ScopedLogContext::ScopedLogContext(std::string group, int64_t round) : saved_(context) {
  context = LogContext{std::move(group), round};
}

ScopedLogContext::~ScopedLogContext() { context = std::move(saved_); }

}  // namespace refit
