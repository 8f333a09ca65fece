#include "client/models/layout_generator.h"

#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "client/models/model_tensors.h"
#include "plan/flat_range.h"

namespace refit {
namespace {

// [begin, end) of part `i` when `extent` is split into `parts` (first parts take the remainder).
std::pair<int64_t, int64_t> Part(int64_t extent, int64_t parts, int64_t i) {
  const int64_t base = extent / parts, rest = extent % parts;
  const int64_t begin = i * base + std::min(i, rest);
  return {begin, begin + base + (i < rest ? 1 : 0)};
}

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The origin of row `row` of a weight (rank 2) or bias (rank 1) buffer.
Dims RowAt(int rank, int64_t row) { return rank == 1 ? Dims{row} : Dims{row, 0}; }

Box RowsOf(const Dims& shape, int64_t begin, int64_t end, int dim = 0) {
  Box b = Box::Whole(shape);
  b.origin[dim] = begin;
  b.shape[dim] = end - begin;
  return b;
}

// How a framework holds DeepSeek's gate.e_score_correction_bias (TensorDef::router_bias).
enum class RouterBias {
  kWeightsDType,  // like every other tensor (transformers 4.x, DeepSeek's remote code: FSDP)
  kF32,           // fp32 whatever the weights' dtype (vLLM's DeepseekV2MoE, Megatron's TopKRouter)
};

// Shared by both sides: the layout under construction, its tensors declared up front, each in
// the weights' dtype but the router bias, as `router_bias` says.
class Builder {
 public:
  Builder(const ModelConfig& model, DType dtype, RouterBias router_bias)
      : defs_(ModelTensors(model)), dtype_(dtype) {
    for (size_t i = 0; i < defs_.size(); ++i) {
      const DType t = defs_[i].router_bias && router_bias == RouterBias::kF32 ? DType::kF32 : dtype;
      layout_.AddTensor(defs_[i].name, defs_[i].shape, t);
      dtypes_.push_back(t);
      index_.emplace(defs_[i].name, static_cast<int32_t>(i));
    }
  }
  const std::vector<TensorDef>& defs() const { return defs_; }
  int32_t Index(const std::string& name) const { return index_.at(name); }
  const TensorDef& Def(const std::string& name) const { return defs_[Index(name)]; }

  int32_t Worker(const std::string& name, int32_t rank, const PlacementOptions& where) {
    return layout_.AddWorker(name, where.first_node + rank / where.gpus_per_node,
                             rank % where.gpus_per_node);
  }
  // A buffer in the weights' dtype (every buffer holding more than one tensor is), or `dtype`.
  int32_t Buffer(int32_t worker, const std::string& name, Dims shape,
                 std::optional<DType> dtype = std::nullopt) {
    return layout_.AddBuffer(worker, name, dtype.value_or(dtype_), shape);
  }
  // A piece whose buffer box is `buffer_origin` + the tensor box's shape (same rank), or, when
  // ranks differ, the tensor box's shape prefixed by 1s.
  void Put(int32_t tensor, const Box& tensor_box, int32_t buffer, Dims buffer_origin) {
    Box bb;
    bb.rank = buffer_origin.rank;
    const int lead = buffer_origin.rank - tensor_box.rank;
    for (int d = 0; d < bb.rank; ++d) {
      bb.origin[d] = buffer_origin[d];
      bb.shape[d] = d < lead ? 1 : tensor_box.shape[d - lead];
    }
    if (!tensor_box.IsEmpty()) layout_.AddPiece(tensor, tensor_box, buffer, bb);
  }
  // A piece laid out flat at element `offset` of a 1-D buffer (FSDP).
  void PutFlat(int32_t tensor, const Box& tensor_box, int32_t buffer, int64_t offset) {
    if (tensor_box.IsEmpty()) return;
    layout_.AddPiece(tensor, tensor_box, buffer,
                     Box::FromDims(Dims{offset}, Dims{tensor_box.NumElements()}));
  }
  // A buffer holding exactly one piece, in the tensor's dtype: tensor box == buffer.
  void Own(int32_t worker, const std::string& buffer_name, int32_t tensor, const Box& box) {
    if (box.IsEmpty()) return;
    const int32_t b = Buffer(worker, buffer_name, box.shape_dims(), dtypes_[tensor]);
    Dims zeros;
    zeros.rank = box.rank;
    Put(tensor, box, b, zeros);
  }
  Layout Take() { return std::move(layout_); }
  Layout& layout() { return layout_; }

 private:
  std::vector<TensorDef> defs_;
  std::vector<DType> dtypes_;  // per tensor, as declared
  DType dtype_;
  Layout layout_;
  absl::flat_hash_map<std::string, int32_t> index_;
};

std::string Sibling(const std::string& name, absl::string_view from, absl::string_view to) {
  return absl::StrReplaceAll(name, {{from, to}});
}

// The up projection beside a gate projection: "...gate_proj.weight" -> "...up_proj.weight", or
// Mixtral's expert "...w1.weight" -> "...w3.weight".
std::string UpOf(const std::string& gate) {
  if (absl::EndsWith(gate, ".w1.weight")) {
    return absl::StrCat(gate.substr(0, gate.size() - std::strlen("w1.weight")), "w3.weight");
  }
  return Sibling(gate, "gate_proj", "up_proj");
}

// The module holding a routed expert's tensor, "<...>.experts" ("model.layers.3.mlp.experts",
// Mixtral's "model.layers.3.block_sparse_moe.experts"): vLLM's FusedMoE stacks its experts there.
std::string ExpertsModule(const std::string& expert_tensor) {
  return expert_tensor.substr(0, expert_tensor.find(".experts.") + std::strlen(".experts"));
}

// Rows of a head-split tensor that rank t of tp holds: whole heads, `unit` rows each.
std::pair<int64_t, int64_t> HeadRows(const TensorDef& def, int dim, int64_t tp, int64_t t) {
  const int64_t heads = def.shape[dim] / def.head_unit;
  auto [h0, h1] = Part(heads, tp, t);
  return {h0 * def.head_unit, h1 * def.head_unit};
}

// ---------------------------------------------------------------------------------------------
// Trainer, Megatron style.

// Where one Megatron rank sits: its worker, its rank t of the tp tensor-parallel ranks, and the
// routed experts its expert-parallel rank holds, [e0, e1).
struct MegatronRank {
  int32_t worker;
  int64_t tp, t;
  int64_t e0, e1;
};

// Whether pipeline stage `stage` of `pp` holds `def`: the first stage also holds what comes before
// the `layers` layers, the last what comes after them.
bool InMegatronStage(const TensorDef& def, int64_t layers, int64_t pp, int64_t stage) {
  auto [layer0, layer1] = Part(layers, pp, stage);
  return def.layer < 0         ? stage == 0
         : def.layer >= layers ? stage == pp - 1
                               : def.layer >= layer0 && def.layer < layer1;
}

// A routed expert outside [e0, e1) is another expert-parallel rank's; everything else is held.
bool HoldsExpert(const TensorDef& def, int64_t e0, int64_t e1) {
  return def.expert < 0 || (def.expert >= e0 && def.expert < e1);
}

// The embedding or lm head: rows split evenly over tp, the vocabulary padded to 128 * tp.
void AddMegatronVocab(Builder& b, const MegatronRank& r, const TensorDef& def, int32_t ti) {
  const int64_t per = RoundUp(def.shape[0], 128 * r.tp) / r.tp;
  const int32_t buf = b.Buffer(
      r.worker,
      def.role == Role::kEmbedding ? "embedding.word_embeddings.weight" : "output_layer.weight",
      Dims{per, def.shape[1]});
  const int64_t r0 = std::min(r.t * per, def.shape[0]),
                r1 = std::min((r.t + 1) * per, def.shape[0]);
  b.Put(ti, RowsOf(def.shape, r0, r1), buf, Dims{0, 0});
}

// linear_qkv: per query group g, [q heads of g; k_g; v_g].
absl::Status AddMegatronQkv(Builder& b, const ModelConfig& m, const MegatronRank& r,
                            const TensorDef& def, int32_t ti, const std::string& lp) {
  const TensorDef& k = b.Def(Sibling(def.name, "q_proj", "k_proj"));
  const int64_t hd = def.head_unit, groups = m.num_key_value_heads, tp = r.tp;
  if (groups % tp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Megatron needs tp (", tp, ") to divide num_key_value_heads (", groups, ")"));
  }
  const int64_t local = groups / tp, qpg = m.num_attention_heads / groups;
  Dims shape = def.shape;
  shape[0] = local * (qpg + 2) * hd;
  const std::string suffix = def.shape.rank == 1 ? "bias" : "weight";
  const int32_t buf = b.Buffer(r.worker, lp + "self_attention.linear_qkv." + suffix, shape);
  auto at = [&](int64_t row) { return RowAt(shape.rank, row); };
  const int32_t vi = b.Index(Sibling(def.name, "q_proj", "v_proj"));
  for (int64_t g = 0; g < local; ++g) {
    const int64_t G = r.t * local + g, row = g * (qpg + 2) * hd;
    b.Put(ti, RowsOf(def.shape, G * qpg * hd, (G + 1) * qpg * hd), buf, at(row));
    b.Put(b.Index(k.name), RowsOf(k.shape, G * hd, (G + 1) * hd), buf, at(row + qpg * hd));
    b.Put(vi, RowsOf(k.shape, G * hd, (G + 1) * hd), buf, at(row + (qpg + 1) * hd));
  }
  return absl::OkStatus();
}

// Megatron's name of an MLP's `fc` ("linear_fc1", "linear_fc2"): a routed expert's is numbered
// among the rank's local experts, which start at `e0`.
std::string MegatronMlpName(const std::string& lp, const TensorDef& def, int64_t e0,
                            absl::string_view fc) {
  if (def.expert >= 0) return absl::StrCat(lp, "mlp.experts.", fc, ".weight", def.expert - e0);
  return absl::StrCat(lp, def.shared ? "mlp.shared_experts." : "mlp.", fc, ".weight");
}

// linear_fc1: [gate_t; up_t], the rank's rows of both.
void AddMegatronFc1(Builder& b, const MegatronRank& r, const TensorDef& def, int32_t ti,
                    const std::string& lp) {
  const int32_t up = b.Index(UpOf(def.name));
  auto [r0, r1] = Part(def.shape[0], r.tp, r.t);
  const int32_t buf = b.Buffer(r.worker, MegatronMlpName(lp, def, r.e0, "linear_fc1"),
                               Dims{2 * (r1 - r0), def.shape[1]});
  b.Put(ti, RowsOf(def.shape, r0, r1), buf, Dims{0, 0});
  b.Put(up, RowsOf(def.shape, r0, r1), buf, Dims{r1 - r0, 0});
}

// One tensor of the rank's stage: its pieces, in buffers named as Megatron names them.
absl::Status AddMegatronTensor(Builder& b, const ModelConfig& m, const MegatronRank& r,
                               const TensorDef& def) {
  const int32_t ti = b.Index(def.name);
  const std::string lp = absl::StrCat("decoder.layers.", def.layer, ".");
  switch (def.role) {
    case Role::kReplicated:
    case Role::kLatentQA:
    case Role::kLatentKVA:
      b.Own(r.worker, def.name, ti, Box::Whole(def.shape));
      break;
    case Role::kEmbedding:
    case Role::kLmHead:
      AddMegatronVocab(b, r, def, ti);
      break;
    case Role::kQ:
      return AddMegatronQkv(b, m, r, def, ti, lp);
    case Role::kK:
    case Role::kV:
    case Role::kUp:
      break;  // fused with kQ / kGate
    case Role::kGate:
      if (HoldsExpert(def, r.e0, r.e1)) AddMegatronFc1(b, r, def, ti, lp);
      break;
    case Role::kDown: {
      if (!HoldsExpert(def, r.e0, r.e1)) break;
      auto [c0, c1] = Part(def.shape[1], r.tp, r.t);
      b.Own(r.worker, MegatronMlpName(lp, def, r.e0, "linear_fc2"), ti,
            RowsOf(def.shape, c0, c1, 1));
      break;
    }
    case Role::kO: {
      auto [c0, c1] = HeadRows(def, 1, r.tp, r.t);
      b.Own(r.worker, lp + "self_attention.linear_proj.weight", ti, RowsOf(def.shape, c0, c1, 1));
      break;
    }
    case Role::kLatentQB:
    case Role::kLatentKVB: {
      auto [r0, r1] = HeadRows(def, 0, r.tp, r.t);
      b.Own(r.worker, def.name, ti, RowsOf(def.shape, r0, r1));
      break;
    }
  }
  return absl::OkStatus();
}

absl::Status AddMegatronRank(Builder& b, const ModelConfig& m, const TrainerParallelism& p,
                             int32_t worker, int64_t t, int64_t ep_rank, int64_t stage) {
  auto [e0, e1] = Part(m.num_experts, p.ep, ep_rank);
  const MegatronRank r{worker, p.tp, t, e0, e1};
  for (const TensorDef& def : b.defs()) {
    if (!InMegatronStage(def, m.num_hidden_layers, p.pp, stage)) continue;
    if (auto s = AddMegatronTensor(b, m, r, def); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Trainer, FSDP1 and FSDP2 (see the header for the conventions and the sources they follow).

// Workers of an FSDP (or HSDP) trainer, by rank = replica * shards + shard.
std::vector<int32_t> FsdpWorkers(Builder& b, const TrainerParallelism& p,
                                 const PlacementOptions& where) {
  std::vector<int32_t> workers;
  for (int64_t r = 0; r < p.World(); ++r) {
    workers.push_back(b.Worker(absl::StrCat("fsdp-rank", r), static_cast<int32_t>(r), where));
  }
  return workers;
}

// FSDP1: one FlatParameter per wrapped unit. Alignment (use_orig_params=True only), from
// torch/distributed/fsdp/_flat_param.py: FlatParamHandle.__init__ sets align_addresses =
// use_orig_params and aligned_numel = _get_aligned_numel(unsharded_dtype=_fwd_bwd_param_dtype)
// = 16 // element size; _init_flat_param_and_metadata then, before each parameter, inserts
// aligned_numel - total % aligned_numel padding elements when that is strictly between 0 and
// aligned_numel, and after the last one pads to a multiple of the world size the same way.
// Sharding (_get_shard / _get_unpadded_shard): torch.chunk of the flat parameter into world
// chunks, each rank's chunk right-padded to chunks[0].numel() = ceil(numel / world) (a rank past
// the last chunk holds padding only).
absl::StatusOr<Layout> MakeFsdp1Layout(const ModelConfig& m, const TrainerParallelism& p,
                                       const PlacementOptions& where, DType dtype) {
  Builder b(m, dtype, RouterBias::kWeightsDType);  // see the header: transformers 4.x
  const int64_t shards = p.fsdp;
  const std::vector<int32_t> workers = FsdpWorkers(b, p, where);
  const int64_t aligned =
      p.fsdp_use_orig_params ? 16 / DTypeSize(p.fsdp_param_dtype.value_or(dtype)) : 0;
  const int64_t L = m.num_hidden_layers;
  // Units in module order: the root (everything outside the decoder layers), then each layer.
  for (int64_t unit = -1; unit < L; ++unit) {
    std::vector<int32_t> params, module_buffers;
    for (size_t i = 0; i < b.defs().size(); ++i) {
      const TensorDef& def = b.defs()[i];
      const bool in_unit = unit < 0 ? (def.layer < 0 || def.layer >= L) : def.layer == unit;
      if (!in_unit) continue;
      (def.buffer ? module_buffers : params).push_back(static_cast<int32_t>(i));
    }
    // Flat offsets of the parameters, and the flat parameter's numel.
    std::vector<int64_t> offsets;
    int64_t total = 0;
    for (int32_t ti : params) {
      if (aligned > 0) {
        const int64_t pad = aligned - total % aligned;
        if (pad > 0 && pad < aligned) total += pad;
      }
      offsets.push_back(total);
      total += b.defs()[ti].shape.NumElements();
    }
    if (aligned > 0) {
      const int64_t pad = shards - total % shards;
      if (pad > 0 && pad < shards) total += pad;
    }
    const int64_t shard = (total + shards - 1) / shards;
    const std::string name =
        unit < 0 ? "flat_param" : absl::StrCat("flat_param.model.layers.", unit);
    for (int64_t r = 0; r < p.World(); ++r) {
      const int64_t s = r % shards;
      const int32_t buf = b.Buffer(workers[r], name, Dims{shard});
      const int64_t lo = s * shard, hi = (s + 1) * shard;
      for (size_t k = 0; k < params.size(); ++k) {
        const Dims& shape = b.defs()[params[k]].shape;
        const int64_t start = offsets[k], n = shape.NumElements();
        const int64_t a = std::max(lo, start), e = std::min(hi, start + n);
        if (a >= e) continue;
        for (const Box& box : FlatRangeToBoxes(shape, a - start, e - start)) {
          b.PutFlat(params[k], box, buf, LinearIndex(box.origin_dims(), shape) + start - lo);
        }
      }
      for (int32_t ti : module_buffers) {
        b.Own(workers[r], b.defs()[ti].name, ti, Box::Whole(b.defs()[ti].shape));
      }
    }
  }
  return b.Take();
}

// FSDP2: per parameter, torch.chunk on dim 0 (_chunk_with_empty); an empty chunk is no buffer.
absl::StatusOr<Layout> MakeFsdp2Layout(const ModelConfig& m, const TrainerParallelism& p,
                                       const PlacementOptions& where, DType dtype) {
  Builder b(m, dtype, RouterBias::kWeightsDType);  // see the header: transformers 4.x
  const int64_t shards = p.fsdp2;
  const std::vector<int32_t> workers = FsdpWorkers(b, p, where);
  for (int64_t r = 0; r < p.World(); ++r) {
    const int64_t s = r % shards;
    for (size_t i = 0; i < b.defs().size(); ++i) {
      const TensorDef& def = b.defs()[i];
      if (def.buffer || def.shape.rank == 0) {
        b.Own(workers[r], def.name, static_cast<int32_t>(i), Box::Whole(def.shape));
        continue;
      }
      const int64_t rows = def.shape[0], chunk = (rows + shards - 1) / shards;
      const int64_t r0 = std::min(s * chunk, rows), r1 = std::min((s + 1) * chunk, rows);
      b.Own(workers[r], def.name, static_cast<int32_t>(i),
            RowsOf(def.shape, r0, r1));  // none if empty
    }
  }
  return b.Take();
}

// ---------------------------------------------------------------------------------------------
// Inference, vLLM style.

// Where one vLLM rank sits: its worker, its rank t of its replica's tp tensor-parallel ranks, and
// its share of the routed experts: experts [e0, e1), of each part `expert_part` of `expert_split`
// along the intermediate size.
struct VllmRank {
  int32_t worker;
  int64_t tp, t;
  int64_t e0, e1, expert_split, expert_part;
  // The stacked expert buffers of the layer being generated (experts come in order).
  int32_t last_w13 = -1, last_w2 = -1;
};

// The routed experts (FusedMoEParallelConfig.make) flatten tp over dp: one group of dp * tp ranks,
// rank d * tp + t. With expert parallelism it splits the experts, each whole; without, every rank
// holds every expert, their intermediate rows split over the dp * tp ranks. Everything else
// (attention, dense and shared-expert MLPs, the vocabulary) is tensor-parallel within the replica,
// over tp; routers are replicated.
VllmRank VllmRankOf(const ModelConfig& m, const InferenceParallelism& p, int32_t worker, int64_t t,
                    int64_t d) {
  const int64_t tp = p.tp;
  const int64_t flat = p.World(), flat_rank = d * tp + t;
  auto [e0, e1] = p.expert_parallel ? Part(m.num_experts, flat, flat_rank)
                                    : std::pair<int64_t, int64_t>{0, m.num_experts};
  const int64_t expert_split = p.expert_parallel ? 1 : flat;
  const int64_t expert_part = p.expert_parallel ? 0 : flat_rank;
  return VllmRank{worker, tp, t, e0, e1, expert_split, expert_part};
}

// fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa], replicated.
void AddVllmFusedQkvA(Builder& b, const VllmRank& r, const TensorDef& def, int32_t ti,
                      const std::string& lp) {
  const TensorDef& kva = b.Def(lp + "self_attn.kv_a_proj_with_mqa.weight");
  const int32_t buf = b.Buffer(r.worker, lp + "self_attn.fused_qkv_a_proj.weight",
                               Dims{def.shape[0] + kva.shape[0], def.shape[1]});
  b.Put(ti, Box::Whole(def.shape), buf, Dims{0, 0});
  b.Put(b.Index(kva.name), Box::Whole(kva.shape), buf, Dims{def.shape[0], 0});
}

// The embedding or lm head: the vocabulary padded to a multiple of 64, split evenly over tp.
void AddVllmVocab(Builder& b, const VllmRank& r, const TensorDef& def, int32_t ti) {
  const int64_t padded = RoundUp(def.shape[0], 64);
  const int64_t per = (padded + r.tp - 1) / r.tp;
  const int32_t buf = b.Buffer(r.worker, def.name, Dims{per, def.shape[1]});
  const int64_t r0 = std::min(r.t * per, def.shape[0]),
                r1 = std::min((r.t + 1) * per, def.shape[0]);
  b.Put(ti, RowsOf(def.shape, r0, r1), buf, Dims{0, 0});
}

// qkv_proj: [q_t; k_t; v_t], the k and v heads replicated when there are fewer than ranks.
void AddVllmQkv(Builder& b, const ModelConfig& m, const VllmRank& r, const TensorDef& def,
                int32_t ti, const std::string& lp) {
  const TensorDef& k = b.Def(Sibling(def.name, "q_proj", "k_proj"));
  const int32_t vi = b.Index(Sibling(def.name, "q_proj", "v_proj"));
  const int64_t hd = def.head_unit, kv = m.num_key_value_heads, tp = r.tp, t = r.t;
  auto [q0, q1] = HeadRows(def, 0, tp, t);
  int64_t k0, k1;
  if (kv >= tp) {
    std::tie(k0, k1) = HeadRows(k, 0, tp, t);
  } else {  // fewer kv heads than ranks: each rank keeps a copy of its group's head
    k0 = t * kv / tp * hd;
    k1 = k0 + hd;
  }
  Dims shape = def.shape;
  shape[0] = (q1 - q0) + 2 * (k1 - k0);
  const std::string suffix = def.shape.rank == 1 ? "bias" : "weight";
  const int32_t buf = b.Buffer(r.worker, lp + "self_attn.qkv_proj." + suffix, shape);
  auto at = [&](int64_t row) { return RowAt(shape.rank, row); };
  b.Put(ti, RowsOf(def.shape, q0, q1), buf, at(0));
  b.Put(b.Index(k.name), RowsOf(k.shape, k0, k1), buf, at(q1 - q0));
  b.Put(vi, RowsOf(k.shape, k0, k1), buf, at(q1 - q0 + k1 - k0));
}

// gate_up_proj ([gate_t; up_t]) of a dense MLP or shared expert; a routed expert's gate and up go
// to its layer's stacked w13_weight [E_local, 2 * inter_r, hidden], made at the first local expert.
void AddVllmGateUp(Builder& b, VllmRank& r, const TensorDef& def, int32_t ti) {
  const int32_t up = b.Index(UpOf(def.name));
  if (def.expert >= 0) {
    if (def.expert < r.e0 || def.expert >= r.e1) return;
    auto [r0, r1] = Part(def.shape[0], r.expert_split, r.expert_part);
    const int32_t buf = def.expert == r.e0
                            ? b.Buffer(r.worker, ExpertsModule(def.name) + ".w13_weight",
                                       Dims{r.e1 - r.e0, 2 * (r1 - r0), def.shape[1]})
                            : r.last_w13;
    r.last_w13 = buf;
    b.Put(ti, RowsOf(def.shape, r0, r1), buf, Dims{def.expert - r.e0, 0, 0});
    b.Put(up, RowsOf(def.shape, r0, r1), buf, Dims{def.expert - r.e0, r1 - r0, 0});
    return;
  }
  auto [r0, r1] = Part(def.shape[0], r.tp, r.t);
  const std::string name = Sibling(def.name, "gate_proj", "gate_up_proj");
  const int32_t buf = b.Buffer(r.worker, name, Dims{2 * (r1 - r0), def.shape[1]});
  b.Put(ti, RowsOf(def.shape, r0, r1), buf, Dims{0, 0});
  b.Put(up, RowsOf(def.shape, r0, r1), buf, Dims{r1 - r0, 0});
}

// down_proj, row-parallel (its columns split); a routed expert's goes to its layer's stacked
// w2_weight [E_local, hidden, inter_r], made at the first local expert.
void AddVllmDown(Builder& b, VllmRank& r, const TensorDef& def, int32_t ti) {
  if (def.expert >= 0) {
    if (def.expert < r.e0 || def.expert >= r.e1) return;
    auto [c0, c1] = Part(def.shape[1], r.expert_split, r.expert_part);
    const int32_t buf = def.expert == r.e0
                            ? b.Buffer(r.worker, ExpertsModule(def.name) + ".w2_weight",
                                       Dims{r.e1 - r.e0, def.shape[0], c1 - c0})
                            : r.last_w2;
    r.last_w2 = buf;
    b.Put(ti, RowsOf(def.shape, c0, c1, 1), buf, Dims{def.expert - r.e0, 0, 0});
    return;
  }
  auto [c0, c1] = Part(def.shape[1], r.tp, r.t);
  b.Own(r.worker, def.name, ti, RowsOf(def.shape, c0, c1, 1));
}

// One tensor: its pieces, in buffers named as vLLM names them.
void AddVllmTensor(Builder& b, const ModelConfig& m, VllmRank& r, const TensorDef& def) {
  const int32_t ti = b.Index(def.name);
  const std::string lp = absl::StrCat("model.layers.", def.layer, ".");
  switch (def.role) {
    case Role::kReplicated:
      b.Own(r.worker, def.name, ti, Box::Whole(def.shape));
      break;
    case Role::kLatentQA:
      AddVllmFusedQkvA(b, r, def, ti, lp);
      break;
    case Role::kLatentKVA:
      if (m.q_lora_rank == 0) b.Own(r.worker, def.name, ti, Box::Whole(def.shape));
      break;  // else fused with kLatentQA
    case Role::kEmbedding:
    case Role::kLmHead:
      AddVllmVocab(b, r, def, ti);
      break;
    case Role::kQ:
      AddVllmQkv(b, m, r, def, ti, lp);
      break;
    case Role::kK:
    case Role::kV:
    case Role::kUp:
      break;  // fused with kQ / kGate
    case Role::kGate:
      AddVllmGateUp(b, r, def, ti);
      break;
    case Role::kDown:
      AddVllmDown(b, r, def, ti);
      break;
    case Role::kO: {
      auto [c0, c1] = HeadRows(def, 1, r.tp, r.t);
      b.Own(r.worker, def.name, ti, RowsOf(def.shape, c0, c1, 1));
      break;
    }
    case Role::kLatentQB:
    case Role::kLatentKVB: {
      auto [r0, r1] = HeadRows(def, 0, r.tp, r.t);
      b.Own(r.worker, def.name, ti, RowsOf(def.shape, r0, r1));
      break;
    }
  }
}

void AddVllmRank(Builder& b, const ModelConfig& m, const InferenceParallelism& p, int32_t worker,
                 int64_t t, int64_t d) {
  VllmRank r = VllmRankOf(m, p, worker, t, d);
  for (const TensorDef& def : b.defs()) AddVllmTensor(b, m, r, def);
}

absl::Status CheckPositive(std::initializer_list<std::pair<const char*, int32_t>> values) {
  for (auto [name, v] : values) {
    if (v < 1) return absl::InvalidArgumentError(absl::StrCat(name, " must be >= 1, not ", v));
  }
  return absl::OkStatus();
}

// "<framework> needs tp (3) to divide num_attention_heads (32)" unless `value` % tp == 0.
absl::Status CheckDivides(const char* framework, const char* what, int64_t tp, const char* field,
                          int64_t value) {
  if (value % tp == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(framework, " needs ", what, " (", tp, ") to divide ", field, " (", value, ")"));
}

bool AnyDenseLayer(const ModelConfig& m) {
  for (int64_t l = 0; l < m.num_hidden_layers; ++l) {
    if (!m.IsMoeLayer(l)) return true;
  }
  return false;
}

bool AnyMoeLayer(const ModelConfig& m) {
  for (int64_t l = 0; l < m.num_hidden_layers; ++l) {
    if (m.IsMoeLayer(l)) return true;
  }
  return false;
}

// The heads and widths a tensor-parallel group of `tp` splits, as both Megatron and vLLM need them
// divisible. KV heads (standard attention only): Megatron splits query groups, so tp must divide
// them; vLLM also replicates them, so either may divide the other. The routed experts' width over
// `experts_tp` ranks, named `experts_tp_name` ("tp", or vLLM's flattened "dp * tp"); 0: the
// experts are not tensor-parallel (expert parallelism holds them whole).
absl::Status CheckTensorParallel(const char* framework, const ModelConfig& m, int64_t tp,
                                 int64_t experts_tp, const char* experts_tp_name,
                                 bool kv_replicable) {
  if (auto s = CheckDivides(framework, "tp", tp, "num_attention_heads", m.num_attention_heads);
      !s.ok()) {
    return s;
  }
  const int64_t kv = m.num_key_value_heads;
  if (m.kv_lora_rank == 0 && kv % tp != 0) {
    if (!kv_replicable) return CheckDivides(framework, "tp", tp, "num_key_value_heads", kv);
    if (tp % kv != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          framework, " needs tp (", tp, ") and num_key_value_heads (", kv,
          ") to divide one another (kv heads are split, or replicated tp / kv_heads times)"));
    }
  }
  if (AnyDenseLayer(m)) {
    if (auto s = CheckDivides(framework, "tp", tp, "intermediate_size", m.intermediate_size);
        !s.ok()) {
      return s;
    }
  }
  if (!AnyMoeLayer(m)) return absl::OkStatus();
  if (experts_tp > 0) {
    if (auto s = CheckDivides(framework, experts_tp_name, experts_tp, "moe_intermediate_size",
                              m.moe_intermediate_size);
        !s.ok()) {
      return s;
    }
  }
  if (m.n_shared_experts > 0) {
    if (auto s = CheckDivides(framework, "tp", tp, "the shared experts' intermediate size",
                              m.n_shared_experts * m.moe_intermediate_size);
        !s.ok()) {
      return s;
    }
  }
  if (m.shared_expert_intermediate_size > 0) {
    if (auto s = CheckDivides(framework, "tp", tp, "shared_expert_intermediate_size",
                              m.shared_expert_intermediate_size);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// What Megatron-LM refuses of the parallelism `p` on model `m` (FSDP aside).
absl::Status CheckMegatron(const ModelConfig& m, const TrainerParallelism& p) {
  if (auto s =
          CheckPositive({{"tp", p.tp}, {"pp", p.pp}, {"ep", p.ep}, {"dp", p.dp}, {"cp", p.cp}});
      !s.ok()) {
    return s;
  }
  if ((p.dp * p.cp) % p.ep != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ep (", p.ep, ") must divide dp * cp (",
                                                   p.dp * p.cp,
                                                   "): Megatron carves expert groups out of them"));
  }
  if (p.pp > m.num_hidden_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("pp (", p.pp, ") exceeds the number of layers (", m.num_hidden_layers, ")"));
  }
  if (m.num_experts > 0 && p.ep > m.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("ep (", p.ep, ") exceeds the number of experts (", m.num_experts, ")"));
  }
  // Megatron-LM: TransformerConfig needs num_attention_heads and num_query_groups divisible by
  // the tensor-parallel size, the parallel linears divide their widths (ensure_divisibility),
  // and MoELayer needs num_moe_experts divisible by the expert-parallel size.
  if (auto s = CheckTensorParallel("Megatron", m, p.tp, /*experts_tp=*/p.tp, "tp",
                                   /*kv_replicable=*/false);
      !s.ok()) {
    return s;
  }
  if (AnyMoeLayer(m)) {
    if (auto s = CheckDivides("Megatron", "ep", p.ep, "the number of experts", m.num_experts);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Layout> MakeTrainerLayout(const ModelConfig& m, const TrainerParallelism& p,
                                         const PlacementOptions& where, DType dtype) {
  if (auto s = CheckPositive({{"gpus per node", where.gpus_per_node}}); !s.ok()) return s;
  if (p.fsdp > 0 && p.fsdp2 > 0) {
    return absl::InvalidArgumentError("choose FSDP1 (fsdp) or FSDP2 (fsdp2), not both");
  }
  if (p.fsdp_use_orig_params && p.fsdp <= 0) {
    return absl::InvalidArgumentError("use_orig_params is an FSDP1 setting: it needs fsdp > 0");
  }
  if (p.fsdp_param_dtype.has_value() && p.fsdp <= 0) {
    return absl::InvalidArgumentError("the FSDP1 param dtype needs fsdp > 0");
  }
  if (p.fsdp > 0 || p.fsdp2 > 0) {
    if (p.tp != 1 || p.pp != 1 || p.ep != 1 || p.cp != 1) {
      return absl::InvalidArgumentError(
          "FSDP here shards everything over its ranks: tp, pp, ep and cp must be 1");
    }
    if (auto s = CheckPositive({{"dp (FSDP replicas)", p.dp}}); !s.ok()) return s;
    return p.fsdp > 0 ? MakeFsdp1Layout(m, p, where, dtype) : MakeFsdp2Layout(m, p, where, dtype);
  }
  if (p.fsdp < 0 || p.fsdp2 < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("fsdp (", p.fsdp, ") and fsdp2 (", p.fsdp2, ") must be >= 0"));
  }
  if (auto s = CheckMegatron(m, p); !s.ok()) return s;
  // Megatron's TopKRouter keeps its expert_bias an fp32 buffer (_maintain_float32_expert_bias).
  Builder b(m, dtype, RouterBias::kF32);
  for (int64_t stage = 0; stage < p.pp; ++stage) {
    for (int64_t d = 0; d < p.dp; ++d) {
      for (int64_t c = 0; c < p.cp; ++c) {
        for (int64_t t = 0; t < p.tp; ++t) {
          const int64_t rank = t + p.tp * (c + p.cp * (d + p.dp * stage));
          const int32_t w =
              b.Worker(absl::StrCat("trainer-rank", rank), static_cast<int32_t>(rank), where);
          const int64_t ep_rank = (d * p.cp + c) % p.ep;
          if (auto s = AddMegatronRank(b, m, p, w, t, ep_rank, stage); !s.ok()) return s;
        }
      }
    }
  }
  return b.Take();
}

absl::StatusOr<Layout> MakeInferenceLayout(const ModelConfig& m, const InferenceParallelism& p,
                                           const PlacementOptions& where, DType dtype) {
  if (auto s = CheckPositive({{"tp", p.tp}, {"dp", p.dp}, {"gpus per node", where.gpus_per_node}});
      !s.ok()) {
    return s;
  }
  if (p.expert_parallel && m.num_experts > 0 && p.World() > m.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("expert parallelism over ", p.World(),
                                                   " ranks exceeds the number of experts (",
                                                   m.num_experts, ")"));
  }
  // vLLM: ModelConfig.verify_with_parallel_config needs num_attention_heads divisible by tp;
  // QKVParallelLinear divides the kv heads by tp or replicates them tp / kv times (divide() both
  // ways); Merged/ColumnParallelLinear and RowParallelLinear divide their widths (tp within the
  // replica: shared experts included); FusedMoE asserts moe_intermediate_size divisible by its
  // flattened tp, dp * tp, unless experts are expert-parallel; the MoE blocks (Qwen-MoE,
  // DeepSeek) raise when tp (the replica's) exceeds the number of experts.
  const int64_t experts_tp = p.expert_parallel ? 0 : p.World();
  if (auto s = CheckTensorParallel("vLLM", m, p.tp, experts_tp, p.dp > 1 ? "dp * tp" : "tp",
                                   /*kv_replicable=*/true);
      !s.ok()) {
    return s;
  }
  if (AnyMoeLayer(m) && p.tp > m.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vLLM refuses tp (", p.tp, ") greater than the number of experts (", m.num_experts, ")"));
  }
  // DeepseekV2MoE creates gate.e_score_correction_bias as an fp32 parameter.
  Builder b(m, dtype, RouterBias::kF32);
  for (int64_t d = 0; d < p.dp; ++d) {
    for (int64_t t = 0; t < p.tp; ++t) {
      const int64_t rank = d * p.tp + t;
      const int32_t w =
          b.Worker(absl::StrCat("vllm-dp", d, "-tp", t), static_cast<int32_t>(rank), where);
      // The engine replica this rank belongs to (docs/LAYOUTS.md): a dense model's DP replicas are
      // engines of their own ("dp<d>", its tp ranks); a MoE model's experts are split over all
      // dp * tp ranks, so that whole world is one replica ("engine").
      Worker& rw = b.layout().workers[w];
      const bool moe = m.num_experts > 0;
      rw.replica = moe ? "engine" : absl::StrCat("dp", d);
      rw.replica_rank = static_cast<int32_t>(moe ? rank : t);
      rw.replica_size = moe ? p.World() : p.tp;
      AddVllmRank(b, m, p, w, t, d);
    }
  }
  return b.Take();
}

}  // namespace refit
