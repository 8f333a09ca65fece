#include "daemon/base/json_log_formatter.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/base/logging.h"
#include "daemon/base/utf8.h"

namespace refit {

std::string JsonEscape(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 8);
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    switch (c) {
      case '"':
        out += "\\\"";
        ++i;
        continue;
      case '\\':
        out += "\\\\";
        ++i;
        continue;
      case '\n':
        out += "\\n";
        ++i;
        continue;
      case '\r':
        out += "\\r";
        ++i;
        continue;
      case '\t':
        out += "\\t";
        ++i;
        continue;
      default:
        break;
    }
    if (c < 0x20 || c == 0x7f) {
      static const char kHex[] = "0123456789abcdef";
      out += "\\u00";
      out += kHex[c >> 4];
      out += kHex[c & 15];
      ++i;
      continue;
    }
    const size_t n = Utf8SequenceLength(absl::string_view(text.data(), text.size()), i);
    if (n == 0) {
      out += "\xef\xbf\xbd";  // U+FFFD
      ++i;
      continue;
    }
    out.append(text.substr(i, n));
    i += n;
  }
  return out;
}

void JsonLogFormatter::format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) {
  const absl::Time t = absl::FromChrono(msg.time);
  const spdlog::string_view_t level = spdlog::level::to_string_view(msg.level);
  std::string line =
      absl::StrCat("{\"time\":\"", absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", t, absl::UTCTimeZone()),
                   "\",\"level\":\"", std::string(level.data(), level.size()), "\",\"logger\":\"",
                   JsonEscape(std::string_view(msg.logger_name.data(), msg.logger_name.size())),
                   "\",\"node\":", node_);
  const LogContext& context = CurrentLogContext();
  if (!context.group.empty())
    absl::StrAppend(&line, ",\"group\":\"", JsonEscape(context.group), "\"");
  if (context.round >= 0) absl::StrAppend(&line, ",\"round\":", context.round);
  absl::StrAppend(&line, ",\"message\":\"",
                  JsonEscape(std::string_view(msg.payload.data(), msg.payload.size())), "\"}\n");
  dest.append(line.data(), line.data() + line.size());
}

std::unique_ptr<spdlog::formatter> JsonLogFormatter::clone() const {
  return std::make_unique<JsonLogFormatter>(node_);
}

}  // namespace refit
