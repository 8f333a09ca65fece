// Real-model layouts from the generators, planned and verified byte for byte on the host.
#include "client/models/layout_generator.h"

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
  auto dst =
      MakeInferenceLayout(m, ip, {gpus_per_node, colocated ? 0 : trainer_nodes}, inference_dtype);
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
  const PlanStats s =
      PlanAndVerify(Small("llama3-8b.json", 32, 3), {1, 1, 1, 1, 1, 8}, {8, 1, false}, 8, true);
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
  PlanAndVerify(Small("llama3-8b.json", 64, 2), {2, 1, 1, 1, 1, 0}, {2, 1, false}, 8, false,
                DType::kF32);
}

TEST_CASE("impossible parallelism is refused with the reason") {
  const ModelConfig m = Small("llama3-8b.json", 32, 2);
  auto a = MakeTrainerLayout(m, {16, 1, 1, 1, 1, 0}, {8, 0}, DType::kBF16);
  REQUIRE_FALSE(a.ok());
  CHECK(std::string(a.status().message()).find("divide num_key_value_heads") != std::string::npos);
  auto b = MakeTrainerLayout(m, {1, 1, 3, 2, 1, 0}, {8, 0}, DType::kBF16);
  REQUIRE_FALSE(b.ok());
  CHECK(std::string(b.status().message()).find("ep (3) must divide dp * cp (2)") !=
        std::string::npos);
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

// The buffer `name` of worker `worker`, or nullptr.
const Buffer* FindBuffer(const Layout& l, const std::string& worker, const std::string& name) {
  for (const Buffer& b : l.buffers) {
    if (b.name == name && l.workers[b.worker].name == worker) return &b;
  }
  return nullptr;
}

// The pieces of `tensor` in buffer `buffer` (an index into l.buffers).
std::vector<const Piece*> PiecesOf(const Layout& l, int32_t buffer, const std::string& tensor) {
  std::vector<const Piece*> out;
  for (const Piece& p : l.pieces) {
    if (p.buffer == buffer && l.tensors[p.tensor].name == tensor) out.push_back(&p);
  }
  return out;
}

int32_t BufferIndex(const Layout& l, const Buffer* b) {
  return static_cast<int32_t>(b - l.buffers.data());
}

// One expected slice: rows [begin, begin + rows) of `tensor` (dim 0; dim 1 for down/o projections)
// at row (or column) `at` of the buffer, behind `lead` leading dims (the stacked expert index).
void CheckSlice(const Layout& l, const Buffer* b, const std::string& tensor, int dim, int64_t begin,
                int64_t rows, Dims buffer_origin) {
  INFO("buffer " << b->name << " of " << l.workers[b->worker].name << ", tensor " << tensor);
  const auto pieces = PiecesOf(l, BufferIndex(l, b), tensor);
  REQUIRE(pieces.size() == 1);
  const Box& tb = l.tensor_box(*pieces[0]);
  CHECK(tb.origin[dim] == begin);
  CHECK(tb.shape[dim] == rows);
  const Box& bb = l.buffer_box(*pieces[0]);
  CHECK(bb.origin_dims() == buffer_origin);
}

// vLLM's FusedMoEParallelConfig.make flattens tp across dp: without expert parallelism the routed
// experts' intermediate rows are split over all dp * tp ranks, rank d * tp + t; attention, dense
// MLPs and shared experts stay tensor-parallel within each replica; routers are whole everywhere.
TEST_CASE("vLLM without expert parallelism: routed experts over dp * tp ranks, the rest over tp") {
  struct Case {
    const char* name;
    const char* config;
    int64_t factor, layers;
    int32_t tp, dp;
    bool expert_parallel;
    TrainerParallelism trainer;  // planned from this Megatron trainer and verified
  };
  const std::vector<Case> cases = {
      {"Qwen3-30B-A3B TP2 DP2 (the report: dp1-tp0 holds gate rows [24, 36))",
       "qwen3-30b-a3b.json",
       16,
       1,
       2,
       2,
       false,
       {2, 1, 2, 2, 1, 0}},
      {"Qwen3-30B-A3B TP1 DP4", "qwen3-30b-a3b.json", 16, 1, 1, 4, false, {2, 1, 2, 2, 1, 0}},
      {"Qwen3-30B-A3B TP4 DP2", "qwen3-30b-a3b.json", 16, 2, 4, 2, false, {1, 1, 4, 4, 1, 0}},
      {"Qwen3-30B-A3B TP2 DP1 (no flattening to do)",
       "qwen3-30b-a3b.json",
       16,
       1,
       2,
       1,
       false,
       {2, 1, 1, 1, 1, 0}},
      {"Qwen3-30B-A3B TP2 DP2 EP: experts whole, over 4 ranks",
       "qwen3-30b-a3b.json",
       16,
       1,
       2,
       2,
       true,
       {2, 1, 2, 2, 1, 0}},
      {"DeepSeek-V3 TP2 DP2: shared experts over tp, routed over dp * tp",
       "deepseek-v3.json",
       64,
       4,
       2,
       2,
       false,
       {1, 2, 4, 4, 1, 0}},
      {"DeepSeek-V3 TP4 DP2 EP", "deepseek-v3.json", 64, 4, 4, 2, true, {2, 1, 2, 2, 1, 0}},
      {"Kimi-K2 TP2 DP4", "kimi-k2.json", 64, 2, 2, 4, false, {2, 1, 2, 2, 1, 0}},
      {"Qwen3-235B-A22B TP2 DP2", "qwen3-235b-a22b.json", 32, 1, 2, 2, false, {2, 1, 1, 1, 1, 0}},
      {"DeepSeek-V2-Lite TP2 DP2 (q_proj, no q_lora; 2 shared experts)",
       "deepseek-v2-lite.json",
       16,
       3,
       2,
       2,
       false,
       {2, 1, 2, 2, 1, 0}},
      {"DeepSeek-V2 TP4 DP2 EP", "deepseek-v2.json", 64, 2, 4, 2, true, {2, 1, 2, 2, 1, 0}},
  };
  for (const Case& c : cases) {
    SECTION(c.name) {
      const ModelConfig m = Small(c.config, c.factor, c.layers);
      const InferenceParallelism ip{c.tp, c.dp, c.expert_parallel};
      auto l = MakeInferenceLayout(m, ip, {8, 0}, DType::kBF16);
      INFO(l.status().message());
      REQUIRE(l.ok());
      REQUIRE(ValidateLayout(*l, "destination").ok());
      const int64_t flat = int64_t{c.tp} * c.dp, E = m.num_experts, H = m.hidden_size;
      const int64_t inter = m.moe_intermediate_size;
      for (int64_t layer = 0; layer < m.num_hidden_layers; ++layer) {
        if (!m.IsMoeLayer(layer)) continue;
        const std::string lp = absl::StrCat("model.layers.", layer, ".mlp.");
        for (int64_t d = 0; d < c.dp; ++d) {
          for (int64_t t = 0; t < c.tp; ++t) {
            const std::string w = absl::StrCat("vllm-dp", d, "-tp", t);
            const int64_t r = d * c.tp + t;
            // Routed experts: rows [r * i, (r + 1) * i) of every expert, or whole experts.
            const int64_t i = c.expert_parallel ? inter : inter / flat;
            const int64_t e0 = c.expert_parallel ? r * E / flat : 0;  // E divides evenly here
            const int64_t e_local = c.expert_parallel ? E / flat : E;
            const int64_t row0 = c.expert_parallel ? 0 : r * i;
            const Buffer* w13 = FindBuffer(*l, w, lp + "experts.w13_weight");
            const Buffer* w2 = FindBuffer(*l, w, lp + "experts.w2_weight");
            REQUIRE(w13 != nullptr);
            REQUIRE(w2 != nullptr);
            CHECK(w13->shape == Dims{e_local, 2 * i, H});
            CHECK(w2->shape == Dims{e_local, H, i});
            for (int64_t e : {e0, e0 + e_local - 1}) {
              const std::string ep = absl::StrCat(lp, "experts.", e, ".");
              CheckSlice(*l, w13, ep + "gate_proj.weight", 0, row0, i, Dims{e - e0, 0, 0});
              CheckSlice(*l, w13, ep + "up_proj.weight", 0, row0, i, Dims{e - e0, i, 0});
              CheckSlice(*l, w2, ep + "down_proj.weight", 1, row0, i, Dims{e - e0, 0, 0});
            }
            // Shared experts: a regular MLP, TP within the replica.
            const int64_t shared =
                m.n_shared_experts * m.moe_intermediate_size + m.shared_expert_intermediate_size;
            if (shared > 0) {
              const std::string sp =
                  lp + (m.n_shared_experts > 0 ? "shared_experts." : "shared_expert.");
              const int64_t s = shared / c.tp;
              const Buffer* gate_up = FindBuffer(*l, w, sp + "gate_up_proj.weight");
              REQUIRE(gate_up != nullptr);
              CHECK(gate_up->shape == Dims{2 * s, H});
              CheckSlice(*l, gate_up, sp + "gate_proj.weight", 0, t * s, s, Dims{0, 0});
              CheckSlice(*l, gate_up, sp + "up_proj.weight", 0, t * s, s, Dims{s, 0});
              const Buffer* down = FindBuffer(*l, w, sp + "down_proj.weight");
              REQUIRE(down != nullptr);
              CHECK(down->shape == Dims{H, s});
              CheckSlice(*l, down, sp + "down_proj.weight", 1, t * s, s, Dims{0, 0});
            }
            // The router: replicated.
            const Buffer* gate = FindBuffer(*l, w, lp + "gate.weight");
            REQUIRE(gate != nullptr);
            CHECK(gate->shape == Dims{E, H});
          }
        }
      }
      // Attention stays TP within the replica: o_proj's columns over tp, the same in every replica.
      const std::string o = "model.layers.0.self_attn.o_proj.weight";
      for (int64_t d = 0; d < c.dp; ++d) {
        const Buffer* b = FindBuffer(*l, absl::StrCat("vllm-dp", d, "-tp", c.tp - 1), o);
        REQUIRE(b != nullptr);
        CHECK(b->shape == FindBuffer(*l, absl::StrCat("vllm-dp0-tp", c.tp - 1), o)->shape);
        CHECK(b->shape[1] * c.tp == l->tensors[l->tensor_index.at(o)].shape[1]);
      }
      PlanAndVerify(m, c.trainer, ip, 8, false);
    }
  }
}

// Mixtral in vLLM: MixtralMoE's FusedMoE stacks w1 (gate) and w3 (up) in
// block_sparse_moe.experts.w13_weight and w2 in w2_weight, flattened over dp * tp like any
// FusedMoE.
TEST_CASE("Mixtral: block_sparse_moe experts stacked as vLLM's w13 [w1; w3] and w2") {
  const ModelConfig m = Small("mixtral-8x7b.json", 64, 2);
  REQUIRE(m.moe_intermediate_size == 224);
  for (const bool ep : {false, true}) {
    SECTION(ep ? "TP2 DP2 EP: experts whole" : "TP2 DP2: rows over 4 ranks") {
      const InferenceParallelism ip{2, 2, ep};
      auto l = MakeInferenceLayout(m, ip, {8, 0}, DType::kBF16);
      INFO(l.status().message());
      REQUIRE(l.ok());
      REQUIRE(ValidateLayout(*l, "destination").ok());
      const int64_t E = 8, H = m.hidden_size, i = ep ? 224 : 224 / 4, e_local = ep ? E / 4 : E;
      for (int64_t r = 0; r < 4; ++r) {
        const std::string w = absl::StrCat("vllm-dp", r / 2, "-tp", r % 2);
        const std::string lp = "model.layers.1.block_sparse_moe.";
        const Buffer* w13 = FindBuffer(*l, w, lp + "experts.w13_weight");
        const Buffer* w2 = FindBuffer(*l, w, lp + "experts.w2_weight");
        REQUIRE(w13 != nullptr);
        REQUIRE(w2 != nullptr);
        CHECK(w13->shape == Dims{e_local, 2 * i, H});
        CHECK(w2->shape == Dims{e_local, H, i});
        const int64_t e0 = ep ? r * 2 : 0, row0 = ep ? 0 : r * i;
        for (int64_t e : {e0, e0 + e_local - 1}) {
          const std::string p = absl::StrCat(lp, "experts.", e, ".");
          CheckSlice(*l, w13, p + "w1.weight", 0, row0, i, Dims{e - e0, 0, 0});
          CheckSlice(*l, w13, p + "w3.weight", 0, row0, i, Dims{e - e0, i, 0});
          CheckSlice(*l, w2, p + "w2.weight", 1, row0, i, Dims{e - e0, 0, 0});
        }
        const Buffer* gate = FindBuffer(*l, w, lp + "gate.weight");
        REQUIRE(gate != nullptr);
        CHECK(gate->shape == Dims{E, H});
        CHECK(FindBuffer(*l, w, "model.layers.1.self_attn.qkv_proj.weight") != nullptr);
      }
      PlanAndVerify(m, {2, 1, 2, 2, 1, 0}, ip, 8, false);
    }
  }
}

// Every family from every trainer kind (Megatron TP x EP, FSDP1, FSDP2) into vLLM with and without
// expert parallelism: planned and verified byte for byte.
TEST_CASE("DeepSeek-V2/V3, Kimi-K2, Mixtral: Megatron, FSDP1 and FSDP2 trainers to vLLM engines") {
  struct Family {
    const char* config;
    int64_t factor, layers;
  };
  for (const Family& f : {Family{"deepseek-v2-lite.json", 16, 3}, Family{"deepseek-v2.json", 64, 2},
                          Family{"deepseek-v3-fp8.json", 64, 4}, Family{"kimi-k2.json", 64, 2},
                          Family{"mixtral-8x7b.json", 64, 2}}) {
    SECTION(f.config) {
      const ModelConfig m = Small(f.config, f.factor, f.layers);
      TrainerParallelism fsdp1, fsdp2;
      fsdp1.fsdp = 4;
      fsdp2.fsdp2 = 4;
      PlanAndVerify(m, {2, 1, 2, 2, 1, 0}, {2, 1, false}, 8, false);
      PlanAndVerify(m, fsdp1, {2, 2, true}, 8, true);
      PlanAndVerify(m, fsdp2, {2, 2, false}, 8, true);
    }
  }
}

// DeepSeek's gate.e_score_correction_bias: fp32 in vLLM (DeepseekV2MoE's nn.Parameter(torch.empty(
// n, dtype=torch.float32))) and Megatron (TopKRouter's expert_bias), in the weights' dtype under
// FSDP on transformers 4.x (buffer) or DeepSeek's remote code (parameter). Every other tensor in
// the weights' dtype; the pair still plans, casting on the way.
TEST_CASE("the router bias's dtype is the framework's") {
  enum Side { kVllm, kMegatron, kFsdp1, kFsdp2 };
  struct Case {
    const char* name;
    const char* config;
    Side side;
    DType weights, bias;
  };
  const std::vector<Case> cases = {
      {"vLLM DeepSeek-V3 bf16", "deepseek-v3.json", kVllm, DType::kBF16, DType::kF32},
      {"vLLM DeepSeek-V3 fp16", "deepseek-v3.json", kVllm, DType::kF16, DType::kF32},
      {"vLLM DeepSeek-V3 fp32", "deepseek-v3.json", kVllm, DType::kF32, DType::kF32},
      {"vLLM Kimi-K2 bf16", "kimi-k2.json", kVllm, DType::kBF16, DType::kF32},
      {"Megatron DeepSeek-V3 bf16", "deepseek-v3.json", kMegatron, DType::kBF16, DType::kF32},
      {"Megatron Kimi-K2 bf16", "kimi-k2.json", kMegatron, DType::kBF16, DType::kF32},
      {"FSDP1 DeepSeek-V3 bf16 (transformers 4.x buffer)", "deepseek-v3.json", kFsdp1, DType::kBF16,
       DType::kBF16},
      {"FSDP1 Kimi-K2 bf16 (remote-code parameter, flattened)", "kimi-k2.json", kFsdp1,
       DType::kBF16, DType::kBF16},
      {"FSDP2 DeepSeek-V3 bf16", "deepseek-v3.json", kFsdp2, DType::kBF16, DType::kBF16},
      {"FSDP2 Kimi-K2 fp32", "kimi-k2.json", kFsdp2, DType::kF32, DType::kF32},
  };
  for (const Case& c : cases) {
    SECTION(c.name) {
      const ModelConfig m = Small(c.config, 64, 4);
      TrainerParallelism tp;
      if (c.side == kMegatron) tp = {2, 1, 2, 2, 1, 0};
      if (c.side == kFsdp1) tp.fsdp = 4;
      if (c.side == kFsdp2) tp.fsdp2 = 4;
      auto l = c.side == kVllm ? MakeInferenceLayout(m, {2, 2, false}, {8, 0}, c.weights)
                               : MakeTrainerLayout(m, tp, {8, 0}, c.weights);
      INFO(l.status().message());
      REQUIRE(l.ok());
      REQUIRE(ValidateLayout(*l, "layout").ok());
      int biases = 0;
      for (const LogicalTensor& t : l->tensors) {
        const bool bias = t.name.find("e_score_correction_bias") != std::string::npos;
        INFO(t.name);
        CHECK(t.dtype == (bias ? c.bias : c.weights));
        biases += bias;
      }
      CHECK(biases == m.num_hidden_layers - m.first_k_dense_replace);
      for (const Piece& p : l->pieces) {  // a buffer's dtype is its tensors'
        CHECK(l->buffers[p.buffer].dtype == l->tensors[p.tensor].dtype);
      }
      if (c.side != kVllm) {  // the pair plans and verifies, fp32 to fp32 or cast bf16 to fp32
        PlanAndVerify(m, tp, {2, 2, false}, 8, false, c.weights);
      }
    }
  }
}

}  // namespace
}  // namespace refit
