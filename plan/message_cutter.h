// Cutting each group's descriptors into messages as the descriptors are made, rather than after:
// a group (stage, sending GPU, receiving GPU) is cut in the order its descriptors come, into
// messages of at most max_message_bytes (a descriptor larger than that alone in one), exactly as
// a pass over the finished plan would cut it. Done on the fly, the cutting needs no per-descriptor
// arrays and no second read of the descriptors (hundreds of MB for a frontier model), only a
// final pass that renumbers each descriptor's message into execution order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "plan/plan.h"

namespace refit {

// What each message held when the cutter had seen a given number of descriptors. Outside the
// class: clang does not let a class emplace a nested struct with member initializers.
struct MessageCutMark {
  size_t descriptors = 0;            // descriptors [0, this) were cut when it was taken
  std::vector<int64_t> per_message;  // by message id; messages opened later held none
};

class MessageCutter {
 public:
  explicit MessageCutter(int64_t max_message_bytes) : max_bytes_(max_message_bytes) {}

  // The next descriptor of `group`, of `wire_bytes`: returns its message's id, in the order
  // messages were opened.
  int32_t Add(int32_t group, int64_t wire_bytes) {
    if (static_cast<size_t>(group) >= open_.size()) open_.resize(group + size_t{1}, -1);
    int32_t& open = open_[group];
    if (open < 0 || (messages_[open].bytes + wire_bytes > max_bytes_)) {
      open = static_cast<int32_t>(messages_.size());
      messages_.push_back({group, 0, 0});
    }
    Cut& m = messages_[open];
    m.bytes += wire_bytes;
    ++m.descriptors;
    return open;
  }

  // Descriptors just made, each with its group as `message`, to follow `before` others: each
  // gets its message's id instead.
  void CutFrom(std::vector<CopyDescriptor>& made, size_t before) {
    for (CopyDescriptor& d : made) d.message = Add(d.message, d.WireBytes());
    const size_t seen = before + made.size();
    if (!mark_.has_value() && seen >= mark_after_) TakeMark(seen);
  }
  // CutFrom, then `made` appended to `out`, the descriptors it follows.
  void CutInto(std::vector<CopyDescriptor>& made, DescriptorTable& out) {
    CutFrom(made, out.size());
    for (const CopyDescriptor& d : made) out.push_back(d);
  }

  // Once CutFrom has seen `descriptors` descriptors in all, it notes how many each message then
  // held (mark()): the final pass over the descriptors may then run in two parts at once.
  void MarkAfter(size_t descriptors) { mark_after_ = descriptors; }
  using Mark = MessageCutMark;
  const std::optional<Mark>& mark() const { return mark_; }

  struct Cut {
    int32_t group;
    int64_t bytes;
    int64_t descriptors;
  };
  // By id (the order they were opened); a group's messages in the order of its descriptors.
  const std::vector<Cut>& messages() const { return messages_; }

  // The ids in execution order: by `group_rank[group]`, then in the order each group's messages
  // were opened.
  std::vector<int32_t> ExecutionOrder(const std::vector<int32_t>& group_rank) const;

 private:
  void TakeMark(size_t descriptors);

  const int64_t max_bytes_;
  std::vector<int32_t> open_;  // per group: its message being filled, or -1
  std::vector<Cut> messages_;
  size_t mark_after_ = SIZE_MAX;
  std::optional<Mark> mark_;
};

}  // namespace refit
