#include "plan/descriptor_list.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <vector>

namespace refit {
namespace {

// Every field set to something other than its default, so that a field lost in packing shows.
CopyDescriptor Sample(int32_t seed) {
  CopyDescriptor d;
  d.src_buffer = 3 + seed;
  d.dst_buffer = 7 + seed;
  d.src_offset = (int64_t{5} << 40) + seed;  // offsets keep 64 bits in the packed form
  d.dst_offset = (int64_t{9} << 36) + 2 * seed;
  d.inner = 4096 + seed;
  d.outer_rank = 2;
  d.count = {11, 13, 0};
  d.src_stride = {1 << 20, 8192, 0};
  d.dst_stride = {1 << 19, 4096, 0};
  d.src_dtype = DType::kF32;
  d.dst_dtype = DType::kBF16;
  d.src_is_destination = true;
  d.op = CopyOp::kScale;
  d.quant_format = 2;
  d.block_rows = 128;
  d.block_cols = 32;
  d.message = 100 + seed;
  return d;
}

bool Same(const CopyDescriptor& a, const CopyDescriptor& b) {
  return a.src_buffer == b.src_buffer && a.dst_buffer == b.dst_buffer &&
         a.src_offset == b.src_offset && a.dst_offset == b.dst_offset && a.inner == b.inner &&
         a.count == b.count && a.src_stride == b.src_stride && a.dst_stride == b.dst_stride &&
         a.outer_rank == b.outer_rank && a.src_dtype == b.src_dtype &&
         a.dst_dtype == b.dst_dtype && a.src_is_destination == b.src_is_destination &&
         a.op == b.op && a.quant_format == b.quant_format && a.block_rows == b.block_rows &&
         a.block_cols == b.block_cols && a.message == b.message;
}

TEST_CASE("every field reads back as stored, packed or kept whole") {
  std::vector<CopyDescriptor> in;
  in.push_back(Sample(0));  // packs
  CopyDescriptor three_loops = Sample(1);
  three_loops.outer_rank = 3;
  three_loops.count[2] = 5;
  three_loops.src_stride[2] = 77;
  three_loops.dst_stride[2] = 99;
  in.push_back(three_loops);
  CopyDescriptor long_run = Sample(2);
  long_run.inner = int64_t{1} << 31;  // past 32 bits
  in.push_back(long_run);
  CopyDescriptor long_stride = Sample(3);
  long_stride.src_stride[1] = -(int64_t{1} << 33);
  in.push_back(long_stride);
  CopyDescriptor unused_loop = Sample(4);  // a third loop's stride set without the loop
  unused_loop.dst_stride[2] = 1;
  in.push_back(unused_loop);
  CopyDescriptor edge = Sample(5);  // the extremes of 32 bits still pack
  edge.inner = std::numeric_limits<int32_t>::max();
  edge.src_stride[0] = std::numeric_limits<int32_t>::min();
  edge.op = CopyOp::kQuantize;
  edge.quant_format = 31;
  edge.src_is_destination = false;
  in.push_back(edge);
  in.push_back(CopyDescriptor{});  // all defaults

  DescriptorList list;
  for (const CopyDescriptor& d : in) list.push_back(d);
  REQUIRE(list.size() == in.size());
  CHECK(list.wide_count() == 4);
  for (size_t i = 0; i < in.size(); ++i) {
    INFO("descriptor " << i);
    CHECK(Same(list[i], in[i]));
    CHECK(list.message(i) == in[i].message);
  }
  size_t i = 0;
  for (const CopyDescriptor& d : list) CHECK(Same(d, in[i++]));
  CHECK(i == in.size());
}

TEST_CASE("messages and whole descriptors are replaced in place") {
  DescriptorList list;
  list.push_back(Sample(0));
  CopyDescriptor wide = Sample(1);
  wide.outer_rank = 3;
  wide.count[2] = 2;
  list.push_back(wide);

  list.set_message(0, 42);
  list.set_message(1, 43);
  CHECK(list[0].message == 42);
  CHECK(list[1].message == 43);
  CHECK(list[1].count[2] == 2);

  // Packed to wide, wide to packed, wide to wide: each reads back as set.
  CopyDescriptor to_wide = Sample(2);
  to_wide.inner = int64_t{1} << 40;
  list.set(0, to_wide);
  CHECK(Same(list[0], to_wide));
  const CopyDescriptor to_packed = Sample(3);
  list.set(1, to_packed);
  CHECK(Same(list[1], to_packed));
  CopyDescriptor wide_again = Sample(4);
  wide_again.count[2] = 9;
  wide_again.outer_rank = 3;
  list.set(0, wide_again);
  CHECK(Same(list[0], wide_again));
  CHECK(list.size() == 2);
}

TEST_CASE("the packed form is 64 bytes a descriptor") {
  DescriptorList list;
  list.reserve(1000);
  CHECK(list.capacity() >= 1000);
  CHECK(DescriptorList::kPackedBytes == 64);
  CHECK(sizeof(CopyDescriptor) > DescriptorList::kPackedBytes);
  list.push_back(Sample(0));
  list.clear();
  CHECK(list.empty());
  CHECK(list.wide_count() == 0);
}

}  // namespace
}  // namespace refit
