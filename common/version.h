// refit's version: reported by refitd (StatusResponse.version, its start-up log line) and
// refitctl (`refitctl version`). Raised with each release.
#pragma once

namespace refit {

inline constexpr char kRefitVersion[] = "0.12.0";

}  // namespace refit
