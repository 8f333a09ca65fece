// Who may connect to the daemon's unix sockets (the worker socket and its handle socket).
//
// Connecting to a unix socket needs write permission on its file. By default the sockets are the
// daemon user's alone; --worker-uids names other users whose workers may register. They get write
// permission through a POSIX ACL, one entry per uid, and nobody else does: a mode of 0666 would let
// every local user in, and the worker socket also serves RefitControl to its callers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace refit {

// Sets `path` (a socket file the daemon owns) to mode 0600 and, when `uids` names any other user,
// an ACL giving those uids read and write. FAILED_PRECONDITION naming the file and the file
// system's refusal when it keeps no ACLs.
absl::Status GrantSocketAccess(const std::string& path, const std::vector<uint32_t>& uids);

}  // namespace refit
