#include "plan/layout.h"

#include <catch2/catch.hpp>

#include "plan/test_layouts.h"

namespace refit {
namespace {
using testing::B;

TEST_CASE("one worker's layout keeps its buffers, pieces and replica") {
  Layout l;
  l.tensors.push_back({"w", Dims{4, 2}, DType::kBF16});  // name, shape, dtype
  for (int rank = 0; rank < 2; ++rank) {
    const int32_t w = l.AddWorker(rank == 0 ? "e0" : "e1", 3, rank);
    l.workers[w].replica = "dp1";
    l.workers[w].replica_rank = rank;
    l.workers[w].replica_size = 2;
    const int32_t b = l.AddBuffer(w, "buf", DType::kBF16, Dims{2, 2});
    l.AddPiece(0, Box::FromDims(Dims{rank * 2, 0}, Dims{2, 2}), b, Box::Whole(Dims{2, 2}));
  }
  const Layout mine = WorkerLayout(l, 1);
  REQUIRE(mine.workers.size() == 1);
  CHECK(mine.workers[0].name == "e1");
  CHECK(mine.workers[0].node == 3);
  CHECK(mine.workers[0].gpu == 1);
  CHECK(mine.workers[0].replica == "dp1");
  CHECK(mine.workers[0].replica_rank == 1);
  CHECK(mine.workers[0].replica_size == 2);
  REQUIRE(mine.buffers.size() == 1);
  REQUIRE(mine.pieces.size() == 1);
  CHECK(mine.tensor_box(mine.pieces[0]).origin[0] == 2);
}

TEST_CASE("a tensor-parallel shard is its buffer's whole box: row-major strides") {
  auto v = ViewOf(B({0, 128}, {64, 128}), B({0, 0}, {64, 128}), Dims{64, 128});
  REQUIRE(v.ok());
  CHECK(v->offset == 0);
  CHECK(v->strides == Dims{128, 1});
}

TEST_CASE("k inside a fused qkv buffer starts after q's rows") {
  // qkv buffer [q 32 + k 8 + v 8 rows, 16 cols]; k's shard sits at rows 32..40.
  auto v = ViewOf(B({8, 0}, {8, 16}), B({32, 0}, {8, 16}), Dims{48, 16});
  REQUIRE(v.ok());
  CHECK(v->offset == 32 * 16);
  CHECK(v->strides == Dims{16, 1});
}

TEST_CASE("an FSDP flat shard holds whole rows and partial rows of a matrix") {
  // Tensor [10, 6] flattened; a flat buffer of 100 elements holds rows 2..5 at offset 40.
  auto rows = ViewOf(B({2, 0}, {3, 6}), B({40}, {18}), Dims{100});
  REQUIRE(rows.ok());
  CHECK(rows->offset == 40);
  CHECK(rows->strides == Dims{6, 1});
  // Part of one row: row 7, columns 2..6, at offset 3.
  auto part = ViewOf(B({7, 2}, {1, 4}), B({3}, {4}), Dims{100});
  REQUIRE(part.ok());
  CHECK(part->offset == 3);
  CHECK(part->strides[1] == 1);
}

TEST_CASE("an expert's matrix inside a stacked [E, rows, cols] buffer") {
  auto v = ViewOf(B({0, 0}, {4, 8}), B({3, 0, 0}, {1, 4, 8}), Dims{5, 4, 8});
  REQUIRE(v.ok());
  CHECK(v->offset == 3 * 32);
  CHECK(v->strides == Dims{8, 1});
  // A column slice of an expert (TP inside EP) in a stacked buffer of column shards.
  auto tp = ViewOf(B({0, 4}, {4, 4}), B({2, 0, 0}, {1, 4, 4}), Dims{5, 4, 4});
  REQUIRE(tp.ok());
  CHECK(tp->strides == Dims{4, 1});
}

TEST_CASE("a box that strides cannot express is refused with both boxes named") {
  // Two rows of a [4, 8] tensor into a non-contiguous [2, 4] window of a [4, 8] buffer, as 16
  // elements: shapes differ and the window is not contiguous.
  auto v = ViewOf(B({0, 0}, {2, 8}), B({0, 0}, {4, 4}), Dims{4, 8});
  REQUIRE_FALSE(v.ok());
  CHECK(std::string(v.status().message()).find("[0:2, 0:8]") != std::string::npos);
  auto count = ViewOf(B({0}, {3}), B({0}, {4}), Dims{4});
  REQUIRE_FALSE(count.ok());
  CHECK(std::string(count.status().message()).find("holds 3 elements") != std::string::npos);
}

TEST_CASE("a scalar in a rank-1 buffer of one element, and rank 6") {
  auto scalar = ViewOf(Box(), B({5}, {1}), Dims{8});
  REQUIRE(scalar.ok());
  CHECK(scalar->offset == 5);
  auto six = ViewOf(B({0, 0, 0, 0, 0, 1}, {2, 1, 2, 1, 2, 1}),
                    B({0, 0, 0, 0, 0, 0}, {2, 1, 2, 1, 2, 1}), Dims{2, 1, 2, 1, 2, 1});
  REQUIRE(six.ok());
  CHECK(six->strides[0] == 4);
}

}  // namespace
}  // namespace refit
