// UTF-8 validation, shared by what checks names (registration_limits) and what escapes log text
// (json_log_formatter): one definition of "valid", RFC 3629 (no overlong forms, no surrogates,
// nothing above U+10FFFF).
#pragma once

#include <cstddef>

#include "absl/strings/string_view.h"

namespace refit {

// Length of the valid UTF-8 sequence starting at s[i] (1 to 4), or 0 where none starts there.
inline size_t Utf8SequenceLength(absl::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  const size_t n = c < 0x80                 ? 1
                   : c >= 0xc2 && c <= 0xdf ? 2
                   : c >= 0xe0 && c <= 0xef ? 3
                   : c >= 0xf0 && c <= 0xf4 ? 4
                                            : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xc0) != 0x80) return 0;
  }
  if (n == 3 && ((c == 0xe0 && b(1) < 0xa0) || (c == 0xed && b(1) >= 0xa0))) return 0;
  if (n == 4 && ((c == 0xf0 && b(1) < 0x90) || (c == 0xf4 && b(1) >= 0x90))) return 0;
  return n;
}

}  // namespace refit
