// Layouts of real models: a trainer side in Megatron style and an inference side in vLLM style,
// over Hugging Face tensor names, from a ModelConfig and a parallel configuration.
//
// Trainer (Megatron-LM conventions):
//   ranks ordered tp, cp, dp, pp (rank = t + tp * (c + cp * (d + dp * p))); layers split evenly
//   over pp stages (the first stages take the remainder); q, k, v fused per query group into
//   linear_qkv ([q heads of group g; k_g; v_g] for each local group g); gate and up fused into
//   linear_fc1; vocabulary padded to a multiple of 128 * tp; experts split over ep ranks carved
//   out of dp * cp, and tensor-parallel inside (expert TP = TP); dp and cp ranks are replicas.
//   FSDP instead: per unit (embedding, each layer, the head), the unit's tensors flattened and
//   concatenated, padded to a multiple of the world size, and cut into one flat shard per rank;
//   shards start and end mid-tensor.
// Inference (vLLM conventions):
//   rank = d * tp + t; per rank a fused qkv_proj ([q_t; k_t; v_t], k/v heads replicated when
//   tp > kv heads), gate_up_proj ([gate_t; up_t]), row-parallel o_proj and down_proj, vocabulary
//   padded to a multiple of 64 and split evenly; experts stacked in w13_weight [E, 2 * inter_t,
//   hidden] and w2_weight [E, hidden, inter_t], or with expert parallelism split over all tp * dp
//   ranks unsharded; MLA's q_a and kv_a fused into fused_qkv_a_proj.
// Splits that do not divide evenly are uneven (the first ranks take the remainder).
#pragma once

#include "absl/status/statusor.h"
#include "client/model_config.h"
#include "plan/layout.h"

namespace refit {

struct PlacementOptions {
  int32_t gpus_per_node = 8;
  int32_t first_node = 0;  // nodes first_node, first_node + 1, ... hold ranks 0.., G per node
};

struct TrainerParallelism {
  int32_t tp = 1, pp = 1, ep = 1, dp = 1, cp = 1;
  int32_t fsdp = 0;  // > 0: FSDP over this many ranks (then tp, pp, ep, cp must be 1, dp ignored)
  int32_t World() const { return fsdp > 0 ? fsdp : tp * pp * cp * dp; }
};

struct InferenceParallelism {
  int32_t tp = 1, dp = 1;
  bool expert_parallel = false;
  int32_t World() const { return tp * dp; }
};

absl::StatusOr<Layout> MakeTrainerLayout(const ModelConfig& model, const TrainerParallelism& p,
                                         const PlacementOptions& placement, DType dtype);
absl::StatusOr<Layout> MakeInferenceLayout(const ModelConfig& model,
                                           const InferenceParallelism& p,
                                           const PlacementOptions& placement, DType dtype);

}  // namespace refit
