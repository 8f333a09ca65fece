// The coordinator's state file: round trip, atomic replacement (never a partial file), a corrupt
// file refused with an error naming it; a version recorded once, below the limit, and only once
// the file holds it (a write that fails records nothing, naming the file).
#include "daemon/coordinator/state_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace refit {
namespace {

std::string TempPath(const std::string& tag) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path =
      absl::StrCat(dir != nullptr ? dir : "/tmp", "/refitd-state-", tag, "-", getpid());
  unlink(path.c_str());
  return path;
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST_CASE("state store: round ids and versions survive a reopen") {
  const std::string path = TempPath("roundtrip");
  {
    auto store = StateStore::Open(path);
    REQUIRE(store.ok());
    CHECK(access(path.c_str(), F_OK) == 0);  // written at once: an unwritable path fails at start
    CHECK(*(*store)->ReserveRoundId() == 1);
    CHECK(*(*store)->ReserveRoundId() == 2);
    REQUIRE((*store)->RecordVersion("policy", 9).ok());
    REQUIRE((*store)->RecordVersion("odd \"name\"\n with spaces", 3).ok());
    for (int64_t stale : {4, 9}) {  // never goes back, nor twice
      const absl::Status again = (*store)->RecordVersion("policy", stale);
      CHECK(again.code() == absl::StatusCode::kFailedPrecondition);
      CHECK_THAT(std::string(again.message()), Catch::Contains("not above its recorded version 9"));
    }
    CHECK((*store)->Committed("policy") == 9);
  }
  auto again = StateStore::Open(path);
  REQUIRE(again.ok());
  CHECK(*(*again)->ReserveRoundId() == 3);
  CHECK((*again)->Committed("policy") == 9);
  CHECK((*again)->Committed("odd \"name\"\n with spaces") == 3);
  CHECK((*again)->Committed("other") == 0);
  unlink(path.c_str());
}

TEST_CASE("state store: replaced atomically; a leftover temporary file is ignored") {
  const std::string path = TempPath("atomic");
  auto store = StateStore::Open(path);
  REQUIRE(store.ok());
  REQUIRE((*store)->RecordVersion("policy", 5).ok());
  const std::string before = Read(path);
  // A coordinator killed in the middle of a write leaves at most a partial `.tmp`.
  std::ofstream(path + ".tmp") << "refitd-state 1\nnext_round_id 9";
  auto reopened = StateStore::Open(path);
  REQUIRE(reopened.ok());
  CHECK((*reopened)->Committed("policy") == 5);
  REQUIRE((*reopened)->RecordVersion("policy", 6).ok());  // replaces the leftover, then the file
  CHECK(Read(path) != before);
  CHECK(Read(path) == FormatState(1, {{"policy", 6}}));
  unlink(path.c_str());
  unlink((path + ".tmp").c_str());
}

TEST_CASE("state store: a corrupt file is an error naming it") {
  const std::string path = TempPath("corrupt");
  for (const std::string& text :
       {std::string("garbage"), std::string("refitd-state 1\nnext_round_id 4\n"),
        std::string("refitd-state 1\nnext_round_id x\nend 0\n"),
        std::string("refitd-state 1\nnext_round_id 4\nversion 3 \"policy\"\nend 2\n"),
        std::string("")}) {
    std::ofstream(path, std::ios::trunc) << text;
    auto store = StateStore::Open(path);
    INFO(text);
    REQUIRE_FALSE(store.ok());
    CHECK(store.status().code() == absl::StatusCode::kDataLoss);
    CHECK(store.status().message().find(path) != std::string::npos);
  }
  unlink(path.c_str());
  // In memory: nothing written anywhere.
  auto memory = StateStore::Open("");
  REQUIRE(memory.ok());
  CHECK(*(*memory)->ReserveRoundId() == 1);
}

// Fails every Replace while `fail` is set, after writing nothing (a full or read-only disk).
class FlakyWriter : public StateFileWriter {
 public:
  explicit FlakyWriter(bool* fail) : fail_(fail), real_(AtomicFileWriter()) {}
  absl::Status Replace(const std::string& path, const std::string& text) override {
    if (*fail_)
      return absl::InternalError(
          absl::StrCat("cannot create ", path, ".tmp: Read-only file system"));
    return real_->Replace(path, text);
  }

 private:
  const bool* const fail_;
  const std::unique_ptr<StateFileWriter> real_;
};

TEST_CASE("state store: a version the file cannot hold is not recorded; the error names the file") {
  const std::string path = TempPath("unwritable");
  bool fail = false;
  auto opened = StateStore::Open(path, std::make_unique<FlakyWriter>(&fail));
  REQUIRE(opened.ok());
  StateStore& store = **opened;
  REQUIRE(store.RecordVersion("policy", 1).ok());
  const int64_t id = *store.ReserveRoundId();

  fail = true;  // the file system turns read-only
  const absl::Status lost = store.RecordVersion("policy", 3);
  CHECK(lost.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(lost.message()), Catch::Contains(absl::StrCat("the state file ", path)));
  CHECK_THAT(std::string(lost.message()),
             Catch::Contains("version 3 of group \"policy\" not recorded"));
  CHECK(store.Committed("policy") == 1);  // nothing recorded that the file does not hold
  const auto no_id = store.ReserveRoundId();
  CHECK(no_id.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(no_id.status().message()), Catch::Contains(path));

  fail = false;  // writable again: the same version is recorded now, once
  REQUIRE(store.RecordVersion("policy", 3).ok());
  CHECK(store.RecordVersion("policy", 3).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(*store.ReserveRoundId() == id + 1);  // the id not reserved then is given now
  auto again = StateStore::Open(path);
  REQUIRE(again.ok());
  CHECK((*again)->Committed("policy") == 3);
  unlink(path.c_str());
}

TEST_CASE("state store: a real path that becomes unwritable fails the record, naming the file") {
  // The state file's folder replaced by a regular file: every write fails (ENOTDIR), as it
  // would on a file system turned read-only (which root cannot be kept from writing otherwise).
  const std::string dir = TempPath("folder");
  REQUIRE(mkdir(dir.c_str(), 0700) == 0);
  const std::string path = dir + "/refitd.state";
  {
    auto store = StateStore::Open(path);
    REQUIRE(store.ok());
    REQUIRE((*store)->RecordVersion("policy", 5).ok());
    REQUIRE(rename(dir.c_str(), (dir + ".away").c_str()) == 0);
    std::ofstream(dir) << "not a folder";
    const absl::Status lost = (*store)->RecordVersion("policy", 6);
    CHECK(lost.code() == absl::StatusCode::kUnavailable);
    INFO(lost.message());
    CHECK_THAT(std::string(lost.message()),
               Catch::Contains(absl::StrCat("cannot write the state file ", path)));
    CHECK_THAT(std::string(lost.message()), Catch::Contains("Not a directory"));
    CHECK((*store)->Committed("policy") == 5);
    REQUIRE(unlink(dir.c_str()) == 0);
    REQUIRE(rename((dir + ".away").c_str(), dir.c_str()) == 0);
  }
  // Restarted: the highest version recorded, never one that failed to be, and never again.
  auto again = StateStore::Open(path);
  REQUIRE(again.ok());
  CHECK((*again)->Committed("policy") == 5);
  CHECK((*again)->RecordVersion("policy", 5).code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE((*again)->RecordVersion("policy", 6).ok());
  unlink(path.c_str());
  rmdir(dir.c_str());
}

TEST_CASE("state store: versions are below 2^53; the error names the limit") {
  auto opened = StateStore::Open("");
  REQUIRE(opened.ok());
  StateStore& store = **opened;
  for (int64_t bad : {kVersionLimit, std::numeric_limits<int64_t>::max() - 1,
                      std::numeric_limits<int64_t>::max(), int64_t{0}, int64_t{-1}}) {
    const absl::Status refused = store.RecordVersion("policy", bad);
    INFO(bad);
    CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
    CHECK(CheckVersionBound(bad).code() == absl::StatusCode::kInvalidArgument);
  }
  const std::string at_limit(store.RecordVersion("policy", kVersionLimit).message());
  CHECK_THAT(at_limit,
             Catch::Contains("version 9007199254740992 is not below 2^53 (9007199254740992)"));
  CHECK_THAT(at_limit, Catch::Contains("the largest is 9007199254740991"));
  CHECK(store.Committed("policy") == 0);
  REQUIRE(store.RecordVersion("policy", kVersionLimit - 1).ok());  // the largest
  CHECK(store.Committed("policy") == kVersionLimit - 1);
}

}  // namespace
}  // namespace refit
