// The data planes refitd can run, by --backend name: each a name, one line saying what it is, and
// how to make it from the daemon's config. Daemon::Start makes its backend here; a new data plane
// (a folder of its own under daemon/dataplane/) is one entry in backend_factory.cc and one name in
// backend_names.h. The data planes know nothing of this registry, nor of each other.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "daemon/config.h"
#include "daemon/dataplane/backend.h"
#include "daemon/security/loopback_owner.h"

namespace refit {

// What a data plane may need from the daemon besides its config.
struct BackendContext {
  // Without TLS, who may reach this daemon's ports (the host data plane checks its data
  // connections, both ways); null under TLS.
  std::shared_ptr<const LoopbackUsers> local_users;
};

using BackendMaker = absl::StatusOr<std::unique_ptr<DataBackend>> (*)(
    const DaemonConfig& config, const BackendContext& context);

struct BackendEntry {
  absl::string_view name;         // as --backend names it
  absl::string_view description;  // one line, for people
  BackendMaker make;
};

// Every data plane, in kBackendNames' order (sorted by name).
absl::Span<const BackendEntry> Backends();
// The entry named `name`; null when there is none.
const BackendEntry* FindBackend(absl::string_view name);
// The data plane config.backend names, started; INVALID_ARGUMENT naming the known ones when there
// is none by that name, or the data plane's own error when it cannot start.
absl::StatusOr<std::unique_ptr<DataBackend>> MakeBackend(const DaemonConfig& config,
                                                         const BackendContext& context);

}  // namespace refit
