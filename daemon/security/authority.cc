#include "daemon/security/authority.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace refit {
namespace {

std::string Describe(const Caller& caller) {
  if (caller.unix_socket) return "a caller on the worker socket (no certificate)";
  if (!caller.authenticated) return absl::StrCat("an unauthenticated caller (", caller.peer, ")");
  return absl::StrCat("certificate \"",
                      caller.names.empty() ? std::string("(no name)") : caller.names.front(), "\"");
}

}  // namespace

std::optional<int32_t> NodeOf(const Caller& caller) {
  if (!caller.authenticated) return std::nullopt;
  const int32_t node = NodeOfNames(caller.names);
  if (node < 0) return std::nullopt;
  return node;
}

bool Authority::Named(const Caller& caller, const std::vector<std::string>& names) const {
  if (!caller.authenticated) return false;
  for (const std::string& n : caller.names) {
    if (std::find(names.begin(), names.end(), n) != names.end()) return true;
  }
  return false;
}

absl::Status Authority::CheckLocalUser(const Caller& caller, absl::string_view method) const {
  if (caller.unix_socket || local_users_ == nullptr) return absl::OkStatus();
  return local_users_->CheckGrpcPeer(caller.peer, method);
}

absl::Status Authority::CheckControl(const Caller& caller, Access access,
                                     absl::string_view method) const {
  if (!enforcing()) return CheckLocalUser(caller, method);
  const bool daemon = NodeOf(caller).has_value();
  const bool operate = daemon || Named(caller, tls_.operators);
  const bool view = operate || Named(caller, tls_.viewers) || caller.unix_socket;
  if (access == Access::kOperate ? operate : view) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      method, ": ", Describe(caller), " may not ",
      access == Access::kOperate ? "start refits" : "read this daemon's state", "; ",
      access == Access::kOperate
          ? absl::StrCat("operators are --tls-operators (", absl::StrJoin(tls_.operators, ","), ")")
          : absl::StrCat("viewers are --tls-viewers (", absl::StrJoin(tls_.viewers, ","),
                         ") and operators (", absl::StrJoin(tls_.operators, ","), ")")));
}

absl::Status Authority::CheckWorker(const Caller& caller) const {
  if (!enforcing()) return CheckLocalUser(caller, "Register");
  if (caller.unix_socket || Named(caller, tls_.workers)) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("Register over TCP: ", Describe(caller),
                   " may not register workers; workers over --worker-listen are "
                   "--tls-workers (",
                   absl::StrJoin(tls_.workers, ","), ")"));
}

absl::Status Authority::CheckNode(const Caller& caller, int32_t node,
                                  absl::string_view method) const {
  if (!enforcing()) return CheckLocalUser(caller, method);
  const std::optional<int32_t> is = NodeOf(caller);
  if (is == node) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(method, " for node ", node, ": ",
                                                  Describe(caller), " is not node ", node, "'s (",
                                                  kNodeIdentityPrefix, node, ")"));
}

absl::Status Authority::CheckCoordinator(const Caller& caller, const KnownCoordinator& coordinator,
                                         int64_t incarnation, absl::string_view method) const {
  if (!enforcing()) return CheckLocalUser(caller, method);
  if (coordinator.node < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat(method, " from ", Describe(caller),
                     ": this daemon obeys no coordinator (it is the coordinator, "
                     "or has not joined one)"));
  }
  if (NodeOf(caller) != coordinator.node) {
    return absl::PermissionDeniedError(absl::StrCat(method, ": ", Describe(caller),
                                                    " is not the coordinator's (",
                                                    kNodeIdentityPrefix, coordinator.node, ")"));
  }
  if (incarnation != coordinator.incarnation) {
    return absl::FailedPreconditionError(
        absl::StrCat(method, " from coordinator incarnation ", incarnation,
                     "; this node joined incarnation ", coordinator.incarnation,
                     " (the coordinator restarted: the node rejoins at its next heartbeat)"));
  }
  return absl::OkStatus();
}

}  // namespace refit
