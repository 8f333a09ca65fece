// Messages cut on the fly, against the rule they must keep: each group's descriptors, in the order
// they came, packed greedily into messages of at most the limit (one larger than the limit alone),
// and the messages put in execution order by their groups' rank.
#include "plan/message_cutter.h"

#include <catch2/catch.hpp>
#include <map>
#include <random>
#include <vector>

namespace refit {
namespace {

TEST_CASE("a group's descriptors fill a message up to the limit, then open the next") {
  MessageCutter cutter(100);
  CHECK(cutter.Add(0, 60) == 0);
  CHECK(cutter.Add(0, 40) == 0);   // exactly the limit
  CHECK(cutter.Add(0, 1) == 1);    // past it: a new message
  CHECK(cutter.Add(1, 250) == 2);  // larger than the limit: alone
  CHECK(cutter.Add(1, 10) == 3);
  CHECK(cutter.Add(0, 99) == 1);  // group 0's open message still has room
  CHECK(cutter.Add(0, 1) == 4);
  const auto& m = cutter.messages();
  REQUIRE(m.size() == 5);
  CHECK((m[0].group == 0 && m[0].bytes == 100 && m[0].descriptors == 2));
  CHECK((m[1].group == 0 && m[1].bytes == 100 && m[1].descriptors == 2));
  CHECK((m[2].group == 1 && m[2].bytes == 250 && m[2].descriptors == 1));
  CHECK((m[3].group == 1 && m[3].bytes == 10 && m[3].descriptors == 1));
  CHECK((m[4].group == 0 && m[4].bytes == 1 && m[4].descriptors == 1));
  // Group 1 runs first: its messages, then group 0's, each group's in the order they opened.
  CHECK(cutter.ExecutionOrder({1, 0}) == std::vector<int32_t>{2, 3, 0, 1, 4});
  CHECK(cutter.ExecutionOrder({0, 1}) == std::vector<int32_t>{0, 1, 4, 2, 3});
}

TEST_CASE("descriptors just made, their group in `message`, get their message's id") {
  std::vector<CopyDescriptor> made(3);
  for (CopyDescriptor& d : made) d.inner = 30;  // 30 bf16 elements: 60 bytes on the wire
  made[0].message = 0, made[1].message = 5, made[2].message = 0;
  MessageCutter cutter(100);
  cutter.CutFrom(made, 7);      // seven others before them
  CHECK(made[0].message == 0);  // group 0's first message
  CHECK(made[1].message == 1);  // group 5's
  CHECK(made[2].message == 2);  // 120 bytes would not fit group 0's first
  CHECK(cutter.messages()[2].group == 0);
  CHECK(cutter.messages()[0].descriptors == 1);
}

// The planner's final pass runs in two parts at once from the mark: what each message held when
// the descriptors before the mark had been cut is where the second part's descriptors go.
TEST_CASE("the mark is what each message held once the descriptors before it were cut") {
  std::mt19937 rng(11);
  MessageCutter cutter(500);
  cutter.MarkAfter(1000);
  std::vector<CopyDescriptor> made, transfer;
  while (made.size() < 3000) {
    transfer.clear();
    for (uint32_t k = 1 + rng() % 3; k > 0; --k) {  // a transfer: a descriptor or a few
      CopyDescriptor& d = transfer.emplace_back();
      d.inner = 1 + rng() % 200;
      d.message = static_cast<int32_t>(rng() % 9);
    }
    cutter.CutFrom(transfer, made.size());
    made.insert(made.end(), transfer.begin(), transfer.end());
    if (made.size() < 1000) CHECK_FALSE(cutter.mark().has_value());
  }
  REQUIRE(cutter.mark().has_value());
  const MessageCutter::Mark& mark = *cutter.mark();
  CHECK(mark.descriptors >= 1000);
  CHECK(mark.descriptors < 1003);  // taken after the transfer that reached it
  std::vector<int64_t> before(cutter.messages().size(), 0);
  for (size_t i = 0; i < mark.descriptors; ++i) ++before[made[i].message];
  REQUIRE(mark.per_message.size() <= before.size());
  for (size_t m = 0; m < before.size(); ++m) {
    INFO("message " << m);
    CHECK(before[m] == (m < mark.per_message.size() ? mark.per_message[m] : 0));
  }
}

TEST_CASE("cut on the fly, interleaved groups come out as a pass over each group would cut them") {
  std::mt19937 rng(7);
  const int64_t limit = 1000;
  MessageCutter cutter(limit);
  std::map<int32_t, std::vector<int64_t>> by_group;  // each group's descriptors, in order
  std::vector<std::pair<int32_t, int32_t>> given;    // (group, message id) per descriptor
  for (int i = 0; i < 20000; ++i) {
    const int32_t group = static_cast<int32_t>(rng() % 37);
    const int64_t bytes = rng() % 16 == 0 ? limit + rng() % 500 : 1 + rng() % 400;
    by_group[group].push_back(bytes);
    given.emplace_back(group, cutter.Add(group, bytes));
  }
  // The reference: each group alone, greedily.
  std::vector<int32_t> rank(37);
  for (int32_t g = 0; g < 37; ++g) rank[g] = (g * 11) % 37;  // a permutation
  std::vector<int32_t> order = cutter.ExecutionOrder(rank);
  const auto& cuts = cutter.messages();
  REQUIRE(order.size() == cuts.size());
  size_t k = 0;
  std::vector<int32_t> groups_by_rank(37);
  for (int32_t g = 0; g < 37; ++g) groups_by_rank[rank[g]] = g;
  for (int32_t g : groups_by_rank) {
    int64_t bytes = 0, count = 0;
    std::vector<std::pair<int64_t, int64_t>> expected;  // (bytes, descriptors) per message
    for (int64_t b : by_group[g]) {
      if (count > 0 && bytes + b > limit) {
        expected.emplace_back(bytes, count);
        bytes = count = 0;
      }
      bytes += b;
      ++count;
    }
    if (count > 0) expected.emplace_back(bytes, count);
    for (const auto& [b, c] : expected) {
      REQUIRE(k < order.size());
      const MessageCutter::Cut& cut = cuts[order[k++]];
      CHECK(cut.group == g);
      CHECK(cut.bytes == b);
      CHECK(cut.descriptors == c);
    }
  }
  CHECK(k == order.size());
  // Every descriptor's id names a message of its own group.
  for (const auto& [group, id] : given) CHECK(cuts[id].group == group);
}

}  // namespace
}  // namespace refit
