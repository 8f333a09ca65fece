// FSDP1 and FSDP2 trainer layouts against what PyTorch and transformers do, and the settings no
// framework runs, refused with the reason.
//
// The expected parameter orders below are written out by hand from transformers 4.x's modeling
// files (module registration order: modeling_llama.py, modeling_qwen2.py, modeling_qwen3.py,
// modeling_qwen2_moe.py, modeling_qwen3_moe.py, modeling_deepseek_v3.py; DeepSeek's remote
// modeling_deepseek.py for Kimi-K2); the offsets, paddings and shard sizes from
// torch/distributed/fsdp/_flat_param.py and _fully_shard/_fsdp_param.py.
#include <catch2/catch.hpp>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/models/layout_generator.h"
#include "client/models/model_tensors.h"
#include "plan/planner.h"
#include "plan/validate.h"
#include "plan/verify.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

ModelConfig Parse(const std::string& json) {
  auto c = ParseModelConfig(json);
  INFO(json);
  INFO(c.status().message());
  REQUIRE(c.ok());
  return *c;
}

ModelConfig Real(const std::string& name, int64_t factor, int64_t layers) {
  auto text = ReadFile("tests/configs/" + name);
  REQUIRE(text.ok());
  return ScaleDown(Parse(*text), factor, layers);
}

// Tiny configs, two layers each, one per model type.
const char* kLlama = R"({"model_type": "llama", "hidden_size": 6, "num_attention_heads": 2,
  "head_dim": 3, "num_key_value_heads": 1, "intermediate_size": 5, "num_hidden_layers": 2,
  "vocab_size": 7})";
const char* kQwen2Tied = R"({"model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2,
  "num_key_value_heads": 1, "intermediate_size": 4, "num_hidden_layers": 2, "vocab_size": 10,
  "tie_word_embeddings": true})";
const char* kQwen3 = R"({"model_type": "qwen3", "hidden_size": 8, "num_attention_heads": 2,
  "head_dim": 4, "num_key_value_heads": 1, "intermediate_size": 4, "num_hidden_layers": 2,
  "vocab_size": 10, "attention_bias": false})";
const char* kQwen3Moe = R"({"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 2,
  "head_dim": 4, "num_key_value_heads": 1, "intermediate_size": 4, "num_hidden_layers": 2,
  "vocab_size": 10, "num_experts": 2, "moe_intermediate_size": 2, "decoder_sparse_step": 1,
  "mlp_only_layers": [0]})";
const char* kQwen2Moe = R"({"model_type": "qwen2_moe", "hidden_size": 8, "num_attention_heads": 2,
  "num_key_value_heads": 2, "intermediate_size": 4, "num_hidden_layers": 2, "vocab_size": 10,
  "num_experts": 2, "moe_intermediate_size": 2, "shared_expert_intermediate_size": 4,
  "mlp_only_layers": [0]})";
const char* kDeepSeek = R"({"model_type": "deepseek_v3", "hidden_size": 8,
  "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 4,
  "num_hidden_layers": 2, "vocab_size": 10, "q_lora_rank": 4, "kv_lora_rank": 4,
  "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2, "n_routed_experts": 2,
  "moe_intermediate_size": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
  "moe_layer_freq": 1, "topk_method": "noaux_tc"})";

std::string Kimi() {
  std::string s = kDeepSeek;
  s.replace(s.find("deepseek_v3"), 11, "kimi_k2");
  return s;
}

std::vector<std::string> Prefixed(const std::string& prefix, std::vector<std::string> names) {
  for (std::string& n : names) n = prefix + n;
  return names;
}

const std::vector<std::string> kAttention = {"self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight", "self_attn.o_proj.weight"};
const std::vector<std::string> kAttentionBias = {"self_attn.q_proj.weight", "self_attn.q_proj.bias",
                                                 "self_attn.k_proj.weight", "self_attn.k_proj.bias",
                                                 "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                                                 "self_attn.o_proj.weight"};
const std::vector<std::string> kQwen3Attention = {
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"};
const std::vector<std::string> kLatentAttention = {
    "self_attn.q_a_proj.weight",       "self_attn.q_a_layernorm.weight",
    "self_attn.q_b_proj.weight",       "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight"};
const std::vector<std::string> kMlp = {"mlp.gate_proj.weight", "mlp.up_proj.weight",
                                       "mlp.down_proj.weight"};
const std::vector<std::string> kNorms = {"input_layernorm.weight",
                                         "post_attention_layernorm.weight"};

std::vector<std::string> Concat(std::initializer_list<std::vector<std::string>> parts) {
  std::vector<std::string> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

std::vector<std::string> Experts(const std::string& group, int n) {
  std::vector<std::string> out;
  for (int e = 0; e < n; ++e) {
    for (const char* w : {"gate_proj", "up_proj", "down_proj"}) {
      out.push_back(absl::StrCat(group, ".", e, ".", w, ".weight"));
    }
  }
  return out;
}

// The tensors of one buffer of one worker, in piece order, each once (an FSDP1 shard holds up
// to three pieces of a tensor, consecutively).
std::vector<std::string> TensorsOf(const Layout& l, const std::string& worker,
                                   const std::string& buffer) {
  std::vector<std::string> out;
  for (const Piece& p : l.pieces) {
    const Buffer& b = l.buffers[p.buffer];
    if (b.name != buffer || l.workers[b.worker].name != worker) continue;
    const std::string& t = l.tensors[p.tensor].name;
    if (out.empty() || out.back() != t) out.push_back(t);
  }
  return out;
}

std::vector<std::string> BufferNames(const Layout& l, const std::string& worker) {
  std::vector<std::string> out;
  for (const Buffer& b : l.buffers) {
    if (l.workers[b.worker].name == worker) out.push_back(b.name);
  }
  return out;
}

const Buffer* FindBuffer(const Layout& l, const std::string& worker, const std::string& buffer) {
  for (const Buffer& b : l.buffers) {
    if (b.name == buffer && l.workers[b.worker].name == worker) return &b;
  }
  return nullptr;
}

TrainerParallelism Fsdp1(int32_t n, int32_t dp = 1, bool orig = false) {
  TrainerParallelism p;
  p.fsdp = n;
  p.dp = dp;
  p.fsdp_use_orig_params = orig;
  return p;
}

TrainerParallelism Fsdp2(int32_t n, int32_t dp = 1) {
  TrainerParallelism p;
  p.fsdp2 = n;
  p.dp = dp;
  return p;
}

Layout Trainer(const ModelConfig& m, const TrainerParallelism& p, DType dtype = DType::kBF16,
               int gpus_per_node = 8) {
  auto l = MakeTrainerLayout(m, p, {gpus_per_node, 0}, dtype);
  INFO(l.status().message());
  REQUIRE(l.ok());
  auto v = ValidateLayout(*l, "source");
  INFO(v.message());
  REQUIRE(v.ok());
  return *std::move(l);
}

// Plans trainer -> engine and verifies every destination byte on the host.
void PlanAndVerify(Layout src, const ModelConfig& m, const InferenceParallelism& ip,
                   int gpus_per_node = 8) {
  REQUIRE(ValidateLayout(src, "source").ok());
  const int32_t trainer_nodes =
      (static_cast<int32_t>(src.workers.size()) + gpus_per_node - 1) / gpus_per_node;
  auto dst = MakeInferenceLayout(m, ip, {gpus_per_node, trainer_nodes}, DType::kBF16);
  INFO(dst.status().message());
  REQUIRE(dst.ok());
  auto dv = ValidateLayout(*dst, "destination");
  INFO(dv.message());
  REQUIRE(dv.ok());
  PlanOptions options;
  options.topology.gpus_per_node = gpus_per_node;
  options.topology.nics_per_node = gpus_per_node;
  options.max_message_bytes = 1 << 20;
  auto plan = MakePlan(src, *dst, options);
  INFO(plan.status().message());
  REQUIRE(plan.ok());
  auto verified = VerifyOnHost(*plan, src, *dst, 11, int64_t{2} << 30);
  INFO(verified.status().message());
  REQUIRE(verified.ok());
  int64_t needed = 0;
  for (const Piece& p : dst->pieces) needed += dst->tensor_box(p).NumElements();
  CHECK(verified->elements_checked == needed);
}

// ---------------------------------------------------------------------------------------------
// FSDP1: the FlatParameter of each unit, in named_parameters() order.

struct OrderCase {
  const char* name;
  std::string config;
  std::vector<std::string> root;    // flat_param (the root unit)
  std::vector<std::string> layer1;  // flat_param.model.layers.1
  std::vector<std::string> layer1_module_buffers;
  InferenceParallelism engine{2, 1, false};
};

TEST_CASE("FSDP1 flattens each unit's parameters in Hugging Face registration order") {
  const std::string l1 = "model.layers.1.";
  const std::vector<std::string> root = {"model.embed_tokens.weight", "model.norm.weight",
                                         "lm_head.weight"};
  const std::vector<OrderCase> cases = {
      {"llama", kLlama, root, Prefixed(l1, Concat({kAttention, kMlp, kNorms})), {}, {1, 2, false}},
      // Tied: lm_head.weight is model.embed_tokens.weight, yielded once.
      {"qwen2 (q/k/v biases, tied embeddings)",
       kQwen2Tied,
       {"model.embed_tokens.weight", "model.norm.weight"},
       Prefixed(l1, Concat({kAttentionBias, kMlp, kNorms})),
       {}},
      {"qwen3 (q_norm, k_norm after o_proj)",
       kQwen3,
       root,
       Prefixed(l1, Concat({kQwen3Attention, kMlp, kNorms})),
       {}},
      // Qwen3MoeSparseMoeBlock: gate, then experts.
      {"qwen3_moe",
       kQwen3Moe,
       root,
       Prefixed(l1,
                Concat({kQwen3Attention, {"mlp.gate.weight"}, Experts("mlp.experts", 2), kNorms})),
       {}},
      // Qwen2MoeSparseMoeBlock: gate, experts, shared_expert, shared_expert_gate.
      {"qwen2_moe",
       kQwen2Moe,
       root,
       Prefixed(l1,
                Concat({kAttentionBias,
                        {"mlp.gate.weight"},
                        Experts("mlp.experts", 2),
                        {"mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                         "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"},
                        kNorms})),
       {}},
      // DeepseekV3MoE: experts, gate (its e_score_correction_bias a registered buffer), shared.
      {"deepseek_v3",
       kDeepSeek,
       root,
       Prefixed(l1,
                Concat({kLatentAttention,
                        Experts("mlp.experts", 2),
                        {"mlp.gate.weight"},
                        {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
                         "mlp.shared_experts.down_proj.weight"},
                        kNorms})),
       {"model.layers.1.mlp.gate.e_score_correction_bias"}},
      // Kimi-K2 runs DeepSeek's remote code, whose MoEGate makes the bias an nn.Parameter.
      {"kimi_k2",
       Kimi(),
       root,
       Prefixed(l1,
                Concat({kLatentAttention,
                        Experts("mlp.experts", 2),
                        {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"},
                        {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
                         "mlp.shared_experts.down_proj.weight"},
                        kNorms})),
       {}},
  };
  for (const OrderCase& c : cases) {
    SECTION(c.name) {
      const ModelConfig m = Parse(c.config);
      const Layout l = Trainer(m, Fsdp1(1));
      CHECK(TensorsOf(l, "fsdp-rank0", "flat_param") == c.root);
      CHECK(TensorsOf(l, "fsdp-rank0", "flat_param.model.layers.1") == c.layer1);
      // Buffers: the root's flat parameter, then each layer's, each followed by its unit's module
      // buffers.
      std::vector<std::string> buffers = {"flat_param", "flat_param.model.layers.0",
                                          "flat_param.model.layers.1"};
      buffers.insert(buffers.end(), c.layer1_module_buffers.begin(), c.layer1_module_buffers.end());
      CHECK(BufferNames(l, "fsdp-rank0") == buffers);
      // Concatenated without gaps (use_orig_params=False): the buffer holds exactly the unit.
      const Buffer* b = FindBuffer(l, "fsdp-rank0", "flat_param.model.layers.1");
      REQUIRE(b != nullptr);
      int64_t numel = 0;
      for (const TensorDef& t : ModelTensors(m)) {
        if (t.layer == 1 && !t.buffer) numel += t.shape.NumElements();
      }
      CHECK(b->shape == Dims{numel});
      // And every model type moves, byte-exact, to a vLLM engine.
      PlanAndVerify(Trainer(m, Fsdp1(3)), m, c.engine);
      PlanAndVerify(Trainer(m, Fsdp1(3, 1, true)), m, {1, 2, false});
    }
  }
}

// Where each tensor of `buffer` starts in the unsharded flat parameter (shard s * shard size +
// offset in the shard of the tensor's element 0), from an N-rank layout.
std::map<std::string, int64_t> FlatStarts(const Layout& l, const std::string& buffer, int world) {
  std::map<std::string, int64_t> out;
  for (int r = 0; r < world; ++r) {
    const std::string worker = absl::StrCat("fsdp-rank", r);
    const Buffer* b = FindBuffer(l, worker, buffer);
    REQUIRE(b != nullptr);
    for (const Piece& p : l.pieces) {
      if (&l.buffers[p.buffer] != b) continue;
      const LogicalTensor& t = l.tensors[p.tensor];
      const int64_t linear = LinearIndex(l.tensor_box(p).origin_dims(), t.shape);
      const int64_t flat = r * b->shape[0] + l.buffer_box(p).origin[0];
      if (linear == 0) out[t.name] = flat;
      CHECK(flat - linear == out[t.name]);  // the tensor is contiguous in the flat parameter
    }
  }
  return out;
}

TEST_CASE("FSDP1 padding: at the end only, or aligned per parameter with use_orig_params") {
  const ModelConfig m = Parse(kLlama);  // H 6, 2 heads of 3, 1 kv head, inter 5, vocab 7
  const std::string p = "model.layers.0.";
  struct Case {
    const char* name;
    TrainerParallelism parallel;
    DType dtype;
    int64_t layer_shard, root_shard;
    std::map<std::string, int64_t> layer_starts, root_starts;
  };
  TrainerParallelism orig_bf16_params = Fsdp1(4, 1, true);
  orig_bf16_params.fsdp_param_dtype = DType::kBF16;
  // numels: q 36, k 18, v 18, o 36, gate 30, up 30, down 30, norms 6 + 6 (210); embed 42,
  // norm 6, lm_head 42 (90).
  const std::vector<Case> cases = {
      {"use_orig_params=False: concatenated, right-padded to 4 * ceil(numel / 4)",
       Fsdp1(4),
       DType::kBF16,
       53,
       23,
       {{p + "self_attn.q_proj.weight", 0},
        {p + "self_attn.k_proj.weight", 36},
        {p + "self_attn.v_proj.weight", 54},
        {p + "self_attn.o_proj.weight", 72},
        {p + "mlp.gate_proj.weight", 108},
        {p + "mlp.up_proj.weight", 138},
        {p + "mlp.down_proj.weight", 168},
        {p + "input_layernorm.weight", 198},
        {p + "post_attention_layernorm.weight", 204}},
       {{"model.embed_tokens.weight", 0}, {"model.norm.weight", 42}, {"lm_head.weight", 48}}},
      // bf16: 16 bytes = 8 elements; 238 -> 240 for 4 ranks.
      {"use_orig_params=True, bf16: each parameter at a multiple of 8",
       Fsdp1(4, 1, true),
       DType::kBF16,
       60,
       25,
       {{p + "self_attn.q_proj.weight", 0},
        {p + "self_attn.k_proj.weight", 40},
        {p + "self_attn.v_proj.weight", 64},
        {p + "self_attn.o_proj.weight", 88},
        {p + "mlp.gate_proj.weight", 128},
        {p + "mlp.up_proj.weight", 160},
        {p + "mlp.down_proj.weight", 192},
        {p + "input_layernorm.weight", 224},
        {p + "post_attention_layernorm.weight", 232}},
       {{"model.embed_tokens.weight", 0}, {"model.norm.weight", 48}, {"lm_head.weight", 56}}},
      // fp32 without mixed precision: 4 elements; 222 -> 224.
      {"use_orig_params=True, fp32: each parameter at a multiple of 4",
       Fsdp1(4, 1, true),
       DType::kF32,
       56,
       24,
       {{p + "self_attn.q_proj.weight", 0},
        {p + "self_attn.k_proj.weight", 36},
        {p + "self_attn.v_proj.weight", 56},
        {p + "self_attn.o_proj.weight", 76},
        {p + "mlp.gate_proj.weight", 112},
        {p + "mlp.up_proj.weight", 144},
        {p + "mlp.down_proj.weight", 176},
        {p + "input_layernorm.weight", 208},
        {p + "post_attention_layernorm.weight", 216}},
       {{"model.embed_tokens.weight", 0}, {"model.norm.weight", 44}, {"lm_head.weight", 52}}},
      // fp32 weights, MixedPrecision(param_dtype=bf16): the forward dtype aligns, as in bf16.
      {"use_orig_params=True, fp32 with bf16 mixed precision: aligned as bf16",
       orig_bf16_params,
       DType::kF32,
       60,
       25,
       {{p + "self_attn.q_proj.weight", 0},
        {p + "self_attn.k_proj.weight", 40},
        {p + "self_attn.v_proj.weight", 64},
        {p + "self_attn.o_proj.weight", 88},
        {p + "mlp.gate_proj.weight", 128},
        {p + "mlp.up_proj.weight", 160},
        {p + "mlp.down_proj.weight", 192},
        {p + "input_layernorm.weight", 224},
        {p + "post_attention_layernorm.weight", 232}},
       {{"model.embed_tokens.weight", 0}, {"model.norm.weight", 48}, {"lm_head.weight", 56}}},
  };
  for (const Case& c : cases) {
    SECTION(c.name) {
      const Layout l = Trainer(m, c.parallel, c.dtype);
      for (int r = 0; r < 4; ++r) {
        const std::string w = absl::StrCat("fsdp-rank", r);
        REQUIRE(FindBuffer(l, w, "flat_param.model.layers.0") != nullptr);
        CHECK(FindBuffer(l, w, "flat_param.model.layers.0")->shape == Dims{c.layer_shard});
        CHECK(FindBuffer(l, w, "flat_param")->shape == Dims{c.root_shard});
      }
      CHECK(FlatStarts(l, "flat_param.model.layers.0", 4) == c.layer_starts);
      CHECK(FlatStarts(l, "flat_param", 4) == c.root_starts);
    }
  }
}

TEST_CASE("FSDP1 on real models: shards start mid-tensor; HSDP replicas; all planned byte-exact") {
  struct Case {
    const char* name;
    ModelConfig model;
    TrainerParallelism trainer;
    InferenceParallelism engine;
  };
  const std::vector<Case> cases = {
      {"Llama-3-8B FSDP8 -> TP4", Real("llama3-8b.json", 32, 2), Fsdp1(8), {4, 1, false}},
      {"Llama-3-8B HSDP 4 x 2 use_orig_params -> TP2 DP2",
       Real("llama3-8b.json", 32, 2),
       Fsdp1(4, 2, true),
       {2, 2, false}},
      {"Qwen2.5-7B FSDP6 -> TP4", Real("qwen2.5-7b.json", 28, 2), Fsdp1(6), {4, 1, false}},
      {"Qwen3-30B-A3B FSDP4 -> TP2 and EP",
       Real("qwen3-30b-a3b.json", 16, 2),
       Fsdp1(4),
       {2, 2, true}},
      {"DeepSeek-V3 FSDP8 -> TP8", Real("deepseek-v3.json", 64, 4), Fsdp1(8), {8, 1, false}},
      {"Kimi-K2 FSDP4 -> TP4", Real("kimi-k2.json", 64, 2), Fsdp1(4, 1, true), {4, 1, false}},
  };
  for (const Case& c : cases) {
    SECTION(c.name) {
      const Layout l = Trainer(c.model, c.trainer);
      CHECK(static_cast<int32_t>(l.workers.size()) == c.trainer.World());
      for (int32_t r = 0; r < c.trainer.World(); ++r) {
        CHECK(l.workers[r].name == absl::StrCat("fsdp-rank", r));
        CHECK(l.workers[r].node == r / 8);
        CHECK(l.workers[r].gpu == r % 8);
      }
      PlanAndVerify(l, c.model, c.engine);
    }
  }
}

TEST_CASE("FSDP1 HSDP: replica d's shard s is rank d * N + s and equals replica 0's") {
  const ModelConfig m = Parse(kLlama);
  const Layout hsdp = Trainer(m, Fsdp1(2, 3));
  const Layout one = Trainer(m, Fsdp1(2));
  REQUIRE(hsdp.workers.size() == 6);
  for (int r = 0; r < 6; ++r) {
    const std::string w = absl::StrCat("fsdp-rank", r), w0 = absl::StrCat("fsdp-rank", r % 2);
    for (const char* b : {"flat_param", "flat_param.model.layers.0", "flat_param.model.layers.1"}) {
      CHECK(TensorsOf(hsdp, w, b) == TensorsOf(one, w0, b));
      CHECK(FindBuffer(hsdp, w, b)->shape == FindBuffer(one, w0, b)->shape);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// FSDP2: each parameter its own buffer, torch.chunk on dim 0, empty shards absent.

// Rows of `tensor` that each rank holds (0 when it holds no buffer of it), from buffer shapes.
std::vector<int64_t> RowsPerRank(const Layout& l, const std::string& tensor, int world) {
  std::vector<int64_t> out;
  for (int r = 0; r < world; ++r) {
    const Buffer* b = FindBuffer(l, absl::StrCat("fsdp-rank", r), tensor);
    out.push_back(b == nullptr ? 0 : b->shape[0]);
  }
  return out;
}

TEST_CASE("FSDP2 shards every parameter on dim 0 as torch.chunk: uneven and empty shards") {
  // vocab 5: embed [5, 8]; one kv head of 3: k_proj [3, 8]; q_proj [6, 8]; norms [8].
  const ModelConfig m = Parse(R"({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2,
      "head_dim": 3, "num_key_value_heads": 1, "intermediate_size": 4, "num_hidden_layers": 2,
      "vocab_size": 5})");
  struct Case {
    std::string tensor;
    int world;
    std::vector<int64_t> rows;
  };
  const std::vector<Case> cases = {
      {"model.embed_tokens.weight", 4, {2, 2, 1, 0}},                           // chunk 2
      {"model.layers.0.self_attn.k_proj.weight", 8, {1, 1, 1, 0, 0, 0, 0, 0}},  // chunk 1
      {"model.layers.0.self_attn.q_proj.weight", 4, {2, 2, 2, 0}},  // 6 rows: chunk 2, not 2,2,1,1
      {"model.layers.1.mlp.down_proj.weight", 3, {3, 3, 2}},        // 8 rows: chunk 3
      {"model.norm.weight", 5, {2, 2, 2, 2, 0}},                    // 8 rows: chunk 2
      {"lm_head.weight", 1, {5}},
  };
  for (const Case& c : cases) {
    SECTION(absl::StrCat(c.tensor, " over ", c.world)) {
      const Layout l = Trainer(m, Fsdp2(c.world));
      CHECK(RowsPerRank(l, c.tensor, c.world) == c.rows);
      // Rank r's buffer is rows [r * chunk, ...) of the tensor, whole columns.
      const int64_t chunk = c.rows[0];
      for (int r = 0; r < c.world; ++r) {
        const std::string w = absl::StrCat("fsdp-rank", r);
        for (const Piece& p : l.pieces) {
          const Buffer& b = l.buffers[p.buffer];
          if (b.name != c.tensor || l.workers[b.worker].name != w) continue;
          CHECK(l.tensors[p.tensor].name == c.tensor);
          CHECK(l.tensor_box(p).origin[0] == r * chunk);
          CHECK(l.tensor_box(p).shape_dims() == b.shape);
        }
      }
      PlanAndVerify(l, m, {2, 1, false});
      PlanAndVerify(l, m, {1, 3, false});
    }
  }
}

TEST_CASE("FSDP2 ranks that hold nothing at all: still workers, validated and planned") {
  // No tensor has more than 3 rows: over 8 ranks, ranks 3..7 hold no buffer.
  const ModelConfig m = Parse(R"({"model_type": "llama", "hidden_size": 2, "num_attention_heads": 2,
      "head_dim": 1, "num_key_value_heads": 1, "intermediate_size": 2, "num_hidden_layers": 1,
      "vocab_size": 3})");
  const Layout l = Trainer(m, Fsdp2(8));
  REQUIRE(l.workers.size() == 8);
  for (int r = 0; r < 8; ++r) {
    CHECK(BufferNames(l, absl::StrCat("fsdp-rank", r)).empty() == (r >= 3));
  }
  CHECK(RowsPerRank(l, "model.embed_tokens.weight", 8) ==
        std::vector<int64_t>{1, 1, 1, 0, 0, 0, 0, 0});
  PlanAndVerify(l, m, {2, 1, false});
  PlanAndVerify(l, m, {1, 4, false});
}

TEST_CASE("FSDP2 buffers are the parameters, by name, in named_parameters() order") {
  const ModelConfig m = Parse(kDeepSeek);
  const Layout l = Trainer(m, Fsdp2(2));
  std::vector<std::string> expected;
  for (const TensorDef& t : ModelTensors(m)) expected.push_back(t.name);
  CHECK(BufferNames(l, "fsdp-rank0") == expected);
  // The router's e_score_correction_bias is a module buffer: whole on every rank.
  const Buffer* bias =
      FindBuffer(l, "fsdp-rank1", "model.layers.1.mlp.gate.e_score_correction_bias");
  REQUIRE(bias != nullptr);
  CHECK(bias->shape == Dims{2});
  // Kimi-K2's is a parameter, sharded like the others.
  const Layout kimi = Trainer(Parse(Kimi()), Fsdp2(2));
  CHECK(FindBuffer(kimi, "fsdp-rank1", "model.layers.1.mlp.gate.e_score_correction_bias")->shape ==
        Dims{1});
  // Tied embeddings: one parameter, model.embed_tokens.weight; no lm_head.
  const Layout tied = Trainer(Parse(kQwen2Tied), Fsdp2(2));
  CHECK(FindBuffer(tied, "fsdp-rank0", "model.embed_tokens.weight") != nullptr);
  CHECK(FindBuffer(tied, "fsdp-rank0", "lm_head.weight") == nullptr);
}

TEST_CASE("FSDP2 on real models, HSDP included, planned byte-exact; ranks with empty shards too") {
  struct Case {
    const char* name;
    ModelConfig model;
    TrainerParallelism trainer;
    InferenceParallelism engine;
    int gpus_per_node;
  };
  const std::vector<Case> cases = {
      {"Llama-3-8B FSDP2 x8 -> TP4", Real("llama3-8b.json", 32, 2), Fsdp2(8), {4, 1, false}, 8},
      // 8 kv heads * 4 = 32 rows of k_proj over 48 ranks: chunk 1, ranks 32.. empty.
      {"Llama-3-8B FSDP2 x48 -> TP8", Real("llama3-8b.json", 32, 1), Fsdp2(48), {8, 1, false}, 8},
      {"Qwen2.5-7B HSDP 3 x 2 -> TP2 DP2",
       Real("qwen2.5-7b.json", 28, 2),
       Fsdp2(3, 2),
       {2, 2, false},
       4},
      {"Qwen3-30B-A3B FSDP2 x6 -> EP",
       Real("qwen3-30b-a3b.json", 16, 2),
       Fsdp2(6),
       {2, 2, true},
       8},
      {"DeepSeek-V3 FSDP2 x16 -> TP8",
       Real("deepseek-v3.json", 64, 4),
       Fsdp2(16),
       {8, 1, false},
       8},
      {"Kimi-K2 HSDP 4 x 2 -> TP4", Real("kimi-k2.json", 64, 2), Fsdp2(4, 2), {4, 1, false}, 8},
  };
  for (const Case& c : cases) {
    SECTION(c.name) {
      const Layout l = Trainer(c.model, c.trainer, DType::kBF16, c.gpus_per_node);
      CHECK(static_cast<int32_t>(l.workers.size()) == c.trainer.World());
      PlanAndVerify(l, c.model, c.engine, c.gpus_per_node);
    }
  }
}

TEST_CASE("FSDP2 HSDP: rank = replica * N + shard, every replica the same shards") {
  const ModelConfig m = Parse(kLlama);
  const Layout hsdp = Trainer(m, Fsdp2(3, 2));
  const Layout one = Trainer(m, Fsdp2(3));
  REQUIRE(hsdp.workers.size() == 6);
  for (int r = 0; r < 6; ++r) {
    const std::string w = absl::StrCat("fsdp-rank", r), w0 = absl::StrCat("fsdp-rank", r % 3);
    CHECK(BufferNames(hsdp, w) == BufferNames(one, w0));
    for (const std::string& b : BufferNames(one, w0)) {
      CHECK(FindBuffer(hsdp, w, b)->shape == FindBuffer(one, w0, b)->shape);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// What no framework runs.

struct Refusal {
  const char* name;
  std::string config;
  std::string message;
  bool trainer;
  TrainerParallelism trainer_parallel;
  InferenceParallelism engine_parallel;
};

TrainerParallelism Megatron(int32_t tp, int32_t ep = 1, int32_t dp = 1) {
  TrainerParallelism p;
  p.tp = tp;
  p.ep = ep;
  p.dp = dp;
  return p;
}

TEST_CASE("parallelisms that Megatron or vLLM refuse are refused, naming the setting") {
  const std::string llama8b = *ReadFile("tests/configs/llama3-8b.json");       // 32 heads, 8 kv
  const std::string qwen3moe = *ReadFile("tests/configs/qwen3-30b-a3b.json");  // 128 experts
  // 12 heads, 4 kv heads, intermediate 12, 4 experts of 6.
  const std::string odd =
      R"({"model_type": "qwen3_moe", "hidden_size": 24, "num_attention_heads": 12,
      "head_dim": 2, "num_key_value_heads": 4, "intermediate_size": 12, "num_hidden_layers": 2,
      "vocab_size": 64, "num_experts": 4, "moe_intermediate_size": 6, "mlp_only_layers": [0]})";
  // 8 heads, 8 kv heads, intermediate 12, 4 experts of 8.
  const std::string few =
      R"({"model_type": "qwen3_moe", "hidden_size": 16, "num_attention_heads": 8,
      "head_dim": 2, "num_key_value_heads": 8, "intermediate_size": 12, "num_hidden_layers": 2,
      "vocab_size": 64, "num_experts": 4, "moe_intermediate_size": 8, "mlp_only_layers": [0]})";
  std::string wide = few;  // intermediate 16: only the experts' count stands in TP8's way
  wide.replace(wide.find("\"intermediate_size\": 12"), 23, "\"intermediate_size\": 16");
  const std::vector<Refusal> cases = {
      {"vLLM TP3 on 32 heads",
       llama8b,
       "vLLM needs tp (3) to divide num_attention_heads (32)",
       false,
       {},
       {3, 1, false}},
      {"vLLM TP6 on 4 kv heads",
       odd,
       "vLLM needs tp (6) and num_key_value_heads (4) to divide one another",
       false,
       {},
       {6, 1, false}},
      {"vLLM TP4 on moe_intermediate_size 6",
       odd,
       "vLLM needs tp (4) to divide moe_intermediate_size (6)",
       false,
       {},
       {4, 1, false}},
      // FusedMoE flattens tp over dp (FusedMoEParallelConfig.make): the experts' width over dp *
      // tp.
      {"vLLM TP2 DP2 on moe_intermediate_size 6",
       odd,
       "vLLM needs dp * tp (4) to divide moe_intermediate_size (6)",
       false,
       {},
       {2, 2, false}},
      {"vLLM TP1 DP4 on moe_intermediate_size 6",
       odd,
       "vLLM needs dp * tp (4) to divide moe_intermediate_size (6)",
       false,
       {},
       {1, 4, false}},
      {"vLLM TP4 DP4 on moe_intermediate_size 8",
       few,
       "vLLM needs dp * tp (16) to divide moe_intermediate_size (8)",
       false,
       {},
       {4, 4, false}},
      {"vLLM TP8 on intermediate_size 12",
       few,
       "vLLM needs tp (8) to divide intermediate_size (12)",
       false,
       {},
       {8, 1, false}},
      {"vLLM TP8 on 4 experts",
       wide,
       "vLLM refuses tp (8) greater than the number of experts (4)",
       false,
       {},
       {8, 1, false}},
      {"vLLM expert parallelism over more ranks than experts",
       odd,
       "expert parallelism over 8 ranks exceeds the number of experts (4)",
       false,
       {},
       {2, 4, true}},
      {"Megatron TP3 on 32 heads",
       llama8b,
       "Megatron needs tp (3) to divide num_attention_heads (32)",
       true,
       Megatron(3),
       {}},
      {"Megatron TP16 on 8 kv heads",
       llama8b,
       "Megatron needs tp (16) to divide num_key_value_heads (8)",
       true,
       Megatron(16),
       {}},
      {"Megatron TP8 on intermediate_size 12",
       few,
       "Megatron needs tp (8) to divide intermediate_size (12)",
       true,
       Megatron(8),
       {}},
      {"Megatron TP4 on moe_intermediate_size 6",
       odd,
       "Megatron needs tp (4) to divide moe_intermediate_size (6)",
       true,
       Megatron(4),
       {}},
      {"Megatron EP3 on 128 experts",
       qwen3moe,
       "Megatron needs ep (3) to divide the number of experts (128)",
       true,
       Megatron(1, 3, 3),
       {}},
  };
  for (const Refusal& c : cases) {
    SECTION(c.name) {
      const ModelConfig m = Parse(c.config);
      const absl::Status s =
          c.trainer ? MakeTrainerLayout(m, c.trainer_parallel, {8, 0}, DType::kBF16).status()
                    : MakeInferenceLayout(m, c.engine_parallel, {8, 0}, DType::kBF16).status();
      INFO(s.message());
      CHECK(absl::IsInvalidArgument(s));
      CHECK(std::string(s.message()).find(c.message) != std::string::npos);
    }
  }
}

TEST_CASE("the divisible neighbours of those refusals are accepted") {
  const ModelConfig llama = Real("llama3-8b.json", 32, 1);
  CHECK(
      MakeInferenceLayout(llama, {16, 1, false}, {8, 0}, DType::kBF16).ok());  // kv 8 replicated 2x
  CHECK(MakeInferenceLayout(llama, {4, 1, false}, {8, 0}, DType::kBF16).ok());
  const ModelConfig odd = Parse(R"({"model_type": "qwen3_moe", "hidden_size": 24,
      "num_attention_heads": 12, "head_dim": 2, "num_key_value_heads": 4, "intermediate_size": 12,
      "num_hidden_layers": 2, "vocab_size": 64, "num_experts": 4, "moe_intermediate_size": 6,
      "mlp_only_layers": [0]})");
  CHECK(MakeInferenceLayout(odd, {2, 1, false}, {8, 0}, DType::kBF16).ok());
  CHECK(MakeInferenceLayout(odd, {4, 1, true}, {8, 0}, DType::kBF16).ok());  // EP: experts unsplit
  CHECK(MakeTrainerLayout(odd, Megatron(2, 2, 2), {8, 0}, DType::kBF16).ok());
  // Experts over dp * tp: 6 rows over 2 * 3 ranks; with EP, 4 experts over 2 * 2 ranks, unsplit.
  CHECK(MakeInferenceLayout(odd, {2, 3, false}, {8, 0}, DType::kBF16).ok());
  CHECK(MakeInferenceLayout(odd, {2, 2, true}, {8, 0}, DType::kBF16).ok());
  // Only the replica's tp counts against the number of experts: TP4 DP2 on 4 experts runs.
  const ModelConfig few = Parse(R"({"model_type": "qwen3_moe", "hidden_size": 16,
      "num_attention_heads": 8, "head_dim": 2, "num_key_value_heads": 8, "intermediate_size": 12,
      "num_hidden_layers": 2, "vocab_size": 64, "num_experts": 4, "moe_intermediate_size": 8,
      "mlp_only_layers": [0]})");
  CHECK(MakeInferenceLayout(few, {4, 2, false}, {8, 0}, DType::kBF16).ok());
}

TEST_CASE("FSDP settings that make no sense are refused") {
  const ModelConfig m = Parse(kLlama);
  TrainerParallelism both = Fsdp1(2);
  both.fsdp2 = 2;
  CHECK(std::string(MakeTrainerLayout(m, both, {8, 0}, DType::kBF16).status().message())
            .find("not both") != std::string::npos);
  TrainerParallelism tp = Fsdp2(2);
  tp.tp = 2;
  CHECK(std::string(MakeTrainerLayout(m, tp, {8, 0}, DType::kBF16).status().message())
            .find("tp, pp, ep and cp must be 1") != std::string::npos);
  TrainerParallelism orig = Fsdp2(2);
  orig.fsdp_use_orig_params = true;
  CHECK(std::string(MakeTrainerLayout(m, orig, {8, 0}, DType::kBF16).status().message())
            .find("FSDP1 setting") != std::string::npos);
}

}  // namespace
}  // namespace refit
