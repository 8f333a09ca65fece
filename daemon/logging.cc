#include "daemon/logging.h"

#include <mutex>

#include "spdlog/sinks/stdout_color_sinks.h"

namespace refit {
namespace {
std::mutex mu;
spdlog::level::level_enum level = spdlog::level::info;
}  // namespace

std::shared_ptr<spdlog::logger> Logger(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu);
  if (auto l = spdlog::get(name)) return l;
  auto l = spdlog::stderr_color_mt(name);
  l->set_level(level);
  l->set_pattern("[%H:%M:%S.%e] [%n] [%l] %v");
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

}  // namespace refit
