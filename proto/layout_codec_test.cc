#include "proto/layout_codec.h"

#include <tuple>

#include <catch2/catch.hpp>

#include "plan/validate.h"

namespace refit {
namespace {

Layout Sample() {
  Layout l;
  const int32_t q = l.AddTensor("model.layers.0.self_attn.q_proj.weight", Dims{8, 4}, DType::kBF16);
  const int32_t s = l.AddTensor("odd \"name\"\\", Dims{}, DType::kF32);
  const int32_t w = l.AddWorker("vllm-tp0", 2, 1);
  const int32_t b = l.AddBuffer(w, "qkv", DType::kBF16, Dims{12, 4});
  l.AddPiece(q, Box::FromDims(Dims{0, 0}, Dims{4, 4}), b, Box::FromDims(Dims{0, 0}, Dims{4, 4}));
  const int32_t f = l.AddBuffer(w, "scale", DType::kF32, Dims{1});
  l.AddPiece(s, Box(), f, Box::FromDims(Dims{0}, Dims{1}));
  return l;
}

TEST_CASE("a layout survives JSON and back, numbers as numbers") {
  const Layout a = Sample();
  const std::string json = LayoutToJson(a, "test");
  CHECK(json.find("\"shape\":[8,4]") != std::string::npos);
  auto b = ParseLayoutJson(json);
  INFO(json);
  REQUIRE(b.ok());
  REQUIRE(b->tensors.size() == 2);
  CHECK(b->tensors[1].name == a.tensors[1].name);
  CHECK(b->tensors[0].shape == a.tensors[0].shape);
  REQUIRE(b->pieces.size() == 2);
  CHECK(b->buffer_box(b->pieces[0]) == a.buffer_box(a.pieces[0]));
  CHECK(b->workers[0].node == 2);
  CHECK(LayoutToJson(*b, "test") == json);
  REQUIRE(ValidateLayout(*b, "source").ok());
}

TEST_CASE("omitted boxes mean the whole tensor and the whole buffer; int64 as strings accepted") {
  auto l = ParseLayoutJson(R"({"tensors":[{"name":"w","shape":["6",2],"dtype":"bfloat16"}],
    "workers":[{"name":"r0","node":0,"gpu":0,"buffers":[{"name":"w","dtype":"bf16","shape":[6,2],
    "pieces":[{"tensor":"w"}]}]}]})");
  REQUIRE(l.ok());
  CHECK(l->tensor_box(l->pieces[0]) == Box::Whole(Dims{6, 2}));
  CHECK(l->buffer_box(l->pieces[0]) == Box::Whole(Dims{6, 2}));
}

TEST_CASE("bad files get one clear error") {
  auto error = [](const std::string& json) {
    auto l = ParseLayoutJson(json);
    REQUIRE_FALSE(l.ok());
    CHECK(l.status().code() == absl::StatusCode::kInvalidArgument);
    return std::string(l.status().message());
  };
  CHECK(error("{").find("not a layout") != std::string::npos);
  CHECK(error(R"({"tensor":[]})").find("not a layout") != std::string::npos);  // unknown field
  CHECK(error(R"({"tensors":[{"name":"w","shape":[1],"dtype":"float13"}]})")
            .find("unknown dtype \"float13\"") != std::string::npos);
  CHECK(error(R"({"tensors":[{"name":"w","shape":[1,1,1,1,1,1,1],"dtype":"bf16"}]})")
            .find("rank 7 exceeds") != std::string::npos);
  CHECK(error(R"({"tensors":[{"name":"w","shape":[-1],"dtype":"bf16"}]})")
            .find("negative extent") != std::string::npos);
  CHECK(error(R"({"tensors":[],"workers":[{"name":"r","buffers":[{"name":"b","dtype":"bf16",
      "shape":[1],"pieces":[{"tensor":"ghost"}]}]}]})")
            .find("names tensor \"ghost\", which the layout does not declare") != std::string::npos);
  CHECK(error(R"({"tensors":[{"name":"w","shape":[2],"dtype":"bf16"}],"workers":[{"name":"r",
      "buffers":[{"name":"b","dtype":"bf16","shape":[2],"pieces":[{"tensor":"w",
      "tensorBox":{"origin":[0],"shape":[1,1]}}]}]}]})")
            .find("rank") != std::string::npos);
  CHECK(error(R"({"tensors":[{"name":"w","shape":[2],"dtype":"bf16"},
      {"name":"w","shape":[2],"dtype":"bf16"}]})").find("declared twice") != std::string::npos);
}

TEST_CASE("a worker's engine replica: kept through JSON and proto, absent when undeclared, checked") {
  Layout a = Sample();
  a.workers[0].replica = "dp1";
  a.workers[0].replica_rank = 1;
  a.workers[0].replica_size = 2;
  const std::string json = LayoutToJson(a, "test");
  CHECK(json.find("\"replica\":\"dp1\",\"replicaRank\":1,\"replicaSize\":2") != std::string::npos);
  auto back = ParseLayoutJson(json);
  REQUIRE(back.ok());
  CHECK(back->workers[0].replica == "dp1");
  CHECK(back->workers[0].replica_rank == 1);
  CHECK(back->workers[0].replica_size == 2);
  const v1::Layout proto = LayoutToProto(*back);
  CHECK(proto.workers(0).replica() == "dp1");
  CHECK(proto.workers(0).replica_size() == 2);
  // Layouts without the fields (every one written before them) read as before.
  CHECK(LayoutToJson(Sample(), "test").find("replica") == std::string::npos);
  auto old = ParseLayoutJson(LayoutToJson(Sample(), "test"));
  REQUIRE(old.ok());
  CHECK(old->workers[0].replica_size == 0);
  // A rank outside its replica, a size without a name, a name without a size: refused by name.
  for (auto [replica, rank, size] : {std::tuple<const char*, int, int>{"dp1", 2, 2}, {"", 0, 2}, {"dp1", 0, 0},
                                     {"dp1", -1, 2}, {"dp1", 0, -2}}) {
    Layout bad = Sample();
    bad.workers[0].replica = replica;
    bad.workers[0].replica_rank = rank;
    bad.workers[0].replica_size = size;
    auto parsed = LayoutFromProto(LayoutToProto(bad));
    REQUIRE_FALSE(parsed.ok());
    CHECK(std::string(parsed.status().message()).find("worker \"vllm-tp0\": replica") == 0);
  }
}

TEST_CASE("topology defaults and overrides") {
  auto t = ParseTopologyJson(R"({"gpusPerNode":4,"nicGbps":25})");
  REQUIRE(t.ok());
  CHECK(t->gpus_per_node == 4);
  CHECK(t->nics_per_node == 4);
  CHECK(t->nic_gbps == 25);
  CHECK(t->nvlink_gbps == 450);
  CHECK_FALSE(ParseTopologyJson(R"({"nicGbps":-1})").ok());
  CHECK_FALSE(ParseTopologyJson(R"({"nicGbs":1})").ok());
}

TEST_CASE("the summary is one JSON object with every field") {
  PlanStats s;
  s.bytes_total = 1234567890123;
  const std::string json = SummaryToJson(s, true);
  for (const char* key : {"tensors", "pieces", "transfers", "messages", "bytes_total",
                          "bytes_network", "bytes_nvlink", "bytes_local", "max_nic_bytes",
                          "predicted_seconds", "lower_bound_seconds", "planning_seconds",
                          "verified"}) {
    CHECK(json.find(std::string("\"") + key + "\":") != std::string::npos);
  }
  CHECK(json.find("\"bytes_total\":1234567890123") != std::string::npos);
  CHECK(json.find("\"verified\":true") != std::string::npos);
}

}  // namespace
}  // namespace refit
