// The architecture fields of a Hugging Face config.json that decide a model's tensors.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "plan/dtype.h"

namespace refit {

struct ModelConfig {
  std::string model_type;  // "llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", ...
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // default: num_attention_heads
  int64_t head_dim = 0;             // default: hidden_size / num_attention_heads
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v biases (Qwen2 has them without saying so)
  bool qk_norm = false;         // Qwen3: q_norm, k_norm per head
  DType dtype = DType::kBF16;   // torch_dtype

  // Mixture of experts (0 experts: dense).
  int64_t num_experts = 0;  // n_routed_experts (DeepSeek) or num_experts (Qwen)
  int64_t moe_intermediate_size = 0;
  int64_t n_shared_experts = 0;                 // DeepSeek: shared_experts of n x moe size
  int64_t shared_expert_intermediate_size = 0;  // Qwen2-MoE: one shared_expert + its gate
  int64_t first_k_dense_replace = 0;            // DeepSeek: the first k layers are dense
  int64_t moe_layer_freq = 1;
  bool router_bias = false;  // DeepSeek-V3: gate.e_score_correction_bias

  // Multi-head latent attention (DeepSeek-V2/V3): kv_lora_rank > 0.
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  bool IsMoeLayer(int64_t layer) const {
    return num_experts > 0 && layer >= first_k_dense_replace &&
           (moe_layer_freq <= 1 || layer % moe_layer_freq == 0);
  }
};

// Parses config.json. Missing required fields and inconsistent ones are INVALID_ARGUMENT naming
// the field.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json);

// Divides every width by `factor` (at least 1 remains; head counts and experts unchanged) and
// keeps at most `max_layers` layers (0: all): the same structure, small enough for a laptop.
ModelConfig ScaleDown(const ModelConfig& config, int64_t factor, int64_t max_layers);

// Parameters of the whole model (logical elements).
int64_t CountParameters(const ModelConfig& config);

}  // namespace refit
