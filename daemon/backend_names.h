// The names --backend accepts: the one list that config validation and the backend factory
// (backend_factory.h) both read. Apart from the factory because the factory makes backends from a
// DaemonConfig, so it depends on //daemon:config, which cannot depend on it in turn.
#pragma once

#include <array>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace refit {

inline constexpr absl::string_view kCudaBackend = "cuda";
inline constexpr absl::string_view kHostBackend = "host";
// Sorted: the order errors list them in. The factory has one entry per name, in this order
// (checked when it compiles).
inline constexpr std::array<absl::string_view, 2> kBackendNames = {kCudaBackend, kHostBackend};

// "cuda, host".
std::string KnownBackendNames();
// OK for a name in kBackendNames; otherwise INVALID_ARGUMENT:
// `--backend must be one of: cuda, host (got "x")`.
absl::Status CheckBackendName(absl::string_view name);

}  // namespace refit
