// The logical tensors of a model, by their Hugging Face names, with what each one is: the
// generators decide from `role` how trainers and engines shard it.
//
// ModelTensors lists them in the order the Hugging Face module yields them from
// named_parameters() (module registration order, transformers 4.x; tied weights once), with
// module buffers that the checkpoint holds (DeepSeek-V3's e_score_correction_bias) at their
// module's place: FSDP flattens a unit's parameters in exactly this order. Per decoder layer:
//   self_attn: q_proj.weight, [q_proj.bias], k_proj.weight, [k_proj.bias], v_proj.weight,
//              [v_proj.bias], o_proj.weight, [q_norm.weight, k_norm.weight (Qwen3)]
//     or, latent (DeepSeek): q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa,
//              kv_a_layernorm, kv_b_proj, o_proj
//   mlp (dense): gate_proj, up_proj, down_proj
//     or (Qwen-MoE): gate, experts.0..E-1.{gate_proj, up_proj, down_proj},
//              [shared_expert.{gate_proj, up_proj, down_proj}, shared_expert_gate]
//     or (DeepSeek-V2/V3, Kimi-K2): experts.0..E-1.{...}, gate.weight,
//              [gate.e_score_correction_bias (V3's noaux_tc router)],
//              [shared_experts.{gate_proj, up_proj, down_proj}]
//   or, Mixtral, block_sparse_moe (not mlp): gate.weight, experts.0..E-1.{w1, w2, w3} (w1 the
//              gate projection, w3 the up, w2 the down, registered in that order)
//   input_layernorm.weight, post_attention_layernorm.weight
// before the layers model.embed_tokens.weight; after them model.norm.weight, lm_head.weight
// (omitted when tied to the embedding).
#pragma once

#include <string>
#include <vector>

#include "client/models/model_config.h"
#include "plan/box.h"

namespace refit {

enum class Role {
  kReplicated,  // norms, routers, latent down-projections: every rank holds all of it
  kEmbedding,   // [vocab, hidden], vocabulary-parallel on dim 0
  kLmHead,      // [vocab, hidden], vocabulary-parallel on dim 0
  kQ,
  kK,
  kV,  // [heads * head_dim, hidden] (or biases [heads * head_dim]), split by heads
  kO,  // [hidden, heads * head_dim], split by heads on dim 1
  kGate,
  kUp,         // [inter, hidden], split on dim 0
  kDown,       // [hidden, inter], split on dim 1
  kLatentQB,   // MLA q_b_proj [heads * (nope + rope), q_lora], split by heads
  kLatentKVB,  // MLA kv_b_proj [heads * (nope + v), kv_lora], split by heads
  kLatentQA,   // MLA q_a_proj [q_lora, hidden]: replicated, fused by vLLM with kKVA
  kLatentKVA,  // MLA kv_a_proj_with_mqa [kv_lora + rope, hidden]
};

struct TensorDef {
  std::string name;
  Dims shape;
  Role role = Role::kReplicated;
  int64_t layer = -1;     // -1: before the layers (embedding); num_layers: after them
  int64_t expert = -1;    // routed expert index, or -1
  bool shared = false;    // a shared expert's MLP (MoE layers), sharded like a dense MLP
  int64_t head_unit = 0;  // rows (or columns) per head for head-split roles
  bool buffer = false;    // a module buffer, not a parameter: FSDP leaves it whole on every rank
  // DeepSeek's gate.e_score_correction_bias, which some frameworks hold in fp32 whatever the
  // weights' dtype (vLLM, Megatron); the generators decide its dtype
  // (client/models/layout_generator.h).
  bool router_bias = false;
};

std::vector<TensorDef> ModelTensors(const ModelConfig& config);

}  // namespace refit
