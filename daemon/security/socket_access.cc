#include "daemon/security/socket_access.h"

#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace refit {
namespace {

// The kernel's ACL attribute, written directly (linux/posix_acl_xattr.h; libacl would add a
// library for these few bytes): a version, then entries sorted by tag and id.
constexpr uint32_t kAclVersion = 2;
constexpr uint16_t kUserObj = 0x01, kUser = 0x02, kGroupObj = 0x04, kMask = 0x10, kOther = 0x20;
constexpr uint16_t kReadWrite = 4 | 2;
constexpr uint32_t kUndefinedId = 0xFFFFFFFFu;

void Put(std::string& out, const void* p, size_t n) { out.append(static_cast<const char*>(p), n); }
void Entry(std::string& out, uint16_t tag, uint16_t perm, uint32_t id) {
  Put(out, &tag, 2);
  Put(out, &perm, 2);
  Put(out, &id, 4);
}

}  // namespace

absl::Status GrantSocketAccess(const std::string& path, const std::vector<uint32_t>& uids) {
  if (chmod(path.c_str(), 0600) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("chmod 0600 ", path, ": ", std::strerror(errno)));
  }
  std::vector<uint32_t> others;
  for (uint32_t uid : uids) {
    if (uid != static_cast<uint32_t>(geteuid())) others.push_back(uid);
  }
  std::sort(others.begin(), others.end());
  others.erase(std::unique(others.begin(), others.end()), others.end());
  if (others.empty()) return absl::OkStatus();
  std::string acl;
  Put(acl, &kAclVersion, 4);
  Entry(acl, kUserObj, kReadWrite, kUndefinedId);
  for (uint32_t uid : others) Entry(acl, kUser, kReadWrite, uid);
  Entry(acl, kGroupObj, 0, kUndefinedId);
  Entry(acl, kMask, kReadWrite, kUndefinedId);
  Entry(acl, kOther, 0, kUndefinedId);
  if (setxattr(path.c_str(), "system.posix_acl_access", acl.data(), acl.size(), 0) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--worker-uids ", absl::StrJoin(uids, ","), ": cannot let those users connect to ", path,
        " (a POSIX ACL: ", std::strerror(errno),
        "); put --worker-socket on a file system that keeps ACLs "
        "(tmpfs, ext4, xfs)"));
  }
  return absl::OkStatus();
}

}  // namespace refit
