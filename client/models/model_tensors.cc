#include "client/models/model_tensors.h"

#include <tuple>

#include "absl/strings/str_cat.h"

namespace refit {

namespace {

// The tensors of one model, appended in the order the module registers them.
class TensorList {
 public:
  explicit TensorList(const ModelConfig& config) : c_(config) {}

  // The new tensor, valid until the next one is added.
  TensorDef* Add(std::string name, Dims shape, Role role, int64_t layer, int64_t unit = 0) {
    TensorDef t;
    t.name = std::move(name);
    t.shape = shape;
    t.role = role;
    t.layer = layer;
    t.head_unit = unit;
    out_.push_back(t);
    return &out_.back();
  }

  // A gated MLP of width `inter`: dense (expert -1, not shared), a routed expert, or shared.
  void AddMlp(const std::string& prefix, int64_t inter, int64_t layer, int64_t expert,
              bool shared) {
    const int64_t H = c_.hidden_size;
    using Part = std::tuple<const char*, Role, Dims>;
    // MixtralBlockSparseTop2MLP registers w1 (gate), w2 (down), w3 (up).
    const std::vector<Part> parts =
        c_.MixtralStyle() && expert >= 0
            ? std::vector<Part>{{"w1", Role::kGate, Dims{inter, H}},
                                {"w2", Role::kDown, Dims{H, inter}},
                                {"w3", Role::kUp, Dims{inter, H}}}
            : std::vector<Part>{{"gate_proj", Role::kGate, Dims{inter, H}},
                                {"up_proj", Role::kUp, Dims{inter, H}},
                                {"down_proj", Role::kDown, Dims{H, inter}}};
    for (const auto& [name, role, shape] : parts) {
      TensorDef* t = Add(absl::StrCat(prefix, name, ".weight"), shape, role, layer);
      t->expert = expert;
      t->shared = shared;
    }
  }

  std::vector<TensorDef> Take() { return std::move(out_); }

 private:
  const ModelConfig& c_;
  std::vector<TensorDef> out_;
};

// Multi-head latent attention (modeling_deepseek_v3.py).
void AddLatentAttention(TensorList& out, const ModelConfig& c, const std::string& p, int64_t l) {
  const int64_t H = c.hidden_size;
  const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const int64_t heads = c.num_attention_heads;
  if (c.q_lora_rank > 0) {
    out.Add(p + "self_attn.q_a_proj.weight", Dims{c.q_lora_rank, H}, Role::kLatentQA, l);
    out.Add(p + "self_attn.q_a_layernorm.weight", Dims{c.q_lora_rank}, Role::kReplicated, l);
    out.Add(p + "self_attn.q_b_proj.weight", Dims{heads * qk, c.q_lora_rank}, Role::kLatentQB, l,
            qk);
  } else {
    out.Add(p + "self_attn.q_proj.weight", Dims{heads * qk, H}, Role::kLatentQB, l, qk);
  }
  out.Add(p + "self_attn.kv_a_proj_with_mqa.weight", Dims{c.kv_lora_rank + c.qk_rope_head_dim, H},
          Role::kLatentKVA, l);
  out.Add(p + "self_attn.kv_a_layernorm.weight", Dims{c.kv_lora_rank}, Role::kReplicated, l);
  out.Add(p + "self_attn.kv_b_proj.weight",
          Dims{heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, Role::kLatentKVB, l,
          c.qk_nope_head_dim + c.v_head_dim);
  out.Add(p + "self_attn.o_proj.weight", Dims{H, heads * c.v_head_dim}, Role::kO, l, c.v_head_dim);
}

// Multi-head attention with grouped key/value heads (modeling_llama.py, modeling_qwen2.py,
// modeling_qwen3.py).
void AddHeadAttention(TensorList& out, const ModelConfig& c, const std::string& p, int64_t l) {
  const int64_t H = c.hidden_size;
  const int64_t hd = c.head_dim, q = c.num_attention_heads * hd, kv = c.num_key_value_heads * hd;
  // Each nn.Linear registers its weight, then its bias.
  out.Add(p + "self_attn.q_proj.weight", Dims{q, H}, Role::kQ, l, hd);
  if (c.attention_bias) out.Add(p + "self_attn.q_proj.bias", Dims{q}, Role::kQ, l, hd);
  out.Add(p + "self_attn.k_proj.weight", Dims{kv, H}, Role::kK, l, hd);
  if (c.attention_bias) out.Add(p + "self_attn.k_proj.bias", Dims{kv}, Role::kK, l, hd);
  out.Add(p + "self_attn.v_proj.weight", Dims{kv, H}, Role::kV, l, hd);
  if (c.attention_bias) out.Add(p + "self_attn.v_proj.bias", Dims{kv}, Role::kV, l, hd);
  out.Add(p + "self_attn.o_proj.weight", Dims{H, q}, Role::kO, l, hd);
  if (c.qk_norm) {  // Qwen3 registers q_norm and k_norm after o_proj
    out.Add(p + "self_attn.q_norm.weight", Dims{hd}, Role::kReplicated, l);
    out.Add(p + "self_attn.k_norm.weight", Dims{hd}, Role::kReplicated, l);
  }
}

void AddRouter(TensorList& out, const ModelConfig& c, const std::string& moe, int64_t l) {
  out.Add(moe + "gate.weight", Dims{c.num_experts, c.hidden_size}, Role::kReplicated, l);
  if (c.router_bias) {
    TensorDef* bias =
        out.Add(moe + "gate.e_score_correction_bias", Dims{c.num_experts}, Role::kReplicated, l);
    bias->buffer = c.router_bias_is_buffer;
    bias->router_bias = true;
  }
}

void AddRoutedExperts(TensorList& out, const ModelConfig& c, const std::string& moe, int64_t l) {
  for (int64_t e = 0; e < c.num_experts; ++e) {
    out.AddMlp(absl::StrCat(moe, "experts.", e, "."), c.moe_intermediate_size, l, e, false);
  }
}

// A mixture-of-experts layer's MLP: router, routed experts, shared experts.
void AddMoe(TensorList& out, const ModelConfig& c, const std::string& p, int64_t l) {
  const std::string moe = p + (c.MixtralStyle() ? "block_sparse_moe." : "mlp.");
  if (c.DeepSeekStyle()) {  // DeepseekV2Moe / DeepseekV3MoE: experts, gate, shared_experts
    AddRoutedExperts(out, c, moe, l);
    AddRouter(out, c, moe, l);
  } else {  // Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock: gate, experts
    AddRouter(out, c, moe, l);
    AddRoutedExperts(out, c, moe, l);
  }
  if (c.n_shared_experts > 0) {
    out.AddMlp(p + "mlp.shared_experts.", c.n_shared_experts * c.moe_intermediate_size, l, -1,
               true);
  }
  if (c.shared_expert_intermediate_size > 0) {
    out.AddMlp(p + "mlp.shared_expert.", c.shared_expert_intermediate_size, l, -1, true);
    out.Add(p + "mlp.shared_expert_gate.weight", Dims{1, c.hidden_size}, Role::kReplicated, l);
  }
}

void AddDecoderLayer(TensorList& out, const ModelConfig& c, int64_t l) {
  const std::string p = absl::StrCat("model.layers.", l, ".");
  if (c.kv_lora_rank > 0) {
    AddLatentAttention(out, c, p, l);
  } else {
    AddHeadAttention(out, c, p, l);
  }
  if (c.IsMoeLayer(l)) {
    AddMoe(out, c, p, l);
  } else {
    out.AddMlp(p + "mlp.", c.intermediate_size, l, -1, false);
  }
  out.Add(p + "input_layernorm.weight", Dims{c.hidden_size}, Role::kReplicated, l);
  out.Add(p + "post_attention_layernorm.weight", Dims{c.hidden_size}, Role::kReplicated, l);
}

}  // namespace

std::vector<TensorDef> ModelTensors(const ModelConfig& c) {
  const int64_t H = c.hidden_size, L = c.num_hidden_layers;
  TensorList out(c);
  out.Add("model.embed_tokens.weight", Dims{c.vocab_size, H}, Role::kEmbedding, -1);
  for (int64_t l = 0; l < L; ++l) AddDecoderLayer(out, c, l);
  out.Add("model.norm.weight", Dims{H}, Role::kReplicated, L);
  if (!c.tie_word_embeddings) out.Add("lm_head.weight", Dims{c.vocab_size, H}, Role::kLmHead, L);
  return out.Take();
}

int64_t CountParameters(const ModelConfig& config) {
  int64_t n = 0;
  for (const TensorDef& t : ModelTensors(config)) n += t.shape.NumElements();
  return n;
}

}  // namespace refit
