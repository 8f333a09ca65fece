// Layouts of real models: a trainer side in Megatron or FSDP style and an inference side in vLLM
// style, over Hugging Face tensor names, from a ModelConfig and a parallel configuration. Each
// describes exactly what its framework holds, so that a worker deriving its layout from live
// modules (client/python/refit/layouts/) produces the same one; what a framework cannot run is
// refused (INVALID_ARGUMENT naming the setting) instead of approximated.
//
// Trainer (Megatron-LM conventions):
//   ranks ordered tp, cp, dp, pp (rank = t + tp * (c + cp * (d + dp * p))); layers split evenly
//   over pp stages (the first stages take the remainder); q, k, v fused per query group into
//   linear_qkv ([q heads of group g; k_g; v_g] for each local group g); gate and up fused into
//   linear_fc1; vocabulary padded to a multiple of 128 * tp; experts split over ep ranks carved
//   out of dp * cp, and tensor-parallel inside (expert TP = TP); dp and cp ranks are replicas.
//   DeepSeek's gate.e_score_correction_bias (the router's expert_bias) is fp32 whatever the
//   weights' dtype: TopKRouter registers it fp32 and keeps it so (_maintain_float32_expert_bias,
//   megatron/core/transformer/moe/router.py). Refused as Megatron refuses them: tp not dividing
//   num_attention_heads, num_key_value_heads (query groups), intermediate_size,
//   moe_intermediate_size or the shared experts' size; ep not dividing the number of experts.
// Trainer, FSDP1 (FullyShardedDataParallel with FlatParameters; --fsdp N), as verl and TRL
//   (accelerate) wrap a Hugging Face model: the auto-wrap policy
//   (transformer_auto_wrap_policy with the decoder layer class, _no_split_modules) wraps each
//   decoder layer; the root unit holds the rest (model.embed_tokens, model.norm, lm_head unless
//   tied). Each unit has one FlatParameter: its parameters in named_parameters() order (see
//   client/models/model_tensors.h), flattened and concatenated; module buffers stay whole on every
//   rank. Following torch/distributed/fsdp/_flat_param.py
//   (FlatParamHandle._init_flat_param_and_metadata, flatten_tensors, _get_shard): with
//   use_orig_params=False no padding goes between parameters; with use_orig_params=True each
//   parameter starts at a multiple of _get_aligned_numel (16 bytes of the forward dtype, the
//   mixed-precision param_dtype or else the parameter's own: 8 bf16 elements, 4 fp32) and the flat
//   parameter is padded at its end to a multiple of the shard world size. Either way rank s holds
//   torch.chunk's chunk s of the flat parameter, padded at its end to the first chunk's size: shard
//   = ceil(numel / N) elements, rank s holds flat elements [s * shard, (s + 1) * shard), the tail
//   past numel being padding. Buffers, on every rank in this order: "flat_param" (the root unit),
//   then "flat_param.model.layers.<i>" for each layer, each followed by that unit's module buffers
//   under their own names. Pieces in flat order.
// Trainer, FSDP2 (fully_shard, per-parameter DTensor Shard(0); --fsdp2 N; torchtune, verl's fsdp2
//   strategy, TRL with accelerate's FSDP2): every parameter its own
//   buffer named exactly as the parameter, in named_parameters() order, sharded on dim 0 as
//   torch.chunk does (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _chunk_with_empty):
//   chunk = ceil(rows / N), rank s holds rows [s * chunk, min((s + 1) * chunk, rows)); the last
//   ranks may hold fewer rows or none: an empty local shard is no buffer at all. Module buffers
//   stay whole on every rank, under their own names.
// FSDP1 and FSDP2 with dp > 1: HSDP, dp replicas of an N-way shard, rank = replica * N + shard.
//   Workers are "fsdp-rank<rank>" on node first_node + rank / gpus_per_node, GPU rank % G.
//   Every tensor is in the weights' dtype, gate.e_score_correction_bias included: transformers 4.x
//   registers DeepseekV3TopkRouter's buffer as torch.zeros(n) in the load dtype, and DeepSeek's
//   remote modeling_deepseek.py (Kimi-K2) makes it an nn.Parameter, flattened with the others
//   (FSDP1 flattens one dtype per unit). transformers 5 pins it fp32
//   (_keep_in_fp32_modules_strict, PR #42580), like its fused MoE parameters not modeled here.
// Inference (vLLM conventions):
//   rank = d * tp + t; each worker declares its engine replica (Worker.replica, replica_rank,
//   replica_size): a dense model's DP replica d is "dp<d>", ranks t of tp; a MoE model's experts
//   are split over all dp * tp ranks, so the whole world is one replica "engine", ranks d * tp + t;
//   each DP replica is tensor-parallel over its tp ranks: per rank a fused qkv_proj ([q_t; k_t;
//   v_t], k/v heads replicated when tp > kv heads), gate_up_proj
//   ([gate_t; up_t]; dense MLPs and shared experts alike), row-parallel o_proj and down_proj,
//   vocabulary padded to a multiple of 64 and split evenly; routers (gate, shared_expert_gate)
//   replicated; MLA's q_a and kv_a fused into fused_qkv_a_proj. The routed experts are stacked in
//   w13_weight [E, 2 * inter_r, hidden] ([gate_r; up_r] per expert) and w2_weight [E, hidden,
//   inter_r], split over the flattened group of all dp * tp ranks (rank r = d * tp + t), as
//   FusedMoEParallelConfig.make (vllm/model_executor/layers/fused_moe/config.py) flattens tp
//   across dp: without expert parallelism rank r holds rows [r * i, (r + 1) * i) of every expert,
//   i = moe_intermediate_size / (dp * tp) (FusedMoE's weight loader narrows at tp_rank * shard
//   with the flattened tp_rank); with it (--expert-parallel) the experts are split over the
//   dp * tp ranks, each whole. DeepSeek's gate.e_score_correction_bias is fp32 whatever the
//   weights' dtype (DeepseekV2MoE: nn.Parameter(torch.empty(n, dtype=torch.float32))). Refused as
//   vLLM refuses them: tp not dividing num_attention_heads, tp and num_key_value_heads not
//   dividing one another, tp not dividing intermediate_size or the shared experts' size, dp * tp
//   not dividing moe_intermediate_size (without expert parallelism), tp above the number of
//   experts.
// Splits that do not divide evenly (vocabulary, layers over stages, experts over vLLM's expert
// parallel ranks) are uneven, the first ranks taking the remainder.
#pragma once

#include <optional>

#include "absl/status/statusor.h"
#include "client/models/model_config.h"
#include "plan/layout.h"

namespace refit {

struct PlacementOptions {
  int32_t gpus_per_node = 8;
  int32_t first_node = 0;  // nodes first_node, first_node + 1, ... hold ranks 0.., G per node
};

struct TrainerParallelism {
  int32_t tp = 1, pp = 1, ep = 1, dp = 1, cp = 1;
  // > 0: FSDP1 (flat parameters) sharded over this many ranks, dp replicas of them (HSDP); then
  // tp, pp, ep and cp must be 1.
  int32_t fsdp = 0;
  int32_t fsdp2 = 0;                  // > 0: FSDP2 (fully_shard) over this many ranks, likewise
  bool fsdp_use_orig_params = false;  // FSDP1: use_orig_params=True aligns each parameter
  // FSDP1: MixedPrecision(param_dtype=...), which decides the alignment; default: the weights'.
  std::optional<DType> fsdp_param_dtype;
  int32_t Shards() const { return fsdp > 0 ? fsdp : fsdp2; }
  int32_t World() const { return Shards() > 0 ? Shards() * dp : tp * pp * cp * dp; }
};

struct InferenceParallelism {
  int32_t tp = 1, dp = 1;
  bool expert_parallel = false;
  int32_t World() const { return tp * dp; }
};

absl::StatusOr<Layout> MakeTrainerLayout(const ModelConfig& model, const TrainerParallelism& p,
                                         const PlacementOptions& placement, DType dtype);
absl::StatusOr<Layout> MakeInferenceLayout(const ModelConfig& model, const InferenceParallelism& p,
                                           const PlacementOptions& placement, DType dtype);

}  // namespace refit
