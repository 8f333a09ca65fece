// The packed store of a plan's descriptors: every field of every descriptor comes back as it was
// put in, whatever shapes they share, and shared shapes are kept once.
#include "plan/descriptor_table.h"

#include <catch2/catch.hpp>
#include <iterator>
#include <random>
#include <vector>

#include "plan/test_layouts.h"

namespace refit {
namespace {
using testing::DescriptorFields;

CopyDescriptor RandomDescriptor(std::mt19937_64& rng, int shapes) {
  CopyDescriptor d;
  d.src_buffer = static_cast<int32_t>(rng() % 100000);
  d.dst_buffer = static_cast<int32_t>(rng() % 100000);
  d.src_offset = static_cast<int64_t>(rng() % (int64_t{1} << 40));
  d.dst_offset = static_cast<int64_t>(rng() % (int64_t{1} << 40));
  d.message = static_cast<int32_t>(rng() % 1000);
  // The shape: drawn from `shapes` seeds, so that many descriptors share each.
  std::mt19937_64 shape_rng(rng() % static_cast<uint64_t>(shapes));
  d.inner = static_cast<int64_t>(shape_rng() % (int64_t{1} << 35));
  d.outer_rank = static_cast<uint8_t>(shape_rng() % (kMaxOuterDims + 1));
  for (int k = 0; k < kMaxOuterDims; ++k) {
    d.count[k] = static_cast<int32_t>(shape_rng() % kMaxLoopValue);
    d.src_stride[k] = static_cast<int32_t>(shape_rng() % kMaxLoopValue) - kMaxLoopValue / 2;
    d.dst_stride[k] = static_cast<int32_t>(shape_rng() % kMaxLoopValue);
  }
  d.src_dtype = static_cast<DType>(shape_rng() % 4);
  d.dst_dtype = static_cast<DType>(shape_rng() % 4);
  d.src_is_destination = shape_rng() % 2 == 1;
  d.op = static_cast<CopyOp>(shape_rng() % 3);
  d.quant_format = static_cast<uint8_t>(shape_rng() % 2);
  d.block_rows = static_cast<uint16_t>(shape_rng() % 256);
  d.block_cols = static_cast<uint16_t>(shape_rng() % 256);
  return d;
}

TEST_CASE("every field of every descriptor comes back, by index and by iteration") {
  for (int shapes : {1, 3, 40, 5000}) {  // 5000: more than the recent-shape slots, colliding
    INFO(shapes << " shapes");
    std::mt19937_64 rng(shapes);
    std::vector<CopyDescriptor> made;
    DescriptorTable table;
    for (int i = 0; i < 20000; ++i) {
      made.push_back(RandomDescriptor(rng, shapes));
      table.push_back(made.back());
    }
    REQUIRE(table.size() == made.size());
    CHECK(table.num_shapes() <= static_cast<size_t>(shapes));
    size_t i = 0;
    for (const CopyDescriptor& d : table) {
      REQUIRE(DescriptorFields(d) == DescriptorFields(made[i]));
      REQUIRE(DescriptorFields(table[i]) == DescriptorFields(made[i]));
      ++i;
    }
    CHECK(i == made.size());
  }
}

// Standard algorithms and ranges take the table as they would a container.
static_assert(std::forward_iterator<DescriptorTable::const_iterator>);

TEST_CASE("iterating with i++ and ++i visits the same descriptors") {
  DescriptorTable table;
  for (int i = 0; i < 5; ++i) {
    CopyDescriptor d;
    d.inner = 10 + i;
    d.src_offset = 100 * i;
    table.push_back(d);
  }
  std::vector<int64_t> pre, post;
  for (auto it = table.begin(); it != table.end(); ++it) pre.push_back((*it).src_offset);
  for (auto it = table.begin(); it != table.end();) post.push_back((*it++).src_offset);
  CHECK(pre == std::vector<int64_t>{0, 100, 200, 300, 400});
  CHECK(post == pre);
  CHECK(std::distance(table.begin(), table.end()) == 5);
}

TEST_CASE("descriptors of one shape keep it once; each differs only in what is its own") {
  std::mt19937_64 rng(5);
  DescriptorTable table;
  for (int i = 0; i < 1000; ++i) table.push_back(RandomDescriptor(rng, 2));
  CHECK(table.num_shapes() == 2);
  // A field of the shape told apart: a third shape.
  CopyDescriptor d = table[0];
  d.block_cols ^= 1;
  table.push_back(d);
  CHECK(table.num_shapes() == 3);
  CHECK(table[1000].block_cols == d.block_cols);
  CHECK(table[0].block_cols != d.block_cols);
}

TEST_CASE("a message is renumbered in place, nothing else with it; a descriptor is replaced") {
  std::mt19937_64 rng(9);
  DescriptorTable table;
  for (int i = 0; i < 10; ++i) table.push_back(RandomDescriptor(rng, 4));
  const CopyDescriptor before = table[6];
  table.set_message(6, 123456);
  CHECK(table.message(6) == 123456);
  CopyDescriptor expected = before;
  expected.message = 123456;
  CHECK(DescriptorFields(table[6]) == DescriptorFields(expected));
  // A whole descriptor replaced, its shape one the table has not seen.
  expected.inner += 7;
  expected.src_offset = 99;
  table.set(6, expected);
  CHECK(DescriptorFields(table[6]) == DescriptorFields(expected));
  CHECK(DescriptorFields(table[5]) != DescriptorFields(expected));
}

TEST_CASE("a copy is a table of its own; clear empties shapes too") {
  std::mt19937_64 rng(3);
  DescriptorTable table;
  for (int i = 0; i < 100; ++i) table.push_back(RandomDescriptor(rng, 7));
  DescriptorTable copy = table;
  const CopyDescriptor first = copy[0];
  table.clear();
  CHECK(table.empty());
  CHECK(table.num_shapes() == 0);
  CHECK(copy.size() == 100);
  CHECK(DescriptorFields(copy[0]) == DescriptorFields(first));
  // Interning after clear starts over: no stale shape is reused.
  CopyDescriptor d = first;
  d.inner += 1;
  table.push_back(d);
  CHECK(DescriptorFields(table[0]) == DescriptorFields(d));
  CHECK(table.num_shapes() == 1);
}

TEST_CASE("a table moved from takes new descriptors as an empty one") {
  std::mt19937_64 rng(21);
  DescriptorTable table;
  for (int i = 0; i < 50; ++i) table.push_back(RandomDescriptor(rng, 3));
  const CopyDescriptor d = table[0];
  DescriptorTable moved = std::move(table);
  table.clear();  // valid but unspecified after a move: cleared, as a caller reusing it would
  table.push_back(d);
  CHECK(table.size() == 1);
  CHECK(DescriptorFields(table[0]) == DescriptorFields(d));
  CHECK(DescriptorFields(moved[0]) == DescriptorFields(d));
  // Without clearing: the recent-shape slots must not name shapes the table no longer has.
  DescriptorTable again = std::move(moved);
  moved.push_back(d);
  CHECK(DescriptorFields(moved[moved.size() - 1]) == DescriptorFields(d));
}

}  // namespace
}  // namespace refit
