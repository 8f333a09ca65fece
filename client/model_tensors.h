// The logical tensors of a model, by their Hugging Face names, with what each one is: the
// generators decide from `role` how trainers and engines shard it.
#pragma once

#include <string>
#include <vector>

#include "client/model_config.h"
#include "plan/box.h"

namespace refit {

enum class Role {
  kReplicated,   // norms, routers, latent down-projections: every rank holds all of it
  kEmbedding,    // [vocab, hidden], vocabulary-parallel on dim 0
  kLmHead,       // [vocab, hidden], vocabulary-parallel on dim 0
  kQ, kK, kV,    // [heads * head_dim, hidden] (or biases [heads * head_dim]), split by heads
  kO,            // [hidden, heads * head_dim], split by heads on dim 1
  kGate, kUp,    // [inter, hidden], split on dim 0
  kDown,         // [hidden, inter], split on dim 1
  kLatentQB,     // MLA q_b_proj [heads * (nope + rope), q_lora], split by heads
  kLatentKVB,    // MLA kv_b_proj [heads * (nope + v), kv_lora], split by heads
  kLatentQA,     // MLA q_a_proj [q_lora, hidden]: replicated, fused by vLLM with kKVA
  kLatentKVA,    // MLA kv_a_proj_with_mqa [kv_lora + rope, hidden]
};

struct TensorDef {
  std::string name;
  Dims shape;
  Role role = Role::kReplicated;
  int64_t layer = -1;    // -1: before the layers (embedding); num_layers: after them
  int64_t expert = -1;   // routed expert index, or -1
  bool shared = false;   // a shared expert's MLP (MoE layers), sharded like a dense MLP
  int64_t head_unit = 0; // rows (or columns) per head for head-split roles
};

std::vector<TensorDef> ModelTensors(const ModelConfig& config);

}  // namespace refit
