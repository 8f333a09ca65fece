#include "plan/validate.h"

#include <catch2/catch.hpp>

#include "plan/test_layouts.h"

namespace refit {
namespace {
using testing::B;

std::string ErrorOf(Layout& l) {
  absl::Status s = ValidateLayout(l, "source");
  REQUIRE_FALSE(s.ok());
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  return std::string(s.message());
}

bool Has(const std::string& s, const std::string& part) {
  INFO(s);
  return s.find(part) != std::string::npos;
}

Layout TwoShards() {
  Layout l;
  const int32_t t = l.AddTensor("w", Dims{8, 4}, DType::kBF16);
  const int32_t a = l.AddWorker("rank0", 0, 0);
  const int32_t b = l.AddWorker("rank1", 0, 1);
  l.AddPiece(t, B({0, 0}, {4, 4}), l.AddBuffer(a, "w", DType::kBF16, Dims{4, 4}),
             B({0, 0}, {4, 4}));
  l.AddPiece(t, B({4, 0}, {4, 4}), l.AddBuffer(b, "w", DType::kBF16, Dims{4, 4}),
             B({0, 0}, {4, 4}));
  return l;
}

TEST_CASE("a well-formed layout passes and gets its name index") {
  Layout l = TwoShards();
  REQUIRE(ValidateLayout(l, "source").ok());
  CHECK(l.tensor_index.at("w") == 0);
  CHECK(l.worker_index.at("rank1") == 1);
}

TEST_CASE("overlapping pieces in one buffer name both tensors, the worker and the box") {
  Layout l;
  const int32_t q = l.AddTensor("q", Dims{4, 4}, DType::kBF16);
  const int32_t k = l.AddTensor("k", Dims{4, 4}, DType::kBF16);
  const int32_t w = l.AddWorker("vllm0", 1, 0);
  const int32_t qkv = l.AddBuffer(w, "qkv", DType::kBF16, Dims{7, 4});
  l.AddPiece(q, B({0, 0}, {4, 4}), qkv, B({0, 0}, {4, 4}));
  l.AddPiece(k, B({0, 0}, {4, 4}), qkv, B({3, 0}, {4, 4}));
  const std::string e = ErrorOf(l);
  CHECK(Has(e, "\"q\""));
  CHECK(Has(e, "\"k\""));
  CHECK(Has(e, "\"vllm0\""));
  CHECK(Has(e, "overlap at buffer box [3:4, 0:4]"));
}

TEST_CASE("bounds, ranks and dtypes") {
  SECTION("tensor box outside the tensor") {
    Layout l = TwoShards();
    l.SetTensorBox(1, B({5, 0}, {4, 4}));
    const std::string e = ErrorOf(l);
    CHECK(Has(e, "box [5:9, 0:4] lies outside the tensor's shape [8, 4]"));
    CHECK(Has(e, "\"rank1\""));
  }
  SECTION("buffer box outside the buffer") {
    Layout l = TwoShards();
    l.SetBufferBox(0, B({1, 0}, {4, 4}));
    CHECK(Has(ErrorOf(l), "lies outside the buffer's shape [4, 4]"));
  }
  SECTION("rank disagreement") {
    Layout l = TwoShards();
    l.SetTensorBox(0, B({0}, {16}));
    CHECK(Has(ErrorOf(l), "has a box of rank 1 but the tensor has rank 2"));
  }
  SECTION("dtype disagreement") {
    Layout l = TwoShards();
    l.buffers[1].dtype = DType::kF32;
    CHECK(Has(ErrorOf(l), "the buffer holds fp32 but the tensor is bf16"));
  }
  SECTION("element counts disagree") {
    Layout l = TwoShards();
    l.SetBufferBox(0, B({0, 0}, {2, 4}));
    CHECK(Has(ErrorOf(l), "holds 16 elements but buffer box [0:2, 0:4] holds 8"));
  }
  SECTION("absurd sizes") {
    Layout l = TwoShards();
    l.tensors[0].shape = Dims{int64_t{1} << 40, int64_t{1} << 40};
    CHECK(Has(ErrorOf(l), "is too large"));
    Layout m = TwoShards();
    m.buffers[0].shape = Dims{int64_t{1} << 62, 4};
    CHECK(Has(ErrorOf(m), "is too large"));
  }
  SECTION("negative shape") {
    Layout l = TwoShards();
    l.tensors[0].shape = Dims{-8, 4};
    CHECK(Has(ErrorOf(l), "negative extent"));
  }
}

TEST_CASE("unknown and duplicate names") {
  SECTION("duplicate tensor") {
    Layout l = TwoShards();
    l.AddTensor("w", Dims{1}, DType::kF32);
    CHECK(Has(ErrorOf(l), "tensor \"w\" is declared twice"));
  }
  SECTION("duplicate worker") {
    Layout l = TwoShards();
    l.AddWorker("rank0", 3, 3);
    CHECK(Has(ErrorOf(l), "worker \"rank0\" is declared twice"));
  }
  SECTION("duplicate buffer within a worker") {
    Layout l = TwoShards();
    l.AddBuffer(0, "w", DType::kBF16, Dims{1});
    CHECK(Has(ErrorOf(l), "declares buffer \"w\" twice"));
  }
  SECTION("unknown tensor index") {
    Layout l = TwoShards();
    l.pieces[0].tensor = 7;
    CHECK(Has(ErrorOf(l), "refers to tensor #7, which is not declared"));
  }
  SECTION("unknown buffer index") {
    Layout l = TwoShards();
    l.pieces[0].buffer = -1;
    CHECK(Has(ErrorOf(l), "refers to buffer #-1"));
  }
  SECTION("unknown worker index") {
    Layout l = TwoShards();
    l.buffers[0].worker = 9;
    CHECK(Has(ErrorOf(l), "refers to worker #9"));
  }
  SECTION("empty names and negative placement") {
    Layout l = TwoShards();
    l.workers[0].gpu = -2;
    CHECK(Has(ErrorOf(l), "both must be >= 0"));
    Layout m = TwoShards();
    m.tensors[0].name = "";
    CHECK(Has(ErrorOf(m), "has no name"));
  }
}

TEST_CASE("pairs: unknown tensor, shape and dtype disagreement; casts among floats pass") {
  Layout src = TwoShards();
  REQUIRE(ValidateLayout(src, "source").ok());
  SECTION("unknown") {
    Layout dst;
    dst.AddTensor("v", Dims{8, 4}, DType::kBF16);
    REQUIRE(ValidateLayout(dst, "destination").ok());
    CHECK(Has(std::string(ValidatePair(src, dst).message()), "tensor \"v\" is unknown"));
  }
  SECTION("shape") {
    Layout dst;
    dst.AddTensor("w", Dims{4, 8}, DType::kBF16);
    REQUIRE(ValidateLayout(dst, "destination").ok());
    CHECK(Has(std::string(ValidatePair(src, dst).message()),
              "shape [8, 4] in the source layout but [4, 8]"));
  }
  SECTION("dtype") {
    Layout dst;
    dst.AddTensor("w", Dims{8, 4}, DType::kI8);
    REQUIRE(ValidateLayout(dst, "destination").ok());
    CHECK(Has(std::string(ValidatePair(src, dst).message()), "bf16 in the source layout but int8"));
  }
  SECTION("float cast") {
    Layout dst;
    dst.AddTensor("w", Dims{8, 4}, DType::kF32);
    REQUIRE(ValidateLayout(dst, "destination").ok());
    CHECK(ValidatePair(src, dst).ok());
  }
}

}  // namespace
}  // namespace refit
