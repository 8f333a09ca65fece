#include "proto/layout_codec.h"

#include <catch2/catch.hpp>
#include <tuple>

#include "client/models/layout_generator.h"
#include "client/models/model_config.h"
#include "google/protobuf/util/json_util.h"
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

TEST_CASE("a quantized tensor's format, block and scale survive JSON, proto and the compact form") {
  Layout a;
  const int32_t w = a.AddTensor("m.weight", Dims{256, 128}, DType::kF8E4M3);
  a.tensors[w].quant = Quantization::Of(QuantFormat::kBlockFp8, "m.weight", 128, 64);
  const int32_t s = a.AddTensor("m.weight_scale_inv", Dims{2, 2}, DType::kF32);
  const int32_t x = a.AddTensor("n.weight", Dims{4, 64}, DType::kF8E4M3);
  a.tensors[x].quant = Quantization::Of(QuantFormat::kMxfp8, "n.weight");
  const int32_t xs = a.AddTensor("n.weight_scale", Dims{4, 2}, DType::kE8M0);
  const int32_t worker = a.AddWorker("e0", 0, 0);
  for (int32_t t : {w, s, x, xs}) {
    const int32_t b =
        a.AddBuffer(worker, a.tensors[t].name, a.tensors[t].dtype, a.tensors[t].shape);
    a.AddPiece(t, Box::Whole(a.tensors[t].shape), b, Box::Whole(a.tensors[t].shape));
  }
  REQUIRE(ValidateLayout(a, "destination").ok());
  const std::string json = LayoutToJson(a, "fp8");
  INFO(json);
  CHECK(
      json.find(
          R"("quantization":{"format":"block_fp8","block":[128,64],"scale":"m.weight_scale_inv"})") !=
      std::string::npos);
  for (auto b : {ParseLayoutJson(json), LayoutFromProto(LayoutToProto(a, "fp8")),
                 LayoutFromProto(CompactLayoutToProto(a, "fp8", {}))}) {
    REQUIRE(b.ok());
    CHECK(b->tensors[0].quant == a.tensors[0].quant);
    CHECK(b->tensors[2].quant == a.tensors[2].quant);
    CHECK(b->tensors[1].quant.format == QuantFormat::kNone);
    CHECK(b->tensors[3].dtype == DType::kE8M0);
  }
  // Defaults: block 128 x 128 and the DeepSeek-V3 scale name.
  auto d = ParseLayoutJson(R"({"tensors":[{"name":"w","shape":[4,4],"dtype":"float8_e4m3fn",
    "quantization":{"format":"block_fp8"}}]})");
  REQUIRE(d.ok());
  CHECK(d->tensors[0].quant == Quantization::Of(QuantFormat::kBlockFp8, "w", 128, 128));
  CHECK(d->tensors[0].quant.scale == "w_scale_inv");
  auto bad = ParseLayoutJson(R"({"tensors":[{"name":"w","shape":[4,4],"dtype":"fp8",
    "quantization":{"format":"nvfp4"}}]})");
  REQUIRE(!bad.ok());
  CHECK_THAT(std::string(bad.status().message()), Catch::Contains("\"nvfp4\" is unknown"));
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
  CHECK(
      error(R"({"tensors":[{"name":"w","shape":[-1],"dtype":"bf16"}]})").find("negative extent") !=
      std::string::npos);
  CHECK(error(R"({"tensors":[],"workers":[{"name":"r","buffers":[{"name":"b","dtype":"bf16",
      "shape":[1],"pieces":[{"tensor":"ghost"}]}]}]})")
            .find("names tensor \"ghost\", which the layout does not declare") !=
        std::string::npos);
  CHECK(error(R"({"tensors":[{"name":"w","shape":[2],"dtype":"bf16"}],"workers":[{"name":"r",
      "buffers":[{"name":"b","dtype":"bf16","shape":[2],"pieces":[{"tensor":"w",
      "tensorBox":{"origin":[0],"shape":[1,1]}}]}]}]})")
            .find("rank") != std::string::npos);
  CHECK(error(R"({"tensors":[{"name":"w","shape":[2],"dtype":"bf16"},
      {"name":"w","shape":[2],"dtype":"bf16"}]})")
            .find("declared twice") != std::string::npos);
}

TEST_CASE(
    "a worker's engine replica: kept through JSON and proto, absent when undeclared, checked") {
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
  for (auto [replica, rank, size] : {std::tuple<const char*, int, int>{"dp1", 2, 2},
                                     {"", 0, 2},
                                     {"dp1", 0, 0},
                                     {"dp1", -1, 2},
                                     {"dp1", 0, -2}}) {
    Layout bad = Sample();
    bad.workers[0].replica = replica;
    bad.workers[0].replica_rank = rank;
    bad.workers[0].replica_size = size;
    auto parsed = LayoutFromProto(LayoutToProto(bad));
    REQUIRE_FALSE(parsed.ok());
    CHECK(std::string(parsed.status().message()).find("worker \"vllm-tp0\": replica") == 0);
  }
}

// Equal as the planner sees them: every vector in order, boxes by interned index.
void RequireSameLayout(const Layout& a, const Layout& b) {
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    REQUIRE(a.tensors[i].name == b.tensors[i].name);
    REQUIRE(a.tensors[i].shape == b.tensors[i].shape);
    REQUIRE(a.tensors[i].dtype == b.tensors[i].dtype);
  }
  REQUIRE(a.workers.size() == b.workers.size());
  for (size_t i = 0; i < a.workers.size(); ++i) {
    const Worker &x = a.workers[i], &y = b.workers[i];
    REQUIRE(std::tie(x.name, x.node, x.gpu, x.replica, x.replica_rank, x.replica_size) ==
            std::tie(y.name, y.node, y.gpu, y.replica, y.replica_rank, y.replica_size));
  }
  REQUIRE(a.buffers.size() == b.buffers.size());
  for (size_t i = 0; i < a.buffers.size(); ++i) {
    const Buffer &x = a.buffers[i], &y = b.buffers[i];
    REQUIRE(std::tie(x.name, x.worker, x.dtype) == std::tie(y.name, y.worker, y.dtype));
    REQUIRE(x.shape == y.shape);
  }
  REQUIRE(a.pieces.size() == b.pieces.size());
  for (size_t i = 0; i < a.pieces.size(); ++i) {
    const Piece &x = a.pieces[i], &y = b.pieces[i];
    INFO("piece " << i);
    REQUIRE(std::tie(x.tensor, x.buffer, x.tensor_box, x.buffer_box) ==
            std::tie(y.tensor, y.buffer, y.tensor_box, y.buffer_box));
  }
  REQUIRE(a.boxes.size() == b.boxes.size());
  for (size_t i = 0; i < a.boxes.size(); ++i) REQUIRE(a.boxes[i] == b.boxes[i]);
}

ModelConfig Model(const std::string& file, int64_t scale, int64_t layers) {
  auto text = ReadFile("tests/configs/" + file);
  REQUIRE(text.ok());
  auto m = ParseModelConfig(*text);
  REQUIRE(m.ok());
  return ScaleDown(*m, scale, layers);
}

// Compacts `layout` every way and checks it expands to what the full form decodes to.
void CheckCompactRoundTrip(const Layout& layout) {
  auto full = LayoutFromProto(LayoutToProto(layout, "m"));
  REQUIRE(full.ok());
  const size_t full_bytes = LayoutToProto(layout, "m").ByteSizeLong();
  for (int mask = 0; mask < 16; ++mask) {
    CompactOptions o;
    o.buffers_like = mask & 1;
    o.tensor_index = mask & 2;
    o.omit_whole_boxes = mask & 4;
    o.runs = mask & 8;
    INFO("compact options mask " << mask);
    const v1::Layout compact = CompactLayoutToProto(layout, "m", o);
    CHECK(compact.ByteSizeLong() <= full_bytes);
    auto back = LayoutFromProto(compact);
    REQUIRE(back.ok());
    RequireSameLayout(*full, *back);
  }
  // The proto3 JSON of the compact form reads back alike (hand-written files may use the fields).
  std::string json;
  REQUIRE(
      google::protobuf::util::MessageToJsonString(CompactLayoutToProto(layout, "m"), &json).ok());
  auto parsed = ParseLayoutJson(json);
  REQUIRE(parsed.ok());
  RequireSameLayout(*full, *parsed);
}

TEST_CASE("compact layouts expand to the full layout: generated MoE trainer and engine") {
  const ModelConfig m = Model("deepseek-v3.json", 16, 5);
  auto src = MakeTrainerLayout(m, {1, 2, 4, 4, 1, 0}, {8, 0}, DType::kBF16);
  REQUIRE(src.ok());
  auto dst = MakeInferenceLayout(m, {4, 2, false}, {8, 1}, DType::kBF16);
  REQUIRE(dst.ok());
  REQUIRE(ValidateLayout(*src, "source").ok());
  REQUIRE(ValidateLayout(*dst, "destination").ok());
  CheckCompactRoundTrip(*src);
  CheckCompactRoundTrip(*dst);
  // Expert-stacked buffers: runs, and far fewer bytes.
  const v1::Layout compact = CompactLayoutToProto(*dst, "m");
  int runs = 0;
  for (const v1::Worker& w : compact.workers()) {
    for (const v1::Buffer& b : w.buffers()) {
      for (const v1::Piece& p : b.pieces()) runs += p.repeat() > 0;
    }
  }
  CHECK(runs > 0);
  // vLLM's w13_weight: (gate, up) of every expert, one run of a group of two.
  int w13 = 0;
  for (const v1::Worker& w : compact.workers()) {
    for (const v1::Buffer& b : w.buffers()) {
      if (b.name().find("w13_weight") == std::string::npos) continue;
      ++w13;
      REQUIRE(b.pieces_size() == 2);
      CHECK(b.pieces(0).run_pieces() == 2);
      CHECK(b.pieces(0).repeat() + 1 == b.shape(0));
    }
  }
  CHECK(w13 > 0);
  CHECK(compact.ByteSizeLong() * 3 < LayoutToProto(*dst, "m").ByteSizeLong());
}

TEST_CASE(
    "compact layouts expand to the full layout: a dense engine's replicas are described once") {
  const ModelConfig m = Model("llama3-8b.json", 8, 3);
  auto src = MakeTrainerLayout(m, {2, 1, 1, 2, 1, 0}, {8, 0}, DType::kBF16);
  REQUIRE(src.ok());
  auto dst = MakeInferenceLayout(m, {2, 4, false}, {8, 1}, DType::kBF16);
  REQUIRE(dst.ok());
  CheckCompactRoundTrip(*src);
  CheckCompactRoundTrip(*dst);
  const v1::Layout compact = CompactLayoutToProto(*dst, "m");
  int like = 0;
  for (const v1::Worker& w : compact.workers()) {
    if (w.buffers_like().empty()) continue;
    ++like;
    CHECK(w.buffers_size() == 0);
    // Rank t of replica d > 0 is described by rank t of replica 0.
    CHECK(w.buffers_like() == "vllm-dp0-tp" + w.name().substr(w.name().size() - 1));
  }
  CHECK(like == 6);  // 3 of 4 replicas, 2 ranks each
  CheckCompactRoundTrip(Sample());
}

TEST_CASE(
    "compact references that do not resolve are INVALID_ARGUMENT naming worker, buffer and piece") {
  auto error = [](const std::string& workers) {
    const std::string json = R"({"tensors":[{"name":"w","shape":[8,2],"dtype":"bf16"},)"
                             R"({"name":"v","shape":[8,2],"dtype":"bf16"}],"workers":[)" +
                             workers + "]}";
    auto l = ParseLayoutJson(json);
    INFO(json);
    REQUIRE_FALSE(l.ok());
    CHECK(l.status().code() == absl::StatusCode::kInvalidArgument);
    return std::string(l.status().message());
  };
  const std::string a =
      R"({"name":"a","node":0,"gpu":0,"buffers":[{"name":"b","dtype":"bf16","shape":[8,2],)"
      R"("pieces":[{"tensor":"w"}]}]})";
  auto with_piece = [&](const std::string& piece) {
    return error(
        R"({"name":"a","node":0,"gpu":0,"buffers":[{"name":"b","dtype":"bf16","shape":[8,2],"pieces":[)" +
        piece + "]}]}");
  };
  using Catch::Matchers::Contains;
  // buffers_like: unknown, later, itself, or with buffers of its own.
  CHECK_THAT(
      error(a + R"(,{"name":"x","buffersLike":"nobody"})"),
      Contains("worker \"x\": buffers_like names \"nobody\", which is not an earlier worker"));
  CHECK_THAT(error(R"({"name":"x","buffersLike":"a"},)" + a),
             Contains("worker \"x\": buffers_like names \"a\", which is not an earlier worker"));
  CHECK_THAT(error(a + R"(,{"name":"x","buffersLike":"x"})"),
             Contains("worker \"x\": buffers_like names \"x\", which is not an earlier worker"));
  CHECK_THAT(
      error(
          a +
          R"(,{"name":"x","buffersLike":"a","buffers":[{"name":"c","dtype":"bf16","shape":[1]}]})"),
      Contains("worker \"x\" has both buffers_like (\"a\") and buffers of its own"));
  // tensor_index: out of range either way; disagreeing with the name.
  CHECK_THAT(
      with_piece(R"({"tensorIndex":3})"),
      Contains(
          "worker \"a\" buffer \"b\" piece 0: tensor_index 3 is out of range (1-based; the layout "
          "declares 2 tensors)"));
  CHECK_THAT(with_piece(R"({"tensor":"w"},{"tensorIndex":-1})"),
             Contains("worker \"a\" buffer \"b\" piece 1: tensor_index -1 is out of range"));
  CHECK_THAT(
      with_piece(R"({"tensor":"w","tensorIndex":2})"),
      Contains(
          "worker \"a\" buffer \"b\" piece 0: tensor \"w\" and tensor_index 2 (\"v\") disagree"));
  // Runs: steps need a repeat, an index and explicit boxes of their rank; the run stays in range.
  CHECK_THAT(
      with_piece(R"({"tensorIndex":1,"tensorIndexStep":1})"),
      Contains("worker \"a\" buffer \"b\" piece 0 (tensor \"w\"): run fields without a repeat"));
  CHECK_THAT(with_piece(R"({"tensorIndex":1,"repeat":-2})"),
             Contains("piece 0 (tensor \"w\"): repeat -2 < 0"));
  CHECK_THAT(with_piece(R"({"tensor":"w","repeat":1,"tensorIndexStep":1})"),
             Contains("piece 0 (tensor \"w\"): tensor_index_step needs tensor_index"));
  CHECK_THAT(
      with_piece(R"({"tensorIndex":1,"repeat":2,"tensorIndexStep":1})"),
      Contains(
          "piece 0 (tensor \"w\"): a run of 3 with tensor_index_step 1 reaches tensor_index 3, "
          "out of range"));
  CHECK_THAT(with_piece(R"({"tensorIndex":1,"repeat":1,"bufferBoxStep":[4,0]})"),
             Contains("piece 0 (tensor \"w\"): buffer_box_step has 2 dimensions; it needs an "
                      "explicit buffer_box"));
  CHECK_THAT(
      with_piece(R"({"tensorIndex":1,"repeat":1,"tensorBox":{"origin":[0,0],"shape":[4,2]},)"
                 R"("tensorBoxStep":[4]})"),
      Contains("tensor_box_step has 1 dimensions; it needs an explicit tensor_box of as many (2)"));
  CHECK_THAT(with_piece(R"({"tensorIndex":1,"repeat":4,"tensorBox":{"origin":[0,0],"shape":[4,2]},)"
                        R"("tensorBoxStep":[4611686018427387904,0]})"),
             Contains("piece 0 (tensor \"w\"): tensor_box_step overflows int64 over 4 repeats"));
  CHECK_THAT(with_piece(R"({"tensorIndex":1,"runPieces":2})"),
             Contains("piece 0 (tensor \"w\"): run fields without a repeat"));
  CHECK_THAT(
      with_piece(R"({"tensorIndex":1,"repeat":1,"runPieces":2})"),
      Contains("piece 0 (tensor \"w\"): run_pieces 2, but the buffer has 1 pieces from here"));
  CHECK_THAT(
      with_piece(R"({"tensorIndex":1,"repeat":1,"runPieces":2},{"tensorIndex":2,"repeat":1})"),
      Contains("worker \"a\" buffer \"b\" piece 1: one of the run of piece 0 (run_pieces 2), it "
               "may carry no "
               "run fields"));
  CHECK_THAT(
      with_piece(
          R"({"tensorIndex":1,"repeat":1,"runPieces":2,"tensorIndexStep":1},{"tensor":"v"})"),
      Contains("piece 1 (tensor \"w\"): tensor_index_step needs tensor_index"));
  // Every size is bounded: a run may not expand past kMaxLayoutPieces (checked before any of it).
  CHECK_THAT(
      with_piece(R"({"tensorIndex":1,"repeat":2000000000})"),
      Contains("worker \"a\" buffer \"b\": the layout expands to more than 67108864 pieces"));
  // A group run: (w, v) at rows [0:8] and [8:16] of slab 0, then the same at slab 1.
  auto group = ParseLayoutJson(
      R"({"tensors":[{"name":"w","shape":[8,2],"dtype":"bf16"},{"name":"v","shape":[8,2],"dtype":"bf16"}],)"
      R"("workers":[{"name":"a","node":0,"gpu":0,"buffers":[{"name":"b","dtype":"bf16","shape":[2,16,2],)"
      R"("pieces":[{"tensorIndex":1,"repeat":1,"runPieces":2,"bufferBox":{"origin":[0,0,0],"shape":[1,8,2]},)"
      R"("bufferBoxStep":[1,0,0]},{"tensorIndex":2,"bufferBox":{"origin":[0,8,0],"shape":[1,8,2]}}]}]}]})");
  REQUIRE(group.ok());
  REQUIRE(group->pieces.size() == 4);
  CHECK(group->pieces[2].tensor == 0);
  CHECK(group->pieces[3].tensor == 1);
  CHECK(group->buffer_box(group->pieces[3]) == Box::FromDims(Dims{1, 8, 0}, Dims{1, 8, 2}));
  // A well-formed run and a like-worker read as the pieces spelled out.
  auto run = ParseLayoutJson(
      R"({"tensors":[{"name":"w","shape":[8,2],"dtype":"bf16"},{"name":"v","shape":[8,2],"dtype":"bf16"}],)"
      R"("workers":[{"name":"a","node":0,"gpu":0,"buffers":[{"name":"b","dtype":"bf16","shape":[2,4,2],)"
      R"("pieces":[{"tensorIndex":1,"repeat":1,"tensorIndexStep":1,"tensorBox":{"origin":[4,0],"shape":[4,2]},)"
      R"("bufferBox":{"origin":[0,0,0],"shape":[1,4,2]},"bufferBoxStep":[1,0,0]}]}]},)"
      R"({"name":"x","node":1,"gpu":0,"buffersLike":"a"}]})");
  REQUIRE(run.ok());
  REQUIRE(run->pieces.size() == 4);
  CHECK(run->pieces[1].tensor == 1);
  CHECK(run->tensor_box(run->pieces[1]) == Box::FromDims(Dims{4, 0}, Dims{4, 2}));
  CHECK(run->buffer_box(run->pieces[1]) == Box::FromDims(Dims{1, 0, 0}, Dims{1, 4, 2}));
  CHECK(run->buffers.size() == 2);
  CHECK(run->buffers[1].worker == 1);
  CHECK(run->pieces[3].buffer == 1);
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
  for (const char* key :
       {"tensors", "pieces", "transfers", "messages", "bytes_total", "bytes_network",
        "bytes_nvlink", "bytes_local", "max_nic_bytes", "predicted_seconds", "lower_bound_seconds",
        "planning_seconds", "verified"}) {
    CHECK(json.find(std::string("\"") + key + "\":") != std::string::npos);
  }
  CHECK(json.find("\"bytes_total\":1234567890123") != std::string::npos);
  CHECK(json.find("\"verified\":true") != std::string::npos);
}

}  // namespace
}  // namespace refit
