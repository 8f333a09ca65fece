#include "daemon/security/worker_admission.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace refit {

WorkerTransport TransportOfPeer(absl::string_view peer) {
  if (absl::StartsWith(peer, "ipv4:") || absl::StartsWith(peer, "ipv6:"))
    return WorkerTransport::kNetwork;
  return WorkerTransport::kUnix;
}

WorkerAdmission::WorkerAdmission(std::vector<uint32_t> uids, uid_t self) : uids_(std::move(uids)) {
  if (uids_.empty()) {
    uids_.push_back(static_cast<uint32_t>(self));
    if (self != 0) uids_.push_back(0);
  }
}

WorkerAdmission::WorkerAdmission() : WorkerAdmission({}, geteuid()) {}

absl::Status WorkerAdmission::Admit(const v1::RegisterWorkerRequest& request,
                                    WorkerTransport transport, bool delivered, uid_t uid) const {
  const std::string& name = request.worker().name();
  if (transport == WorkerTransport::kInProcess) return absl::OkStatus();
  if (!delivered) {
    if (transport == WorkerTransport::kUnix) {
      return absl::InvalidArgumentError(absl::StrCat(
          "register: worker \"", name,
          "\" named no handle delivery (fd_token): on the unix socket every registration hands its "
          "descriptors (zero are fine) over the handle socket first, which identifies its "
          "process"));
    }
    for (const v1::BufferMemory& m : request.memory()) {
      if (m.has_cuda_ipc()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "register: worker \"", name,
            "\" registers CUDA IPC memory without a handle delivery (fd_token): IPC handles are "
            "accepted only from a process identified over the handle socket (zero descriptors are "
            "fine)"));
      }
    }
    return absl::OkStatus();
  }
  // Over TCP the delivery's uid is not checked: the registration itself came from the network,
  // and whoever sends it could have had any local process make the delivery.
  if (transport == WorkerTransport::kNetwork) return absl::OkStatus();
  if (std::find(uids_.begin(), uids_.end(), static_cast<uint32_t>(uid)) == uids_.end()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "register: worker \"", name, "\": its process runs as uid ", uid,
        ", which may not register workers here (--worker-uids ", absl::StrJoin(uids_, ","), ")"));
  }
  return absl::OkStatus();
}

std::string NewSessionKey() {
  unsigned char bytes[kSessionKeyChars / 2];
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (errno != EINTR) {
      std::abort();  // no randomness: no key may be handed out (Linux >= 3.17 always has it)
    }
  }
  static const char kHex[] = "0123456789abcdef";
  std::string key;
  key.reserve(kSessionKeyChars);
  for (unsigned char b : bytes) {
    key.push_back(kHex[b >> 4]);
    key.push_back(kHex[b & 15]);
  }
  return key;
}

bool SessionKeyMatches(absl::string_view key, absl::string_view given) {
  if (key.empty() || given.size() != key.size()) return false;  // the length is public
  unsigned char diff = 0;
  for (size_t i = 0; i < key.size(); ++i) diff |= static_cast<unsigned char>(key[i] ^ given[i]);
  return diff == 0;
}

}  // namespace refit
