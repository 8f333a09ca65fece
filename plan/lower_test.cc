#include "plan/lower.h"

#include <catch2/catch.hpp>
#include <deque>

#include "plan/descriptor_table.h"
#include "plan/test_layouts.h"

namespace refit {
namespace {
using testing::B;

CopyEnd End(const Box& box, int64_t offset, Dims strides) {
  static std::deque<Box> keep;  // stable addresses: CopyEnd points at its box
  keep.push_back(box);
  return CopyEnd{&keep.back(), PieceView{offset, strides}, 0, DType::kBF16};
}

TEST_CASE("whole rows contiguous on both sides merge into one run") {
  std::vector<CopyDescriptor> out;
  const Box whole = B({0, 0}, {8, 16});
  LowerCopy(B({2, 0}, {4, 16}), End(whole, 0, Dims{16, 1}),
            End(B({2, 0}, {4, 16}), 100, Dims{16, 1}), false, out);
  REQUIRE(out.size() == 1);
  CHECK(out[0].outer_rank == 0);
  CHECK(out[0].inner == 64);
  CHECK(out[0].src_offset == 32);
  CHECK(out[0].dst_offset == 100);
}

TEST_CASE("a column slice is a strided loop of runs") {
  std::vector<CopyDescriptor> out;
  LowerCopy(B({0, 4}, {8, 4}), End(B({0, 0}, {8, 16}), 0, Dims{16, 1}),
            End(B({0, 4}, {8, 4}), 0, Dims{4, 1}), false, out);
  REQUIRE(out.size() == 1);
  CHECK(out[0].outer_rank == 1);
  CHECK(out[0].inner == 4);
  CHECK(out[0].count[0] == 8);
  CHECK(out[0].src_stride[0] == 16);
  CHECK(out[0].dst_stride[0] == 4);
  CHECK(out[0].src_offset == 4);
}

TEST_CASE("more loops than a descriptor holds are enumerated") {
  std::vector<CopyDescriptor> out;
  // Rank 6, every dimension strided differently on the two sides.
  const Box src_box = B({0, 0, 0, 0, 0, 0}, {3, 3, 3, 3, 3, 3});
  const Box region = B({1, 0, 1, 0, 1, 1}, {2, 2, 2, 2, 2, 2});
  LowerCopy(region, End(src_box, 0, RowMajorStrides(src_box.shape_dims())),
            End(region, 0, RowMajorStrides(region.shape_dims())), false, out);
  int64_t elements = 0;
  for (const auto& d : out) elements += d.NumElements();
  CHECK(elements == region.NumElements());
  CHECK(out.size() == 2 * 2);  // inner run + three loops kept, two leading loops enumerated
}

TEST_CASE("a loop past a descriptor's 32-bit loops is enumerated, and every loop outside it") {
  // [2, 3, 4] out of a buffer whose outermost stride is 5e9 elements (a 4-D stacked layout): the
  // outer loop cannot be held, the middle one can.
  constexpr int64_t kFar = 5'000'000'000;
  const Box region = B({0, 0, 0}, {2, 3, 4});
  std::vector<CopyDescriptor> out;
  LowerCopy(region, End(region, 7, Dims{kFar, 8, 1}), End(region, 0, Dims{12, 4, 1}), false, out);
  REQUIRE(out.size() == 2);
  for (int k = 0; k < 2; ++k) {
    CHECK(out[k].outer_rank == 1);
    CHECK(out[k].inner == 4);
    CHECK(out[k].count[0] == 3);
    CHECK(out[k].src_stride[0] == 8);
    CHECK(out[k].dst_stride[0] == 4);
    CHECK(out[k].src_offset == 7 + k * kFar);
    CHECK(out[k].dst_offset == 12 * k);
  }
  // A run next to such a loop: each row its own descriptor, 64-bit offsets kept whole.
  out.clear();
  const Box rows = B({0, 0}, {3, 4});
  LowerCopy(rows, End(rows, 0, Dims{kFar, 1}), End(rows, 0, Dims{4, 1}), false, out);
  REQUIRE(out.size() == 3);
  CHECK(out[2].outer_rank == 0);
  CHECK(out[2].src_offset == 2 * kFar);
  CHECK(out[2].dst_offset == 8);
}

TEST_CASE("a quantized region whose rows lie past a descriptor's loops is refused") {
  Quantization q;
  q.format = QuantFormat::kBlockFp8;
  q.block_rows = q.block_cols = 128;
  const Box region = B({0, 0}, {256, 256});
  std::vector<CopyDescriptor> out;
  const absl::Status s =
      LowerQuantize(CopyOp::kQuantize, region, q, End(region, 0, Dims{int64_t{3} << 31, 1}),
                    End(region, 0, Dims{256, 1}), false, int64_t{1} << 26, out);
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message().find("at most 2147483647") != std::string::npos);
  CHECK(out.empty());
}

TEST_CASE("splitting keeps every element and bounds every part") {
  CopyDescriptor d;
  d.inner = 10;
  d.outer_rank = 2;
  d.count = {7, 5, 0};
  d.src_stride = {1000, 100, 0};
  d.dst_stride = {50, 10, 0};
  d.src_dtype = d.dst_dtype = DType::kF32;
  for (int64_t limit : {4, 40, 200, 1000, 4000, 100000}) {
    std::vector<CopyDescriptor> parts;
    SplitDescriptor(d, limit, parts);
    int64_t elements = 0;
    for (const auto& p : parts) {
      elements += p.NumElements();
      CHECK(p.WireBytes() <= std::max<int64_t>(limit, 4));
    }
    CHECK(elements == d.NumElements());
  }
}

TEST_CASE("the parts of a split have no loop values past their rank") {
  CopyDescriptor d;
  d.inner = 10;
  d.outer_rank = 3;
  d.count = {4, 6, 5};
  d.src_stride = {3000, 500, 100};
  d.dst_stride = {300, 50, 10};
  d.src_dtype = d.dst_dtype = DType::kF32;
  // At most one row of 10 elements (40 bytes) a part, then two rows: parts of the innermost loop.
  for (int64_t limit : {40, 100}) {
    std::vector<CopyDescriptor> parts;
    SplitDescriptor(d, limit, parts);
    REQUIRE(parts.size() == (limit == 40 ? 4 * 6 * 5 : 4 * 6 * 3));
    DescriptorTable table;
    for (const CopyDescriptor& p : parts) {
      REQUIRE(p.outer_rank == 1);
      CHECK(p.src_stride[0] == 100);
      CHECK(p.dst_stride[0] == 10);
      for (int i = p.outer_rank; i < kMaxOuterDims; ++i) {
        CHECK(p.count[i] == 0);
        CHECK(p.src_stride[i] == 0);
        CHECK(p.dst_stride[i] == 0);
      }
      table.push_back(p);
    }
    // Equal copies are one shape: rows of one, or pairs and the odd row left of each 5.
    CHECK(table.num_shapes() == (limit == 40 ? 1u : 2u));
  }
}

TEST_CASE("the wire carries the narrower dtype") {
  CopyDescriptor d;
  d.inner = 3;
  d.src_dtype = DType::kF32;
  d.dst_dtype = DType::kBF16;
  CHECK(d.WireDType() == DType::kBF16);
  CHECK(d.WireBytes() == 6);
}

}  // namespace
}  // namespace refit
