// Real-model layouts from the generators, planned and verified byte for byte on the host.
#include "client/layout_generator.h"

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "plan/planner.h"
#include "plan/validate.h"
#include "plan/verify.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

ModelConfig Small(const std::string& name, int64_t factor, int64_t layers) {
  auto text = ReadFile("tests/configs/" + name);
  REQUIRE(text.ok());
  auto c = ParseModelConfig(*text);
  REQUIRE(c.ok());
  return ScaleDown(*c, factor, layers);
}

PlanStats PlanAndVerify(const ModelConfig& m, const TrainerParallelism& tp,
                        const InferenceParallelism& ip, int gpus_per_node, bool colocated,
                        DType inference_dtype = DType::kBF16) {
  auto src = MakeTrainerLayout(m, tp, {gpus_per_node, 0}, DType::kBF16);
  INFO(src.status().message());
  REQUIRE(src.ok());
  const int32_t trainer_nodes = (tp.World() + gpus_per_node - 1) / gpus_per_node;
  auto dst = MakeInferenceLayout(m, ip, {gpus_per_node, colocated ? 0 : trainer_nodes}, inference_dtype);
  INFO(dst.status().message());
  REQUIRE(dst.ok());
  auto sv = ValidateLayout(*src, "source");
  INFO(sv.message());
  REQUIRE(sv.ok());
  auto dv = ValidateLayout(*dst, "destination");
  INFO(dv.message());
  REQUIRE(dv.ok());
  PlanOptions options;
  options.topology.gpus_per_node = gpus_per_node;
  options.topology.nics_per_node = gpus_per_node;
  options.max_message_bytes = 1 << 20;
  auto plan = MakePlan(*src, *dst, options);
  INFO(plan.status().message());
  REQUIRE(plan.ok());
  auto verified = VerifyOnHost(*plan, *src, *dst, 7, int64_t{2} << 30);
  INFO(verified.status().message());
  REQUIRE(verified.ok());
  // Every destination byte of the model was moved: the inference side needs the whole model
  // dp times, each element once per replica.
  int64_t needed = 0;
  for (const Piece& p : dst->pieces) needed += dst->tensor_box(p).NumElements();
  CHECK(verified->elements_checked == needed);
  return plan->stats;
}

TEST_CASE("Llama-3-8B: Megatron TP4 to vLLM TP2 (fused qkv, gate_up, padded vocab)") {
  const ModelConfig m = Small("llama3-8b.json", 32, 4);
  const PlanStats s = PlanAndVerify(m, {4, 1, 1, 1, 1, 0}, {2, 1, false}, 8, false);
  CHECK(s.bytes_network > 0);
}

TEST_CASE("Llama-3-8B: TP2 PP2 DP2 CP2 trainer to vLLM TP4 DP2 on nodes of 4") {
  PlanAndVerify(Small("llama3-8b.json", 32, 4), {2, 2, 1, 2, 2, 0}, {4, 2, false}, 4, false);
}

TEST_CASE("Llama-3-8B: FSDP over 8 ranks, shards starting mid-tensor, colocated with TP8") {
  const PlanStats s = PlanAndVerify(Small("llama3-8b.json", 32, 3), {1, 1, 1, 1, 1, 8}, {8, 1, false}, 8, true);
  CHECK(s.bytes_network == 0);
}

TEST_CASE("Qwen2.5-7B with q/k/v biases: 28 heads and 4 kv heads over TP4, and over TP2") {
  // vLLM refuses TP8 here (28 heads): see fsdp_layout_test.cc's refusals.
  PlanAndVerify(Small("qwen2.5-7b.json", 28, 2), {4, 1, 1, 2, 1, 0}, {2, 1, false}, 8, false);
  PlanAndVerify(Small("qwen2.5-7b.json", 28, 2), {2, 1, 1, 2, 1, 0}, {4, 2, false}, 8, false);
}

TEST_CASE("Llama-3-8B on vLLM TP16: 8 kv heads, each replicated on 2 ranks") {
  PlanAndVerify(Small("llama3-8b.json", 32, 2), {8, 1, 1, 1, 1, 0}, {16, 1, false}, 8, false);
}

TEST_CASE("Qwen3-30B-A3B: EP4 x TP2 trainer to vLLM TP4 with stacked experts, and to EP") {
  const ModelConfig m = Small("qwen3-30b-a3b.json", 16, 2);
  PlanAndVerify(m, {2, 2, 4, 4, 1, 0}, {4, 2, false}, 8, false);
  PlanAndVerify(m, {2, 1, 4, 4, 1, 0}, {2, 4, true}, 8, false);
}

TEST_CASE("DeepSeek-V3 structure (MLA, shared experts, dense first layers): PP4 EP8 to TP8 DP2") {
  PlanAndVerify(Small("deepseek-v3.json", 64, 5), {1, 4, 8, 8, 1, 0}, {8, 2, false}, 8, false);
}

TEST_CASE("bf16 trained, fp32 served: cast on the way") {
  PlanAndVerify(Small("llama3-8b.json", 64, 2), {2, 1, 1, 1, 1, 0}, {2, 1, false}, 8, false, DType::kF32);
}

TEST_CASE("impossible parallelism is refused with the reason") {
  const ModelConfig m = Small("llama3-8b.json", 32, 2);
  auto a = MakeTrainerLayout(m, {16, 1, 1, 1, 1, 0}, {8, 0}, DType::kBF16);
  REQUIRE_FALSE(a.ok());
  CHECK(std::string(a.status().message()).find("divide num_key_value_heads") != std::string::npos);
  auto b = MakeTrainerLayout(m, {1, 1, 3, 2, 1, 0}, {8, 0}, DType::kBF16);
  REQUIRE_FALSE(b.ok());
  CHECK(std::string(b.status().message()).find("ep (3) must divide dp * cp (2)") != std::string::npos);
  auto c = MakeTrainerLayout(m, {1, 3, 1, 1, 1, 0}, {8, 0}, DType::kBF16);
  REQUIRE_FALSE(c.ok());
  CHECK(std::string(c.status().message()).find("pp (3) exceeds") != std::string::npos);
  auto d = MakeInferenceLayout(m, {0, 1, false}, {8, 0}, DType::kBF16);
  REQUIRE_FALSE(d.ok());
}

TEST_CASE("vLLM buffers look as vLLM stores them") {
  const ModelConfig m = Small("qwen3-30b-a3b.json", 16, 1);
  auto l = MakeInferenceLayout(m, {2, 1, false}, {8, 0}, DType::kBF16);
  REQUIRE(l.ok());
  REQUIRE(ValidateLayout(*l, "destination").ok());
  int qkv = 0, w13 = 0, embed_rows = 0;
  for (const Buffer& b : l->buffers) {
    if (b.name == "model.layers.0.self_attn.qkv_proj.weight") {
      ++qkv;
      CHECK(b.shape == Dims{(16 + 2 * 2) * 8, 128});  // 32 q heads / 2, 4 kv heads / 2, head_dim 8
    }
    if (b.name == "model.layers.0.mlp.experts.w13_weight") {
      ++w13;
      CHECK(b.shape == Dims{128, 2 * 24, 128});
    }
    if (b.name == "model.embed_tokens.weight") embed_rows += b.shape[0];
  }
  CHECK(qkv == 2);
  CHECK(w13 == 2);
  CHECK(embed_rows == (151936 / 16 + 63) / 64 * 64);  // padded to a multiple of 64
}

}  // namespace
}  // namespace refit
