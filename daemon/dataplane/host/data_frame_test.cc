#include "daemon/dataplane/host/data_frame.h"

#include <catch2/catch.hpp>
#include <cstring>

namespace refit {
namespace {

absl::StatusOr<FrameHeader> Parse(const std::array<std::byte, kFrameHeaderBytes>& wire) {
  return ParseFrameHeader(std::span<const std::byte, kFrameHeaderBytes>(wire));
}

TEST_CASE("a frame header round-trips, in the struct layout peers have always sent") {
  FrameHeader h;
  h.group_bytes = 6;
  h.round_id = -3;  // round ids are not checked here: the round lookup is
  h.message = 41;
  h.bytes = int64_t{5} << 33;
  const auto wire = EncodeFrameHeader(h);
  // The layout of the struct the sender used to write as is (little-endian machines).
  struct Old {
    uint32_t magic, group_bytes;
    int64_t round_id, message, bytes;
  } old{0x31544652, 6, -3, 41, int64_t{5} << 33};
  static_assert(sizeof(Old) == kFrameHeaderBytes);
  CHECK(std::memcmp(wire.data(), &old, sizeof old) == 0);
  CHECK(std::memcmp(wire.data(), "RFT1", 4) == 0);
  auto parsed = Parse(wire);
  REQUIRE(parsed.ok());
  CHECK(parsed->magic == kFrameMagic);
  CHECK(parsed->group_bytes == 6);
  CHECK(parsed->round_id == -3);
  CHECK(parsed->message == 41);
  CHECK(parsed->bytes == int64_t{5} << 33);
}

TEST_CASE("a malformed frame header is refused, naming what is wrong") {
  FrameHeader good;
  good.group_bytes = kMaxGroupBytes;
  REQUIRE(Parse(EncodeFrameHeader(good)).ok());
  struct Case {
    const char* what;
    FrameHeader h;
  };
  FrameHeader magic = good, group = good, bytes = good, message = good;
  magic.magic = 0x31544653;
  group.group_bytes = kMaxGroupBytes + 1;
  bytes.bytes = -1;
  message.message = -1;
  for (const auto& [what, h] : {Case{"magic", magic}, Case{"group name", group},
                                Case{"bytes", bytes}, Case{"message", message}}) {
    INFO(what);
    auto parsed = Parse(EncodeFrameHeader(h));
    REQUIRE(absl::IsInvalidArgument(parsed.status()));
    CHECK(std::string(parsed.status().message()).find(what) != std::string::npos);
  }
  std::array<std::byte, kFrameHeaderBytes> junk{};
  std::memcpy(junk.data(), "not a frame header", 18);
  CHECK_FALSE(Parse(junk).ok());
}

TEST_CASE("a frame is checked against the round's plan before anything indexes it") {
  Plan plan;
  plan.gpus = {{0, 0}, {1, 0}, {1, 1}};
  Message net;  // node 0 -> node 1
  net.src_gpu = 0;
  net.dst_gpu = 1;
  net.bytes = 100;
  Message local = net;  // node 1 -> node 1
  local.src_gpu = 2;
  Message broken = net;  // a gpu index out of range (a plan is trusted; checked all the same)
  broken.src_gpu = 7;
  plan.messages = {net, local, broken};
  FrameHeader h;
  h.bytes = 100;
  CHECK(CheckFrameForPlan(h, plan, 1).ok());
  CHECK(absl::IsDataLoss(CheckFrameForPlan(h, plan, 0)));  // not for node 0
  h.bytes = 99;
  CHECK(absl::IsDataLoss(CheckFrameForPlan(h, plan, 1)));
  h.bytes = 100;
  for (int64_t m : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{1} << 40}) {
    h.message = m;
    CHECK(absl::IsDataLoss(CheckFrameForPlan(h, plan, 1)));
  }
}

}  // namespace
}  // namespace refit
