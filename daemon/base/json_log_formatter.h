// refitd's `--log-format json`: one JSON object per line, for log collectors (Kubernetes: Loki,
// Elasticsearch, Cloud Logging) to index without regular expressions:
//   {"time":"2026-12-01T11:31:14.123456Z","level":"info","logger":"round","node":1,
//    "group":"policy","round":7,"message":"..."}
// "group" and "round" come from the thread's ScopedLogContext (daemon/base/logging.h) and are left
// out where no round is being run. Hand-written rather than a JSON library: one flat object of
// strings and integers, escaped per RFC 8259.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "spdlog/formatter.h"

namespace refit {

class JsonLogFormatter : public spdlog::formatter {
 public:
  explicit JsonLogFormatter(int32_t node) : node_(node) {}
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override;
  std::unique_ptr<spdlog::formatter> clone() const override;

 private:
  const int32_t node_;
};

// `text` as the contents of a JSON string (quotes, backslashes and control characters escaped;
// bytes that are not UTF-8 replaced by U+FFFD, so every line stays valid JSON).
std::string JsonEscape(std::string_view text);

}  // namespace refit
