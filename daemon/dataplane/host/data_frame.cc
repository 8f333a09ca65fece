#include "daemon/dataplane/host/data_frame.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace refit {
namespace {

// Fixed little-endian fields, whatever the host: the wire format is defined by bytes, not by
// a struct's layout (identical to the struct on x86-64 and aarch64, where refitd runs).
template <typename T>
T Load(const std::byte* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  T out;
  std::memcpy(&out, &v, sizeof out);  // two's complement for the signed fields
  return out;
}

template <typename T>
void Store(std::byte* p, T value) {
  uint64_t v = 0;
  std::memcpy(&v, &value, sizeof value);
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
}

}  // namespace

absl::StatusOr<FrameHeader> ParseFrameHeader(std::span<const std::byte, kFrameHeaderBytes> wire) {
  const std::byte* p = wire.data();
  FrameHeader h;
  h.magic = Load<uint32_t>(p);
  h.group_bytes = Load<uint32_t>(p + 4);
  h.round_id = Load<int64_t>(p + 8);
  h.message = Load<int64_t>(p + 16);
  h.bytes = Load<int64_t>(p + 24);
  if (h.magic != kFrameMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a frame header (magic 0x", absl::Hex(h.magic), ")"));
  }
  if (h.group_bytes > kMaxGroupBytes) {
    return absl::InvalidArgumentError(absl::StrCat("frame header: a group name of ", h.group_bytes,
                                                   " bytes (at most ", kMaxGroupBytes, ")"));
  }
  if (h.bytes < 0)
    return absl::InvalidArgumentError(absl::StrCat("frame header: ", h.bytes, " bytes"));
  if (h.message < 0)
    return absl::InvalidArgumentError(absl::StrCat("frame header: message ", h.message));
  return h;
}

std::array<std::byte, kFrameHeaderBytes> EncodeFrameHeader(const FrameHeader& h) {
  std::array<std::byte, kFrameHeaderBytes> out{};
  Store(out.data(), h.magic);
  Store(out.data() + 4, h.group_bytes);
  Store(out.data() + 8, h.round_id);
  Store(out.data() + 16, h.message);
  Store(out.data() + 24, h.bytes);
  return out;
}

absl::Status CheckFrameForPlan(const FrameHeader& h, const Plan& plan, int32_t node) {
  const auto unexpected = [&] {
    return absl::DataLossError(absl::StrCat("round ", h.round_id, ": a peer sent message ",
                                            h.message, " of ", h.bytes,
                                            " bytes, which this node does not expect"));
  };
  if (h.message < 0 || h.message >= static_cast<int64_t>(plan.messages.size())) return unexpected();
  const Message& m = plan.messages[static_cast<size_t>(h.message)];
  const auto gpus = static_cast<int32_t>(plan.gpus.size());
  if (m.src_gpu < 0 || m.src_gpu >= gpus || m.dst_gpu < 0 || m.dst_gpu >= gpus) return unexpected();
  const bool incoming = plan.gpus[m.dst_gpu].node == node && plan.gpus[m.src_gpu].node != node;
  if (!incoming || m.bytes != h.bytes) return unexpected();
  return absl::OkStatus();
}

}  // namespace refit
