// What the coordinator must not forget across a restart: the next round id and every group's
// committed version, so that neither ever goes back (a refit to version 1 after version 9 is
// refused, and round ids go on increasing; workers and logs tell rounds apart by id).
//
// A small text file (--state-file; empty: in memory only), replaced atomically and durably on
// every change (StateFileWriter): written to `<path>.tmp`, fsync'ed, renamed over the file, the
// folder fsync'ed; any step failing is an error naming the state file. A round id is reserved
// (the file says the next one is past it) before it is used, and a version is recorded before
// any worker is told to commit it (write-ahead): a round whose version cannot be recorded must
// abort before COMMIT. What the store holds in memory changes only once the file holds it, so
// a failed write leaves nothing recorded that a restart would not show. A version recorded
// whose COMMIT never went out (the coordinator died in between) is spent: a restarted
// coordinator reports it and refuses it, and the next refit takes a higher one. At start the
// file is read; a file that cannot be parsed is an error naming it and the line (the
// coordinator does not start: starting from nothing would let versions go back).
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

// Versions are below 2^53: every JSON reader holds such an integer exactly (refitctl -o json,
// Python, JavaScript), a version a millisecond lasts 285,000 years, and a group at the limit's
// edge still has next versions (at INT64_MAX a group could never refit again).
inline constexpr int64_t kVersionLimit = int64_t{1} << 53;
// INVALID_ARGUMENT naming the limit for a version not in [1, kVersionLimit).
absl::Status CheckVersionBound(int64_t version);

// Replaces a file's text atomically and durably: after OK the new text survives a crash or a
// power loss; after an error the file holds the old text or the new one, whole. Tests inject
// failures through it.
class StateFileWriter {
 public:
  virtual ~StateFileWriter() = default;
  // An error names `path` and the step that failed.
  virtual absl::Status Replace(const std::string& path, const std::string& text) = 0;
};
// `<path>.tmp` written and fsync'ed, renamed over `path`, the folder fsync'ed.
std::unique_ptr<StateFileWriter> AtomicFileWriter();

class StateStore {
 public:
  // Reads `path` if it exists (an absent file is a fresh start, written at once); empty `path`:
  // in memory. `writer`: null for AtomicFileWriter().
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(
      const std::string& path, std::unique_ptr<StateFileWriter> writer = nullptr);

  const std::string& path() const { return path_; }
  // A fresh round id, persisted as used before it is returned.
  absl::StatusOr<int64_t> ReserveRoundId();
  // Records that `group` is at `version`, durably, before any worker is told to commit it.
  // INVALID_ARGUMENT outside [1, kVersionLimit); FAILED_PRECONDITION when the group already has
  // it or a higher one recorded (a version is committed once: "one version number, two models"
  // is what this refuses); UNAVAILABLE naming the state file when it cannot be written (then
  // nothing is recorded, and the round must not commit).
  absl::Status RecordVersion(const std::string& group, int64_t version);
  int64_t Committed(const std::string& group) const;
  std::map<std::string, int64_t> Versions() const;
  int64_t NextRoundId() const;

 private:
  StateStore(std::string path, std::unique_ptr<StateFileWriter> writer)
      : path_(std::move(path)), writer_(std::move(writer)) {}
  // Writes this state; the caller keeps it only when this returns OK.
  absl::Status WriteLocked(int64_t next_round, const std::map<std::string, int64_t>& versions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const std::unique_ptr<StateFileWriter> writer_;
  mutable absl::Mutex mu_;
  int64_t next_round_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, int64_t> versions_ ABSL_GUARDED_BY(mu_);
};

// The file's text for a state, and the state of a file's text (tests, and the store itself).
std::string FormatState(int64_t next_round, const std::map<std::string, int64_t>& versions);
absl::Status ParseState(const std::string& text, const std::string& path, int64_t* next_round,
                        std::map<std::string, int64_t>* versions);

}  // namespace refit
