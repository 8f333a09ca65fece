// The architecture fields of a Hugging Face config.json that decide a model's tensors.
//
// Only the model types whose tensors (names, shapes, and the order Hugging Face registers them in)
// client/models/model_tensors.cc reproduces exactly are accepted; ParseModelConfig refuses the
// others by name rather than guess. The modules followed are transformers 4.x's (through 4.57),
// whose mixture of experts layers hold one nn.Module per expert, as the checkpoints name them
// (transformers 5 fuses each layer's experts into two 3-D parameters: see docs/LAYOUTS.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "plan/dtype.h"

namespace refit {

// The model_type values ParseModelConfig accepts, comma-separated, for error messages.
inline constexpr const char* kSupportedModelTypes =
    "llama, qwen2, qwen2_moe, qwen3, qwen3_moe, deepseek_v2, deepseek_v3, kimi_k2, mixtral";

struct ModelConfig {
  std::string model_type;  // one of kSupportedModelTypes
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // default: num_attention_heads
  int64_t head_dim = 0;             // default: hidden_size / num_attention_heads
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v biases: Qwen2 and Qwen2-MoE only, which always have them
  bool qk_norm = false;         // Qwen3: q_norm, k_norm per head
  DType dtype = DType::kBF16;   // torch_dtype
  // quantization_config of an fp8 checkpoint (quant_method "fp8", DeepSeek-V3 and vLLM's block
  // fp8): weight_block_size and modules_to_not_convert (also read as "ignored_layers"). Engines
  // load such a model in fp8; refit-layout --dtype fp8-block follows it
  // (client/models/fp8_layout.h).
  struct Fp8Quantization {
    bool present = false;
    int64_t block_rows = 128, block_cols = 128;
    std::vector<std::string> modules_to_not_convert;
  } fp8;

  // Mixture of experts (0 experts: dense).
  int64_t num_experts =
      0;  // n_routed_experts (DeepSeek), num_experts (Qwen), num_local_experts (Mixtral)
  int64_t moe_intermediate_size = 0;  // Mixtral: its intermediate_size (every layer is MoE)
  int64_t n_shared_experts = 0;       // DeepSeek: shared_experts of n x moe size
  int64_t shared_expert_intermediate_size = 0;  // Qwen2-MoE: one shared_expert + its gate
  int64_t first_k_dense_replace = 0;            // DeepSeek: the first k layers are dense
  int64_t moe_layer_freq = 1;
  int64_t decoder_sparse_step = 1;       // Qwen-MoE: layer l is sparse iff (l + 1) % step == 0
  std::vector<int64_t> mlp_only_layers;  // Qwen-MoE: these layers are dense
  bool router_bias = false;  // DeepSeek-V3 (topk_method noaux_tc): gate.e_score_correction_bias
  // Whether gate.e_score_correction_bias is a module buffer (transformers' DeepseekV3TopkRouter
  // registers it so) rather than a parameter (DeepSeek's remote modeling_deepseek.py, which
  // Kimi-K2 runs, makes it an nn.Parameter). FSDP flattens and shards parameters only.
  bool router_bias_is_buffer = false;

  // Multi-head latent attention (DeepSeek-V2/V3): kv_lora_rank > 0.
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  bool IsMoeLayer(int64_t layer) const {
    if (num_experts == 0 || layer < first_k_dense_replace) return false;
    if (moe_layer_freq > 1 && layer % moe_layer_freq != 0) return false;
    if (decoder_sparse_step > 1 && (layer + 1) % decoder_sparse_step != 0) return false;
    for (int64_t l : mlp_only_layers) {
      if (l == layer) return false;
    }
    return true;
  }
  // DeepSeek's MoE block registers experts, then the router, then the shared experts; Qwen's
  // and Mixtral's register the router first.
  bool DeepSeekStyle() const {
    return model_type == "deepseek_v2" || model_type == "deepseek_v3" || model_type == "kimi_k2";
  }
  // Mixtral's MoE block is "block_sparse_moe" and its experts' projections are w1 (gate), w2
  // (down) and w3 (up), registered in that order (MixtralBlockSparseTop2MLP).
  bool MixtralStyle() const { return model_type == "mixtral"; }
};

// Parses config.json. Missing required fields and inconsistent ones are INVALID_ARGUMENT naming
// the field; so are model types outside kSupportedModelTypes and settings of a supported type that
// the tensors here do not reproduce (e.g. attention_bias on Llama, which adds an o_proj bias).
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json);

// Divides every width by `factor` (at least 1 remains; head counts and experts unchanged) and
// keeps at most `max_layers` layers (0: all): the same structure, small enough for a laptop.
ModelConfig ScaleDown(const ModelConfig& config, int64_t factor, int64_t max_layers);

// Parameters of the whole model (logical elements).
int64_t CountParameters(const ModelConfig& config);

}  // namespace refit
