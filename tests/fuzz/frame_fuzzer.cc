// libFuzzer target for what a data connection's bytes reach before any socket or memory is
// involved (daemon/dataplane/host/data_frame.h): a sequence of frames as a receiver reads them,
// each a header (ParseFrameHeader), the group name, a check against the round's plan
// (CheckFrameForPlan), then the payload skipped; the first malformed or cut-off frame ends the
// "connection", as it does in HostBackend::ReadLoop. Any crash, sanitizer report or trap is a bug:
// bad bytes must only ever be refused. Build: clang++ -fsanitize=fuzzer,...
// tests/fuzz/frame_fuzzer.cc daemon/dataplane/host/data_frame.cc.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "daemon/dataplane/host/data_frame.h"

namespace {

// A round's plan as a receiving node 1 sees it: messages into it from nodes 0 and 2, one inside
// it, one out of it, and one whose GPU index is out of range.
const refit::Plan& TestPlan() {
  static const refit::Plan plan = [] {
    refit::Plan p;
    p.gpus = {{0, 0}, {1, 0}, {1, 1}, {2, 0}};
    const int32_t src[] = {0, 3, 1, 1, 9};
    const int32_t dst[] = {1, 2, 2, 3, 1};
    for (int i = 0; i < 5; ++i) {
      refit::Message m;
      m.src_gpu = src[i];
      m.dst_gpu = dst[i];
      m.bytes = 16 * (i + 1);
      p.messages.push_back(m);
    }
    return p;
  }();
  return plan;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace refit;
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  size_t at = 0;
  while (size - at >= kFrameHeaderBytes) {
    const std::span<const std::byte, kFrameHeaderBytes> wire(bytes + at, kFrameHeaderBytes);
    const absl::StatusOr<FrameHeader> h = ParseFrameHeader(wire);
    if (!h.ok()) {
      if (h.status().code() != absl::StatusCode::kInvalidArgument) __builtin_trap();
      return 0;  // a malformed header closes the connection
    }
    // What passed the checks holds them, and encodes back to the very bytes it came from.
    if (h->magic != kFrameMagic || h->group_bytes > kMaxGroupBytes || h->bytes < 0 ||
        h->message < 0) {
      __builtin_trap();
    }
    const auto again = EncodeFrameHeader(*h);
    if (std::memcmp(again.data(), wire.data(), kFrameHeaderBytes) != 0) __builtin_trap();
    at += kFrameHeaderBytes;
    if (size - at < h->group_bytes) return 0;  // the group name broke off
    const std::string group(reinterpret_cast<const char*>(bytes + at), h->group_bytes);
    at += h->group_bytes;
    // A frame of the running round ("policy") is checked against its plan; any other is a late
    // one, whose payload is read and dropped all the same.
    if (group == "policy") {
      const Plan& plan = TestPlan();
      const absl::Status s = CheckFrameForPlan(*h, plan, 1);
      if (s.ok()) {
        // Accepted: then indexing the plan with it is safe, and it is an expected message.
        const Message& m = plan.messages.at(static_cast<size_t>(h->message));
        if (m.bytes != h->bytes || plan.gpus.at(m.dst_gpu).node != 1 ||
            plan.gpus.at(m.src_gpu).node == 1) {
          __builtin_trap();
        }
      } else if (s.code() != absl::StatusCode::kDataLoss) {
        __builtin_trap();
      } else {
        return 0;  // the round fails: its connection ends
      }
    }
    if (static_cast<uint64_t>(h->bytes) > size - at) return 0;  // the payload broke off
    at += static_cast<size_t>(h->bytes);
  }
  return 0;
}
