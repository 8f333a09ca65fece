// fp8 engine layouts from real model configs: trainers in bf16 (FSDP1 flat ranges,
// FSDP2, Megatron TP) into fp8 engines, planned and verified on the host against the CPU reference
// quantizing every weight whole.
#include "client/models/fp8_layout.h"

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "client/models/layout_generator.h"
#include "client/models/model_config.h"
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
  INFO(c.status().message());
  REQUIRE(c.ok());
  return ScaleDown(*c, factor, layers);
}

PlanStats PlanAndVerify(const ModelConfig& m, const TrainerParallelism& tp,
                        const InferenceParallelism& ip, const Fp8LayoutOptions& fp8,
                        bool colocated = false) {
  auto src = MakeTrainerLayout(m, tp, {4, 0}, DType::kBF16);
  INFO(src.status().message());
  REQUIRE(src.ok());
  auto plain = MakeInferenceLayout(m, ip, {4, colocated ? 0 : (tp.World() + 3) / 4}, DType::kBF16);
  REQUIRE(plain.ok());
  auto dst = QuantizeInferenceLayout(*plain, fp8);
  INFO(dst.status().message());
  REQUIRE(dst.ok());
  REQUIRE(ValidateLayout(*src, "source").ok());
  auto dv = ValidateLayout(*dst, "destination");
  INFO(dv.message());
  REQUIRE(dv.ok());
  // What engines load quantized, and what stays.
  int quantized = 0;
  for (const LogicalTensor& t : dst->tensors) {
    const bool q = t.quant.format != QuantFormat::kNone;
    quantized += q;
    if (t.name.find("norm") != std::string::npos || t.name.find("embed") != std::string::npos ||
        t.name == "lm_head.weight" || t.name.find("mlp.gate.") != std::string::npos ||
        t.name.find("block_sparse_moe.gate.") != std::string::npos) {
      CHECK(!q);
    }
    if (q) CHECK(dst->tensor_index.contains(t.quant.scale));
  }
  CHECK(quantized > 0);
  PlanOptions options;
  options.topology.gpus_per_node = 4;
  auto plan = MakePlan(*src, *dst, options);
  INFO(plan.status().message());
  REQUIRE(plan.ok());
  auto verified = VerifyOnHost(*plan, *src, *dst, 5, int64_t{1} << 30);
  INFO(verified.status().message());
  REQUIRE(verified.ok());
  CHECK(plan->stats.bytes_before_conversion > plan->stats.bytes_total);
  // Through the layout file too: what refit-layout writes is what the daemons read.
  auto reread = ParseLayoutJson(LayoutToJson(*dst, "fp8"));
  REQUIRE(reread.ok());
  REQUIRE(ValidateLayout(*reread, "destination").ok());
  return plan->stats;
}

Fp8LayoutOptions Block(int64_t rows, int64_t cols) {
  Fp8LayoutOptions o;
  o.block_rows = rows;
  o.block_cols = cols;
  return o;
}

TEST_CASE(
    "Llama-3: Megatron TP2 holds whole blocks of the MLP; fused qkv head groups are gathered") {
  const ModelConfig m = Small("llama3-8b.json", 16, 2);
  TrainerParallelism tp;
  tp.tp = 2;
  const PlanStats s = PlanAndVerify(m, tp, {2, 1}, Block(32, 32));
  // The MLP's blocks travel as codes; only attention's interleaved head groups, cut inside a
  // block in this scaled-down model, are gathered.
  CHECK(s.bytes_gathered < s.bytes_before_conversion / 4);
}

TEST_CASE("Llama-3: FSDP1 flat ranges and FSDP2 rows cut blocks: the cut ones are gathered") {
  const ModelConfig m = Small("llama3-8b.json", 16, 2);
  TrainerParallelism fsdp;
  fsdp.fsdp = 4;
  const PlanStats a = PlanAndVerify(m, fsdp, {2, 1}, Block(32, 32));
  CHECK(a.bytes_gathered > 0);
  TrainerParallelism fsdp2;
  fsdp2.fsdp2 = 4;
  const PlanStats b = PlanAndVerify(m, fsdp2, {2, 2}, Block(32, 32), true);
  CHECK(b.bytes_gathered >= 0);
}

TEST_CASE("DeepSeek-V3: experts in stacked buffers, MLA, the router kept in bf16") {
  const ModelConfig m = Small("deepseek-v3.json", 64, 4);
  TrainerParallelism tp;
  tp.ep = 2;
  tp.dp = 2;
  InferenceParallelism ip{1, 2, true};
  PlanAndVerify(m, tp, ip, Block(8, 8));
}

TEST_CASE(
    "DeepSeek-V3 as shipped: its quantization_config's 128x128 blocks, weight_scale_inv beside "
    "each weight") {
  // Scaled by 64, but the widths vLLM stacks in one buffer (q_a in fused_qkv_a_proj, gate and up in
  // gate_up_proj and w13) kept at whole 128-row blocks, as the real model's are: a part starting
  // inside a block cannot be loaded (checked below).
  ModelConfig m = Small("deepseek-v3-fp8.json", 64, 4);
  REQUIRE(m.fp8.present);
  m.q_lora_rank = 128;
  m.moe_intermediate_size = 128;
  m.intermediate_size = 256;
  Fp8LayoutOptions o = Block(m.fp8.block_rows, m.fp8.block_cols);
  TrainerParallelism tp;
  tp.ep = 2;
  tp.dp = 2;
  PlanAndVerify(m, tp, {1, 2, true}, o);
  auto plain = MakeInferenceLayout(m, {1, 1, false}, {4, 0}, DType::kBF16);
  REQUIRE(plain.ok());
  auto l = QuantizeInferenceLayout(*plain, o);
  REQUIRE(l.ok());
  REQUIRE(ValidateLayout(*l, "destination").ok());  // indexes the tensors by name
  // As DeepSeek-V3's checkpoint holds them: "<weight>_scale_inv", fp32, one per 128x128 block.
  for (const char* name :
       {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.3.mlp.experts.5.down_proj.weight",
        "model.layers.3.mlp.shared_experts.gate_proj.weight"}) {
    INFO(name);
    const LogicalTensor& t = l->tensors[l->tensor_index.at(name)];
    CHECK(t.dtype == DType::kF8E4M3);
    CHECK(t.quant.scale == absl::StrCat(name, "_scale_inv"));
    const LogicalTensor& s = l->tensors[l->tensor_index.at(t.quant.scale)];
    CHECK(s.dtype == DType::kF32);
    CHECK(s.shape == Dims{(t.shape[0] + 127) / 128, (t.shape[1] + 127) / 128});
  }
  for (const char* name :
       {"model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
        "model.embed_tokens.weight", "lm_head.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight"}) {
    INFO(name);
    CHECK(l->tensors[l->tensor_index.at(name)].quant.format == QuantFormat::kNone);
  }
}

TEST_CASE("Mixtral: the experts' w1, w2, w3 are quantized, the router is not") {
  const ModelConfig m = Small("mixtral-8x7b.json", 32, 2);
  TrainerParallelism tp;
  tp.tp = 2;
  tp.ep = 2;
  tp.dp = 2;
  PlanAndVerify(m, tp, {2, 1, false}, Block(16, 16));
  const Fp8LayoutOptions o = Block(128, 128);
  for (const char* part : {"w1", "w2", "w3"}) {
    CHECK(QuantizedByEngines(
        absl::StrCat("model.layers.0.block_sparse_moe.experts.7.", part, ".weight"), o));
  }
  CHECK(!QuantizedByEngines("model.layers.0.block_sparse_moe.gate.weight", o));
}

TEST_CASE("Qwen3-MoE in MXFP8") {
  const ModelConfig m = Small("qwen3-30b-a3b.json", 16, 2);
  TrainerParallelism fsdp;
  fsdp.fsdp = 2;
  Fp8LayoutOptions mx;
  mx.format = QuantFormat::kMxfp8;
  PlanAndVerify(m, fsdp, {1, 1}, mx);
}

TEST_CASE("modules_to_not_convert stay bf16; a tensor-parallel size that cuts blocks is refused") {
  Fp8LayoutOptions o = Block(128, 128);
  o.modules_to_not_convert = {"self_attn"};
  CHECK(QuantizedByEngines("model.layers.0.mlp.down_proj.weight", o));
  CHECK(!QuantizedByEngines("model.layers.0.self_attn.q_proj.weight", o));
  CHECK(!QuantizedByEngines("model.layers.0.mlp.gate.weight", o));
  CHECK(!QuantizedByEngines("model.layers.0.self_attn.q_proj.bias", o));
  const ModelConfig m = Small("llama3-8b.json", 16, 1);  // hidden 256: TP4 gives 64 rows
  auto plain = MakeInferenceLayout(m, {4, 1}, {4, 0}, DType::kBF16);
  REQUIRE(plain.ok());
  auto dst = QuantizeInferenceLayout(*plain, Block(128, 128));
  REQUIRE(!dst.ok());
  CHECK_THAT(std::string(dst.status().message()), Catch::Contains("cuts a 128x128 block"));
}

TEST_CASE("a config's quantization_config is read") {
  auto c = ParseModelConfig(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
    "num_hidden_layers":1,"vocab_size":32,"intermediate_size":128,
    "quantization_config":{"quant_method":"fp8","weight_block_size":[64,32],"modules_to_not_convert":["lm_head"]}})");
  INFO(c.status().message());
  REQUIRE(c.ok());
  CHECK(c->fp8.present);
  CHECK(c->fp8.block_rows == 64);
  CHECK(c->fp8.block_cols == 32);
  CHECK(c->fp8.modules_to_not_convert == std::vector<std::string>{"lm_head"});
  auto per_tensor =
      ParseModelConfig(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
    "num_hidden_layers":1,"vocab_size":32,"quantization_config":{"quant_method":"fp8"}})");
  REQUIRE(!per_tensor.ok());
  CHECK_THAT(std::string(per_tensor.status().message()), Catch::Contains("per-tensor fp8"));
}

}  // namespace
}  // namespace refit
