// The host data plane's frame: what a sender writes before each message's payload on a data
// connection, and the checks a receiver makes before it trusts any of it. Kept apart from the
// sockets so that the parser can be tested and fuzzed on bytes alone (tests/fuzz/frame_fuzzer.cc).
//
// On the wire: a 32-byte header (magic "RFT1", group_bytes, round_id, message, bytes; little
// endian, the layout of FrameHeader on the machines refitd runs on), then group_bytes of the group
// name, then `bytes` of payload.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "plan/plan.h"

namespace refit {

inline constexpr uint32_t kFrameMagic = 0x31544652;  // "RFT1" read as a little-endian uint32
inline constexpr uint32_t kMaxGroupBytes = 4096;
inline constexpr size_t kFrameHeaderBytes = 32;

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint32_t group_bytes = 0;
  int64_t round_id = 0;
  int64_t message = 0;  // index into the round's Plan::messages
  int64_t bytes = 0;    // payload that follows the group name
};

// A header as it arrived; INVALID_ARGUMENT (naming the field) unless the magic matches,
// group_bytes <= kMaxGroupBytes, bytes >= 0 and message >= 0.
absl::StatusOr<FrameHeader> ParseFrameHeader(std::span<const std::byte, kFrameHeaderBytes> wire);
// What a sender writes; ParseFrameHeader(EncodeFrameHeader(h)) == h for every valid h.
std::array<std::byte, kFrameHeaderBytes> EncodeFrameHeader(const FrameHeader& h);

// Whether a frame that `node` received for a round of `plan` is one it expects: its message
// exists, goes from another node to this one, and has that many bytes. DATA_LOSS otherwise.
// (Bounds `message` before anything indexes the plan with it.)
absl::Status CheckFrameForPlan(const FrameHeader& h, const Plan& plan, int32_t node);

}  // namespace refit
