#include "daemon/coordinator/state_store.h"

#include <fcntl.h>
#include <libgen.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace refit {
namespace {

constexpr char kHeader[] = "refitd-state 1";

// "<what> <path>: <errno text>", with errno read before anything else can change it.
absl::Status Errno(const std::string& what, const std::string& path) {
  const int e = errno;
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(e)));
}

class PosixAtomicWriter : public StateFileWriter {
 public:
  absl::Status Replace(const std::string& path, const std::string& text) override {
    const std::string tmp = path + ".tmp";
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return Errno("cannot create", tmp);
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const absl::Status s = Errno("cannot write", tmp);
        close(fd);
        return s;
      }
      done += static_cast<size_t>(n);
    }
    if (fsync(fd) != 0) {
      const absl::Status s = Errno("cannot fsync", tmp);
      close(fd);
      return s;
    }
    if (close(fd) != 0) return Errno("cannot close", tmp);  // NFS reports write errors here
    if (rename(tmp.c_str(), path.c_str()) != 0) return Errno("cannot rename it over", path);
    // The rename itself made durable: without it a crash may bring the old file back.
    std::string dir = path;
    const std::string folder = dirname(dir.data());
    const int dfd = open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return Errno("cannot open its folder", folder);
    if (fsync(dfd) != 0) {
      const absl::Status s = Errno("cannot fsync its folder", folder);
      close(dfd);
      return s;
    }
    close(dfd);
    return absl::OkStatus();
  }
};

}  // namespace

absl::Status CheckVersionBound(int64_t version) {
  if (version <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("version ", version, " is not positive"));
  }
  if (version >= kVersionLimit) {
    return absl::InvalidArgumentError(
        absl::StrCat("version ", version, " is not below 2^53 (", kVersionLimit,
                     "), the limit on versions; the largest is ", kVersionLimit - 1));
  }
  return absl::OkStatus();
}

std::unique_ptr<StateFileWriter> AtomicFileWriter() {
  return std::make_unique<PosixAtomicWriter>();
}

std::string FormatState(int64_t next_round, const std::map<std::string, int64_t>& versions) {
  std::string out = absl::StrCat(kHeader, "\nnext_round_id ", next_round, "\n");
  for (const auto& [group, v] : versions)
    absl::StrAppend(&out, "version ", v, " \"", absl::CEscape(group), "\"\n");
  absl::StrAppend(&out, "end ", versions.size(),
                  "\n");  // a file cut short is told from a whole one
  return out;
}

absl::Status ParseState(const std::string& text, const std::string& path, int64_t* next_round,
                        std::map<std::string, int64_t>* versions) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n');
  auto corrupt = [&](size_t line, const std::string& why) {
    return absl::DataLossError(
        absl::StrCat("the state file ", path, " is corrupt (line ", line + 1, ": ", why,
                     "); move it away only if versions and round ids may start again"));
  };
  if (lines.empty() || lines[0] != kHeader)
    return corrupt(0, absl::StrCat("not \"", kHeader, "\""));
  *next_round = 0;
  versions->clear();
  bool ended = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    if (ended) {
      if (!l.empty() || i + 1 != lines.size()) return corrupt(i, "text after \"end\"");
      continue;
    }
    int64_t n = 0;
    if (absl::StartsWith(l, "next_round_id ")) {
      if (!absl::SimpleAtoi(l.substr(14), &n) || n < 1) return corrupt(i, "a bad round id");
      *next_round = n;
    } else if (absl::StartsWith(l, "version ")) {
      const size_t space = l.find(' ', 8);
      std::string group;
      if (space == std::string::npos || !absl::SimpleAtoi(l.substr(8, space - 8), &n) || n < 0 ||
          l.size() < space + 3 || l[space + 1] != '"' || l.back() != '"' ||
          !absl::CUnescape(l.substr(space + 2, l.size() - space - 3), &group)) {
        return corrupt(i, "a bad version line");
      }
      (*versions)[group] = n;
    } else if (absl::StartsWith(l, "end ")) {
      if (!absl::SimpleAtoi(l.substr(4), &n) || n != static_cast<int64_t>(versions->size())) {
        return corrupt(i, "the count of versions disagrees");
      }
      ended = true;
    } else {
      return corrupt(i, absl::StrCat("unknown \"", l.substr(0, 40), "\""));
    }
  }
  if (!ended) return corrupt(lines.size() - 1, "cut short (no \"end\")");
  if (*next_round < 1) return corrupt(1, "no next_round_id");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::Open(
    const std::string& path, std::unique_ptr<StateFileWriter> writer) {
  if (writer == nullptr) writer = AtomicFileWriter();
  std::unique_ptr<StateStore> store(new StateStore(path, std::move(writer)));
  if (path.empty()) return store;
  std::ifstream in(path, std::ios::binary);
  absl::MutexLock lock(&store->mu_);
  if (!in) {
    if (access(path.c_str(), F_OK) == 0) return Errno("cannot read the state file", path);
    // Written now: an unwritable path fails at start, not at the first round.
    if (auto s = store->WriteLocked(store->next_round_, store->versions_); !s.ok()) return s;
    return store;
  }
  std::stringstream text;
  text << in.rdbuf();
  if (auto s = ParseState(text.str(), path, &store->next_round_, &store->versions_); !s.ok())
    return s;
  return store;
}

absl::Status StateStore::WriteLocked(int64_t next_round,
                                     const std::map<std::string, int64_t>& versions) {
  if (path_.empty()) return absl::OkStatus();
  if (auto s = writer_->Replace(path_, FormatState(next_round, versions)); !s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot write the state file ", path_, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> StateStore::ReserveRoundId() {
  absl::MutexLock lock(&mu_);
  if (next_round_ == std::numeric_limits<int64_t>::max())
    return absl::ResourceExhaustedError("no round ids left");
  const int64_t id = next_round_;
  if (auto s = WriteLocked(id + 1, versions_); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("cannot reserve round id ", id, ": ", s.message()));
  }
  next_round_ = id + 1;
  return id;
}

absl::Status StateStore::RecordVersion(const std::string& group, int64_t version) {
  if (auto s = CheckVersionBound(version); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("group \"", group, "\": ", s.message()));
  }
  absl::MutexLock lock(&mu_);
  auto it = versions_.find(group);
  if (it != versions_.end() && version <= it->second) {
    return absl::FailedPreconditionError(absl::StrCat("version ", version, " of group \"", group,
                                                      "\" is not above its recorded version ",
                                                      it->second, ": a version is committed once"));
  }
  std::map<std::string, int64_t> next = versions_;
  next[group] = version;
  if (auto s = WriteLocked(next_round_, next); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("version ", version, " of group \"", group,
                                               "\" not recorded: ", s.message()));
  }
  versions_ = std::move(next);
  return absl::OkStatus();
}

int64_t StateStore::Committed(const std::string& group) const {
  absl::MutexLock lock(&mu_);
  auto it = versions_.find(group);
  return it == versions_.end() ? 0 : it->second;
}

std::map<std::string, int64_t> StateStore::Versions() const {
  absl::MutexLock lock(&mu_);
  return versions_;
}

int64_t StateStore::NextRoundId() const {
  absl::MutexLock lock(&mu_);
  return next_round_;
}

}  // namespace refit
