#include "daemon/state_store.h"

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

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

}  // namespace

std::string FormatState(int64_t next_round, const std::map<std::string, int64_t>& versions) {
  std::string out = absl::StrCat(kHeader, "\nnext_round_id ", next_round, "\n");
  for (const auto& [group, v] : versions) absl::StrAppend(&out, "version ", v, " \"", absl::CEscape(group), "\"\n");
  absl::StrAppend(&out, "end ", versions.size(), "\n");  // a file cut short is told from a whole one
  return out;
}

absl::Status ParseState(const std::string& text, const std::string& path, int64_t* next_round,
                        std::map<std::string, int64_t>* versions) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n');
  auto corrupt = [&](size_t line, const std::string& why) {
    return absl::DataLossError(absl::StrCat("the state file ", path, " is corrupt (line ", line + 1, ": ", why,
                                            "); move it away only if versions and round ids may start again"));
  };
  if (lines.empty() || lines[0] != kHeader) return corrupt(0, absl::StrCat("not \"", kHeader, "\""));
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

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::Open(const std::string& path) {
  std::unique_ptr<StateStore> store(new StateStore(path));
  if (path.empty()) return store;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (access(path.c_str(), F_OK) == 0) return Errno("cannot read the state file", path);
    absl::MutexLock lock(&store->mu_);
    if (auto s = store->WriteLocked(); !s.ok()) return s;  // fail now, not at the first round
    return store;
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::MutexLock lock(&store->mu_);
  if (auto s = ParseState(text.str(), path, &store->next_round_, &store->versions_); !s.ok()) return s;
  return store;
}

absl::Status StateStore::WriteLocked() {
  if (path_.empty()) return absl::OkStatus();
  const std::string tmp = path_ + ".tmp";
  const std::string text = FormatState(next_round_, versions_);
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("cannot write the state file", tmp);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const absl::Status s = Errno("cannot write the state file", tmp);
      close(fd);
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) {
    const absl::Status s = Errno("cannot fsync the state file", tmp);
    close(fd);
    return s;
  }
  close(fd);
  if (rename(tmp.c_str(), path_.c_str()) != 0) return Errno("cannot replace the state file", path_);
  std::string dir = path_;
  const int dfd = open(dirname(dir.data()), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {  // the rename itself durable
    fsync(dfd);
    close(dfd);
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> StateStore::ReserveRoundId() {
  absl::MutexLock lock(&mu_);
  if (next_round_ == std::numeric_limits<int64_t>::max()) return absl::ResourceExhaustedError("no round ids left");
  const int64_t id = next_round_++;
  if (auto s = WriteLocked(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("cannot reserve round id ", id, ": ", s.message()));
  }
  return id;
}

absl::Status StateStore::RecordCommitted(const std::string& group, int64_t version) {
  absl::MutexLock lock(&mu_);
  int64_t& v = versions_[group];
  if (version <= v) return absl::OkStatus();
  v = version;
  return WriteLocked();
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
