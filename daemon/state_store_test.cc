// The coordinator's state file: round trip, atomic replacement (never a partial file), a corrupt
// file refused with an error naming it.
#include "daemon/state_store.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace refit {
namespace {

std::string TempPath(const std::string& tag) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(dir != nullptr ? dir : "/tmp", "/refitd-state-", tag, "-", getpid());
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
    REQUIRE((*store)->RecordCommitted("policy", 9).ok());
    REQUIRE((*store)->RecordCommitted("odd \"name\"\n with spaces", 3).ok());
    REQUIRE((*store)->RecordCommitted("policy", 4).ok());  // never goes back
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
  REQUIRE((*store)->RecordCommitted("policy", 5).ok());
  const std::string before = Read(path);
  // A coordinator killed in the middle of a write leaves at most a partial `.tmp`.
  std::ofstream(path + ".tmp") << "refitd-state 1\nnext_round_id 9";
  auto reopened = StateStore::Open(path);
  REQUIRE(reopened.ok());
  CHECK((*reopened)->Committed("policy") == 5);
  REQUIRE((*reopened)->RecordCommitted("policy", 6).ok());  // replaces the leftover, then the file
  CHECK(Read(path) != before);
  CHECK(Read(path) == FormatState(1, {{"policy", 6}}));
  unlink(path.c_str());
  unlink((path + ".tmp").c_str());
}

TEST_CASE("state store: a corrupt file is an error naming it") {
  const std::string path = TempPath("corrupt");
  for (const std::string& text : {std::string("garbage"), std::string("refitd-state 1\nnext_round_id 4\n"),
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

}  // namespace
}  // namespace refit
