// Who may register a worker, and who may act for a registered one.
//
// Admission: a registration that reaches the daemon on its unix socket must come with a handle
// delivery (RegisterWorkerRequest.fd_token, zero descriptors allowed): the delivering
// connection's SO_PEERCRED uid is the registering process' identity, and only the uids of
// --worker-uids (empty: the daemon's own and root) are admitted. gRPC tells us nothing of a unix
// peer's credentials, which is why the handle socket carries them. A registration over TCP (only
// with --worker-listen: workers in another network namespace) has no credentials to check and
// is admitted by the transport alone: the operator who opens that listener vouches for its
// network. CUDA IPC memory needs a delivery on every transport, so that the registration is tied
// to a process that was identified. Whether that process is the one that exported the IPC
// handle cannot be checked: cudaIpcMemHandle_t is documented only as an opaque 64-byte value,
// and neither the runtime nor the driver API says which process exported a handle (no pointer
// attribute names it); reading a pid out of the bytes would rest on an undocumented layout. So
// a process of an admitted uid can still register another process' exported handle; CUDA VMM
// (descriptors, which only their owner can hand over) is the form that ties memory to its owner.
//
// Session keys: Register answers a secret (128 random bits, hex) that the session's hello and
// Unregister must present; compared in constant time, so that timing tells nothing of it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/refit.pb.h"

namespace refit {

// How a registration reached the daemon.
enum class WorkerTransport {
  kUnix,       // the worker socket: uid-checked
  kNetwork,    // --worker-listen (TCP): not uid-checked
  kInProcess,  // a caller in this process (tests embedding a registry): trusted
};

// From grpc::ServerContext::peer(): "ipv4:..." and "ipv6:..." are the network; everything else
// ("unix:...", and anything unknown) is held to the unix socket's stricter rule.
WorkerTransport TransportOfPeer(absl::string_view peer);

class WorkerAdmission {
 public:
  // `uids`: --worker-uids; empty: `self` (the daemon's effective uid) and root.
  WorkerAdmission(std::vector<uint32_t> uids, uid_t self);
  // The default rule for this process (its own euid and root).
  WorkerAdmission();

  // OK to go on with registering `request`; `delivered`: it named a handle delivery (claimed
  // already), made by a process of `uid`. PERMISSION_DENIED naming the uid and --worker-uids, or
  // INVALID_ARGUMENT for a missing delivery (what the worker must do differently).
  absl::Status Admit(const v1::RegisterWorkerRequest& request, WorkerTransport transport,
                     bool delivered, uid_t uid) const;

  const std::vector<uint32_t>& uids() const { return uids_; }

 private:
  std::vector<uint32_t> uids_;
};

inline constexpr size_t kSessionKeyChars = 32;

// 128 bits from the kernel's CSPRNG (getrandom), as 32 lowercase hex digits.
std::string NewSessionKey();
// Whether `given` is `key`, in time that depends on neither's contents (only on `key`'s length,
// which is public).
bool SessionKeyMatches(absl::string_view key, absl::string_view given);

}  // namespace refit
