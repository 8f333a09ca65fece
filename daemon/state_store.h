// What the coordinator must not forget across a restart: the next round id and every group's
// committed version, so that neither ever goes back (a refit to version 1 after version 9 is
// refused, and round ids go on increasing; workers and logs tell rounds apart by id).
//
// A small text file (--state-file; empty: in memory only), replaced atomically on every change:
// written to `<path>.tmp`, fsync'ed, renamed over the file, the folder fsync'ed. A round id is
// reserved (the file says the next one is past it) before it is used, and a committed version
// recorded before the round is reported committed. At start the file is read; a file that
// cannot be parsed is an error naming it and the line (the coordinator does not start: starting
// from nothing would let versions go back).
//
// Lock: `mu_` guards the state and the file (writes are serialised under it); nothing else is
// called while it is held.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace refit {

class StateStore {
 public:
  // Reads `path` if it exists (an absent file is a fresh start); empty `path`: in memory.
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(const std::string& path);

  const std::string& path() const { return path_; }
  // A fresh round id, persisted as used before it is returned.
  absl::StatusOr<int64_t> ReserveRoundId();
  // `group` committed `version` (kept only if above what is stored).
  absl::Status RecordCommitted(const std::string& group, int64_t version);
  int64_t Committed(const std::string& group) const;
  std::map<std::string, int64_t> Versions() const;
  int64_t NextRoundId() const;

 private:
  explicit StateStore(std::string path) : path_(std::move(path)) {}
  absl::Status WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  mutable absl::Mutex mu_;
  int64_t next_round_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, int64_t> versions_ ABSL_GUARDED_BY(mu_);
};

// The file's text for a state, and the state of a file's text (tests, and the store itself).
std::string FormatState(int64_t next_round, const std::map<std::string, int64_t>& versions);
absl::Status ParseState(const std::string& text, const std::string& path, int64_t* next_round,
                        std::map<std::string, int64_t>* versions);

}  // namespace refit
