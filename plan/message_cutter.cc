#include "plan/message_cutter.h"

#include <algorithm>
#include <numeric>
#include <tuple>

namespace refit {

void MessageCutter::TakeMark(size_t descriptors) {
  Mark& m = mark_.emplace();
  m.descriptors = descriptors;
  m.per_message.reserve(messages_.size());
  for (const Cut& c : messages_) m.per_message.push_back(c.descriptors);
}

std::vector<int32_t> MessageCutter::ExecutionOrder(const std::vector<int32_t>& group_rank) const {
  std::vector<int32_t> order(messages_.size());
  std::iota(order.begin(), order.end(), 0);
  // Ids grow in the order a group's messages were opened: the id keeps them in that order.
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return std::tie(group_rank[messages_[a].group], a) <
           std::tie(group_rank[messages_[b].group], b);
  });
  return order;
}

}  // namespace refit
