#include "daemon/backend_names.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace refit {

std::string KnownBackendNames() { return absl::StrJoin(kBackendNames, ", "); }

absl::Status CheckBackendName(absl::string_view name) {
  if (std::find(kBackendNames.begin(), kBackendNames.end(), name) != kBackendNames.end())
    return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--backend must be one of: ", KnownBackendNames(), " (got \"", name, "\")"));
}

}  // namespace refit
