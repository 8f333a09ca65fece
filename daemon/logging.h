// spdlog loggers, one per subsystem: "rpc", "round", "plan", "xfer", "worker".
#pragma once

#include <memory>
#include <string>

#include "spdlog/spdlog.h"

namespace refit {

// The named logger, created on first use (stderr, "[time] [name] [level] message").
std::shared_ptr<spdlog::logger> Logger(const std::string& name);
// Sets every logger's level: trace, debug, info, warn, error, off.
bool SetLogLevel(const std::string& level);

}  // namespace refit
