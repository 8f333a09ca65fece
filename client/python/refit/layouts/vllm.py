"""Engine layouts in vLLM's conventions: fused buffers mapped back to Hugging Face tensors.

What a user must know
---------------------
``engine_worker(params, config)`` takes one vLLM rank's parameters (``model.named_parameters()``,
a module, or ``{name: tensor | (local shape, dtype)}``) and an ``EngineConfig`` (heads, kv heads,
vocabulary, experts, tp/dp ranks, expert parallelism), and returns that rank's worker as a
one-worker layout dict: one buffer per vLLM parameter, named as vLLM names it, with pieces that
map Hugging Face tensors (``model.layers.N.self_attn.q_proj.weight``, ...) into it.

How a parameter is placed, from its name ``<parent>.<module>.<leaf>``:

* ``module`` in ``config.packed_modules`` (vLLM's ``packed_modules_mapping``, default
  ``VLLM_PACKED_MODULES``: ``qkv_proj`` -> q, k, v; ``gate_up_proj`` -> gate, up;
  ``fused_qkv_a_proj`` -> q_a_proj, kv_a_proj_with_mqa) is a fused buffer: its parts are stacked on
  dim 0 in that order, each sharded by its own rule;
* ``<parent>.experts.<leaf>`` with ``leaf`` in ``config.expert_modules`` (default: ``w13_weight``
  -> gate_proj, up_proj; ``w2_weight`` -> down_proj; Mixtral, from ``from_hf_config``: ``w1``, ``w3``
  and ``w2`` under ``block_sparse_moe``) is a stack of this rank's experts
  ``[E_local, ...]``, expert ``e`` at index ``e - first`` (``"linear"``, vLLM's default: the first
  ``E % ep`` ranks hold one more) or ``e // ep`` (``"round_robin"``); Hugging Face names
  ``<parent>.experts.<e>.<part>.weight``;
* every other module is one tensor, ``<parent>.<module>.<leaf>``.

The rule of each (part) module comes from ``config.sharding`` (default ``VLLM_SHARDING``), then
from its name (``*norm`` and ``*layernorm``: replicated); a parameter with no rule, or a leaf other
than ``weight``/``bias``/``e_score_correction_bias``, is refused by name. Rules:

======================  ==========================================================================
``replicated``          every rank holds all of it
``column``              dim 0 split evenly over TP (MergedColumnParallelLinear: gate, up)
``heads``               ``column``, and TP must divide ``num_attention_heads`` (q, q_b, kv_b)
``kv_heads``            k, v (QKVParallelLinear): kv heads split over TP, or, when TP exceeds them,
                        one head per rank, rank ``t`` holding head ``t // (tp / kv_heads)``
``row``                 dim 1 split evenly over TP (RowParallelLinear); a bias is replicated
``row_heads``           ``row``, and TP must divide ``num_attention_heads`` (o_proj)
``vocab``               VocabParallelEmbedding / ParallelLMHead: the vocabulary padded to a
                        multiple of ``vocab_padding`` (64), split evenly; rank ``t`` holds rows
                        ``[t * per, (t + 1) * per)`` of which only the real ones are a piece
======================  ==========================================================================

Parallelism: non-expert weights are split over ``tp_size`` (rank ``tp_rank``); DP ranks are
replicas. Fused MoE experts follow vLLM's ``FusedMoEParallelConfig``: without expert parallelism
their TP is flattened over DP (``dp_size * tp_size`` ranks, rank ``dp_rank * tp_size + tp_rank``);
with it, experts are split over those ranks and not TP-sharded. Tied embeddings: a ``lm_head``
that is the embedding (or any ``lm_head`` when ``config.tie_word_embeddings``) is left out, as the
Hugging Face checkpoint has no such tensor. vLLM requires even splits: a TP that does not divide a
head count, a kv-head count, an intermediate size or the padded vocabulary is refused by name.

fp8 engines (block fp8, vLLM's ``Fp8LinearMethod`` with ``weight_block_size``): a ``float8_e4m3fn``
weight is declared ``fp8_e4m3`` with ``{"format": "block_fp8", "block": config.weight_block_size,
"scale": "<hf name>_scale_inv"}``, and its ``weight_scale_inv`` parameter (``<module>.weight_scale_inv``,
or ``experts.w13_weight_scale_inv`` / ``w2_weight_scale_inv``; fp32, the blocks of the weight
buffer's last two dims) becomes a buffer holding each part's scale tensor ``<hf name>_scale_inv``
at its blocks. The data plane quantizes the trainers' bf16 into it (docs/LAYOUTS.md, "fp8
engines"). A part that does not start on a block, or ends inside one before its tensor ends, is
refused, as vLLM refuses it.

Workers are named ``vllm-dp<d>-tp<t>`` at rank ``d * tp_size + t`` (``refit-layout``'s names);
``RankPlacement`` puts that rank on a node and GPU. Each declares its engine replica
(``replica``, ``replicaRank``, ``replicaSize``; ``EngineConfig.replica``): the daemons refit a
replica only when all its ranks are registered, and whole (docs/ROUNDS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .core import Box, LayoutBuilder, LayoutError, RankPlacement, dtype_name, named_items

__all__ = [
    "VLLM_PACKED_MODULES", "VLLM_EXPERT_MODULES", "VLLM_SHARDING", "MIXTRAL_FIELDS", "EngineConfig", "engine_worker",
    "engine_layout", "expert_ids",
]

VLLM_PACKED_MODULES: Dict[str, List[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
}

VLLM_EXPERT_MODULES: Dict[str, List[str]] = {
    "w13_weight": ["gate_proj", "up_proj"],
    "w2_weight": ["down_proj"],
}

VLLM_SHARDING: Dict[str, str] = {
    "embed_tokens": "vocab", "lm_head": "vocab",
    "q_proj": "heads", "q_b_proj": "heads", "kv_b_proj": "heads",
    "k_proj": "kv_heads", "v_proj": "kv_heads",
    "o_proj": "row_heads",
    "gate_proj": "column", "up_proj": "column", "down_proj": "row",
    "q_a_proj": "replicated", "kv_a_proj_with_mqa": "replicated",
    "gate": "replicated", "shared_expert_gate": "replicated",
}

# Mixtral (vLLM's MixtralForCausalLM): block_sparse_moe.experts is a FusedMoE whose w13_weight
# stacks the checkpoint's w1 (gate) then w3 (up) and whose w2_weight holds w2 (down), its
# expert_params_mapping(ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2", ckpt_up_proj_name="w3").
MIXTRAL_FIELDS: Dict[str, Any] = {
    "expert_modules": {"w13_weight": ["w1", "w3"], "w2_weight": ["w2"]},
    "sharding": dict(VLLM_SHARDING, w1="column", w3="column", w2="row"),
}

_LEAVES = ("weight", "bias", "e_score_correction_bias")
_EXPERT_KIND = {"heads": "column", "kv_heads": "column", "row_heads": "row"}
_RULES = ("replicated", "column", "heads", "kv_heads", "row", "row_heads", "vocab")


@dataclass
class EngineConfig:
    """What an engine rank's layout depends on beyond its parameters' local shapes.

    ``num_attention_heads``/``num_key_value_heads``: the model's (global) head counts.
    ``head_dim``: rows per head in a fused qkv (``None``: inferred from the buffer).
    ``vocab_size``: the real (unpadded) vocabulary; needed when an embedding or head is present.
    ``num_experts``: routed experts (needed for stacked experts). ``q_lora_rank``: rows of
    ``q_a_proj`` in ``fused_qkv_a_proj`` (DeepSeek MLA). ``intermediate_size`` /
    ``moe_intermediate_size``: when set, checked against dense ``gate_up_proj`` and the experts.
    ``name_map``: vLLM module path -> Hugging Face path, for models whose vLLM names differ.
    ``from_hf_config`` fills the model fields from a Hugging Face config.
    """

    num_attention_heads: int
    num_key_value_heads: Optional[int] = None
    vocab_size: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    expert_parallel: bool = False
    expert_placement: str = "linear"
    num_experts: int = 0
    head_dim: Optional[int] = None
    q_lora_rank: int = 0
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    vocab_padding: int = 64
    tie_word_embeddings: bool = False
    # Block fp8 (quantization_config.weight_block_size): (rows, cols) of a block, for fp8 weights.
    weight_block_size: Optional[Tuple[int, int]] = None
    packed_modules: Mapping[str, Sequence[str]] = field(default_factory=lambda: dict(VLLM_PACKED_MODULES))
    expert_modules: Mapping[str, Sequence[str]] = field(default_factory=lambda: dict(VLLM_EXPERT_MODULES))
    sharding: Mapping[str, str] = field(default_factory=lambda: dict(VLLM_SHARDING))
    name_map: Optional[Callable[[str], str]] = None

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank

    @property
    def world(self) -> int:
        return self.dp_size * self.tp_size

    def moe_tp(self) -> Tuple[int, int]:
        """(size, rank) of the tensor parallelism inside experts (vLLM's FusedMoEParallelConfig)."""
        return (1, 0) if self.expert_parallel else (self.world, self.rank)

    def ep(self) -> Tuple[int, int]:
        """(size, rank) of expert parallelism."""
        return (self.world, self.rank) if self.expert_parallel else (1, 0)

    def replica(self) -> Tuple[str, int, int]:
        """(name, rank, size) of the engine replica this rank belongs to (Worker.replica): a dense
        model's DP replica ``d`` is ``"dp<d>"`` of ``tp_size`` ranks; a MoE model's experts are
        split over all ``dp_size * tp_size`` ranks, so that world is one replica ``"engine"``."""
        if self.num_experts > 0:
            return "engine", self.rank, self.world
        return f"dp{self.dp_rank}", self.tp_rank, self.tp_size

    def for_rank(self, dp_rank: int, tp_rank: int) -> "EngineConfig":
        return replace(self, dp_rank=dp_rank, tp_rank=tp_rank)

    @staticmethod
    def from_hf_config(config: Any, **parallel: Any) -> "EngineConfig":
        """From a Hugging Face config (a ``PretrainedConfig`` or its ``config.json`` dict) and the
        parallel fields (``tp_size=``, ``tp_rank=``, ``dp_size=``, ``dp_rank=``,
        ``expert_parallel=``, ...)."""
        def get(key: str, default: Any = None) -> Any:
            if isinstance(config, Mapping):
                return config.get(key, default)
            return getattr(config, key, default)

        heads = int(get("num_attention_heads"))
        fields = dict(
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads") or heads),
            vocab_size=int(get("vocab_size", 0) or 0),
            num_experts=int(get("n_routed_experts") or get("num_experts") or get("num_local_experts") or 0),
            head_dim=get("head_dim"),
            q_lora_rank=int(get("q_lora_rank") or 0),
            intermediate_size=int(get("intermediate_size") or 0),
            moe_intermediate_size=int(get("moe_intermediate_size") or 0),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        )
        if get("kv_lora_rank"):
            fields["head_dim"] = None  # MLA: no fused qkv
        if get("model_type") == "mixtral":
            fields.update(MIXTRAL_FIELDS)
            fields["moe_intermediate_size"] = int(get("intermediate_size") or 0)
            fields["intermediate_size"] = 0  # every layer is MoE: no dense MLP to check
        q = get("quantization_config") or {}

        def qget(key: str) -> Any:
            return q.get(key) if isinstance(q, Mapping) else getattr(q, key, None)

        block = qget("weight_block_size")
        if qget("quant_method") == "fp8" and block:
            fields["weight_block_size"] = (int(block[0]), int(block[1]))
        fields.update(parallel)
        return EngineConfig(**fields)


def expert_ids(num_experts: int, ep_size: int, ep_rank: int, placement: str = "linear") -> List[int]:
    """The global experts rank ``ep_rank`` of ``ep_size`` holds, in local order (vLLM's
    ``determine_expert_map``: ``linear`` gives the first ``E % ep`` ranks one more)."""
    if placement == "linear":
        base, rest = divmod(num_experts, ep_size)
        first = ep_rank * base + min(ep_rank, rest)
        return list(range(first, first + base + (1 if ep_rank < rest else 0)))
    if placement == "round_robin":
        return list(range(ep_rank, num_experts, ep_size))
    raise LayoutError(f"expert placement {placement!r} is not 'linear' or 'round_robin'")


# ------------------------------------------------------------------------------------------------

def _shape_dtype(name: str, obj: Any) -> Tuple[Tuple[int, ...], Any]:
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return tuple(int(s) for s in obj.shape), obj.dtype
    if isinstance(obj, (tuple, list)) and len(obj) == 2 and isinstance(obj[0], (tuple, list)):
        return tuple(int(s) for s in obj[0]), obj[1]
    raise LayoutError(f"vLLM parameter {name!r}: expected a tensor or (shape, dtype), got {obj!r}")


def _rule(config: EngineConfig, module: str, name: str) -> str:
    rule = config.sharding.get(module)
    if rule is None and (module.endswith("norm") or module.endswith("layernorm")):
        rule = "replicated"
    if rule is None:
        raise LayoutError(
            f"vLLM parameter {name!r}: no sharding rule for module {module!r} (add it to "
            "EngineConfig.sharding, or its fused parts to EngineConfig.packed_modules)")
    if rule not in _RULES:
        raise LayoutError(f"vLLM parameter {name!r}: unknown rule {rule!r} for {module!r} "
                          f"(one of {', '.join(_RULES)})")
    return rule


def _check_heads(config: EngineConfig, tp: int, name: str) -> None:
    if config.num_attention_heads % tp != 0:
        raise LayoutError(f"vLLM parameter {name!r}: TP {tp} does not divide num_attention_heads "
                          f"{config.num_attention_heads}")


def _kv_local(config: EngineConfig, tp: int, name: str) -> int:
    kv = config.kv_heads
    if tp >= kv:
        if tp % kv != 0:
            raise LayoutError(f"vLLM parameter {name!r}: TP {tp} exceeds num_key_value_heads {kv} "
                              "without being a multiple of it")
        return 1
    if kv % tp != 0:
        raise LayoutError(f"vLLM parameter {name!r}: TP {tp} does not divide num_key_value_heads {kv}")
    return kv // tp


def _place(rule: str, local: Tuple[int, ...], config: EngineConfig, tp: int, t: int,
           name: str) -> Tuple[Tuple[int, ...], Box]:
    """(global shape, tensor box) of a (part) tensor whose local block has shape ``local``."""
    if rule == "replicated" or not local:
        return local, Box.whole(local)
    if rule in ("heads", "row_heads"):
        _check_heads(config, tp, name)
    if rule in ("row", "row_heads"):
        if len(local) < 2:  # RowParallelLinear's bias is not split
            return local, Box.whole(local)
        glob = (local[0], local[1] * tp) + local[2:]
        return glob, Box((0, t * local[1]) + (0,) * len(local[2:]), local)
    if rule == "kv_heads":
        per = _kv_local(config, tp, name)
        kv = config.kv_heads
        if per == 1 and tp > kv:
            glob = (local[0] * kv,) + local[1:]
            head = t // (tp // kv)
            return glob, Box((head * local[0],) + (0,) * (len(local) - 1), local)
    if rule == "vocab":
        vocab = config.vocab_size
        if vocab <= 0:
            raise LayoutError(f"vLLM parameter {name!r}: a vocabulary-parallel tensor needs "
                              "EngineConfig.vocab_size")
        pad = config.vocab_padding
        padded = -(-vocab // pad) * pad
        if padded % tp != 0 or local[0] != padded // tp:
            raise LayoutError(
                f"vLLM parameter {name!r}: {local[0]} rows per rank, but a vocabulary of {vocab} "
                f"padded to {padded} (a multiple of {pad}) over TP {tp} gives "
                f"{padded / tp:g}")
        begin = min(vocab, t * local[0])
        end = min(vocab, begin + local[0])
        rows = end - begin
        return (vocab,) + local[1:], Box((begin,) + (0,) * (len(local) - 1), (rows,) + local[1:])
    # column, heads, kv_heads split over tp
    glob = (local[0] * tp,) + local[1:]
    return glob, Box((t * local[0],) + (0,) * (len(local) - 1), local)


def _part_rows(parts: Sequence[str], rules: Sequence[str], rows: int, config: EngineConfig,
               tp: int, name: str) -> List[int]:
    """Rows (dim 0) of each part of a fused buffer of ``rows`` rows."""
    heads: List[Optional[int]] = []
    for part, rule in zip(parts, rules):
        if rule == "heads":
            _check_heads(config, tp, name)
            heads.append(config.num_attention_heads // tp)
        elif rule == "kv_heads":
            heads.append(_kv_local(config, tp, name))
        else:
            heads.append(None)
    out: List[Optional[int]] = [None] * len(parts)
    known_heads = sum(h for h in heads if h is not None)
    if known_heads:
        hd = config.head_dim
        if hd is None:
            if any(h is None for h in heads) or rows % known_heads != 0:
                raise LayoutError(f"vLLM parameter {name!r}: cannot infer head_dim from {rows} rows "
                                  f"and {known_heads} local heads; set EngineConfig.head_dim")
            hd = rows // known_heads
        for i, h in enumerate(heads):
            if h is not None:
                out[i] = h * int(hd)
    for i, part in enumerate(parts):
        if part == "q_a_proj" and out[i] is None:
            if not config.q_lora_rank:
                raise LayoutError(f"vLLM parameter {name!r}: fused {part} needs EngineConfig.q_lora_rank")
            out[i] = config.q_lora_rank
    rest = rows - sum(r for r in out if r is not None)
    unknown = [i for i, r in enumerate(out) if r is None]
    if unknown:
        if rest < 0 or rest % len(unknown) != 0:
            raise LayoutError(f"vLLM parameter {name!r}: {rows} rows do not split into its parts "
                              f"{list(parts)}")
        for i in unknown:
            out[i] = rest // len(unknown)
    total = sum(r or 0 for r in out)
    if total != rows:
        raise LayoutError(f"vLLM parameter {name!r}: parts {list(parts)} need {total} rows but "
                          f"the buffer has {rows}")
    return [int(r or 0) for r in out]


def _rows_box(shape: Sequence[int], begin: int, rows: int, dim: int = 0) -> Box:
    origin = [0] * len(shape)
    size = list(shape)
    origin[dim] = begin
    size[dim] = rows
    return Box(tuple(origin), tuple(size))


def _hf(config: EngineConfig, path: str) -> str:
    return config.name_map(path) if config.name_map else path


def engine_worker(params: Any, config: EngineConfig, *, placement: RankPlacement = RankPlacement(),
                  node: Optional[int] = None, gpu: Optional[int] = None,
                  worker_name: Union[str, Callable[[int, int], str]] = "vllm-dp{dp}-tp{tp}",
                  skip: Optional[Callable[[str], bool]] = None, model: str = "") -> Dict[str, Any]:
    """One vLLM rank's worker as a one-worker layout dict (see the module's docstring).

    ``params``: ``model.named_parameters()``, a module, or ``{vLLM name: tensor | (shape, dtype)}``.
    ``skip(name)`` True leaves a parameter out (e.g. one refit must not touch). ``node``/``gpu``
    default to ``placement.where(config.rank)``.
    """
    named = named_items(params)
    if not 0 <= config.tp_rank < config.tp_size or not 0 <= config.dp_rank < config.dp_size:
        raise LayoutError(f"engine rank tp {config.tp_rank}/{config.tp_size}, dp "
                          f"{config.dp_rank}/{config.dp_size} does not exist")
    where = placement.where(config.rank)
    node = where[0] if node is None else node
    gpu = where[1] if gpu is None else gpu
    wname = worker_name(config.dp_rank, config.tp_rank) if callable(worker_name) else \
        worker_name.format(dp=config.dp_rank, tp=config.tp_rank, rank=config.rank)
    b = LayoutBuilder(model)
    w = b.worker(wname, node, gpu)
    w["replica"], w["replicaRank"], w["replicaSize"] = config.replica()
    # Tied by identity only for tensors: equal (shape, dtype) tuples may be one constant object.
    embed = {id(obj) for n, obj in named if n.endswith("embed_tokens.weight") and hasattr(obj, "shape")}
    placed: Dict[str, List[Tuple[str, Tuple[int, ...], Box, Box]]] = {}  # weight -> its pieces
    scales: List[Tuple[str, Tuple[int, ...], Any]] = []
    for name, obj in named:
        if skip is not None and skip(name):
            continue
        module_path, _, leaf = name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        tied = config.tie_word_embeddings or (hasattr(obj, "shape") and id(obj) in embed)
        if module == "lm_head" and tied:
            continue  # tied: the embedding's storage, no tensor of its own
        shape, dtype = _shape_dtype(name, obj)
        if leaf == "weight_scale_inv" or (module == "experts" and leaf.endswith("_scale_inv")
                                          and leaf[:-len("_scale_inv")] in config.expert_modules):
            scales.append((name, shape, dtype))  # after every weight: placed at its weight's blocks
            continue
        quant = _quantization(config, name, dtype)
        if module == "experts" and leaf in config.expert_modules:
            placed[name] = _add_experts(b, w, name, parent, leaf, shape, dtype, config, quant)
            continue
        if leaf not in _LEAVES:
            raise LayoutError(f"vLLM parameter {name!r}: leaf {leaf!r} is not a weight or bias "
                              "(per-tensor quantization scales and other state are not placed; leave it "
                              "out with skip=; block fp8's weight_scale_inv is)")
        parts = list(config.packed_modules.get(module, [module]))
        rules = [_rule(config, p, name) for p in parts]
        tp, t = config.tp_size, config.tp_rank
        buf = b.buffer(w, name, dtype, shape)
        pieces = placed[name] = []
        if len(parts) == 1:
            glob, box = _place(rules[0], shape, config, tp, t, name)
            hf = _hf(config, module_path) + "." + leaf
            b.tensor(hf, glob, dtype, what=f"vLLM parameter {name!r}", quantization=quant and quant(hf))
            buffer_box = Box((0,) * len(shape), box.shape)
            b.piece(buf, hf, box, buffer_box)
            pieces.append((hf, glob, box, buffer_box))
            continue
        if not shape:
            raise LayoutError(f"vLLM parameter {name!r}: a fused parameter cannot be a scalar")
        rows = _part_rows(parts, rules, shape[0], config, tp, name)
        if module == "gate_up_proj" and config.intermediate_size and parent.endswith(".mlp") \
                and shape[0] * tp != 2 * config.intermediate_size:
            raise LayoutError(f"vLLM parameter {name!r}: {shape[0]} rows on TP {tp}, but "
                              f"intermediate_size {config.intermediate_size} gives "
                              f"{2 * config.intermediate_size / tp:g}")
        offset = 0
        for part, rule, n in zip(parts, rules, rows):
            local = (n,) + shape[1:]
            glob, box = _place(rule, local, config, tp, t, name)
            hf = _hf(config, f"{parent}.{part}" if parent else part) + "." + leaf
            b.tensor(hf, glob, dtype, what=f"vLLM parameter {name!r}", quantization=quant and quant(hf))
            b.piece(buf, hf, box, _rows_box(shape, offset, n))
            pieces.append((hf, glob, box, _rows_box(shape, offset, n)))
            offset += n
    for name, shape, dtype in scales:
        _add_scales(b, w, name, shape, dtype, placed, config)
    return b.build()


def _quantization(config: EngineConfig, name: str, dtype: Any) -> Optional[Callable[[str], Dict[str, Any]]]:
    """For an fp8 weight parameter: hf name -> its quantization; else None."""
    if dtype_name(dtype) != "fp8_e4m3":
        return None
    if not config.weight_block_size:
        raise LayoutError(
            f"vLLM parameter {name!r} is float8_e4m3fn: set EngineConfig.weight_block_size (the model's "
            "quantization_config.weight_block_size; per-tensor fp8 is not quantized on the way)")
    block = [int(x) for x in config.weight_block_size]
    return lambda hf: {"format": "block_fp8", "block": block, "scale": hf + "_scale_inv"}


def _add_scales(b: LayoutBuilder, w: Dict[str, Any], name: str, shape: Tuple[int, ...], dtype: Any,
                placed: Mapping[str, List[Tuple[str, Tuple[int, ...], Box, Box]]],
                config: EngineConfig) -> None:
    """A ``weight_scale_inv`` parameter: each part of its weight's scale tensor at its blocks."""
    weight = name[:-len("_scale_inv")]
    if weight not in placed or not config.weight_block_size:
        raise LayoutError(f"vLLM parameter {name!r}: the scales of {weight!r}, which is not an fp8 "
                          "weight of this rank (or EngineConfig.weight_block_size is not set)")
    br, bc = (int(x) for x in config.weight_block_size)
    blk = (br, bc)
    buf = b.buffer(w, name, dtype, shape)
    for hf, glob, box, bbox in placed[weight]:
        if len(glob) != 2:
            raise LayoutError(f"vLLM parameter {name!r}: {hf!r} of shape {list(glob)} is not a 2-D weight")
        t_origin, t_shape = list(box.origin), list(box.shape)
        b_origin, b_shape = list(bbox.origin), list(bbox.shape)
        lead = len(b_origin) - 2
        for d in range(2):
            end = t_origin[d] + t_shape[d]
            bend = b_origin[lead + d] + b_shape[lead + d]
            if t_origin[d] % blk[d] or b_origin[lead + d] % blk[d] or (end % blk[d] and end != glob[d]):
                raise LayoutError(
                    f"vLLM parameter {name!r}: {hf!r} rows/cols {t_origin[d]}:{end} cut a {br}x{bc} block "
                    "(vLLM requires each partition to hold whole blocks)")
            t_origin[d], t_shape[d] = t_origin[d] // blk[d], -(-end // blk[d]) - t_origin[d] // blk[d]
            b_origin[lead + d], b_shape[lead + d] = b_origin[lead + d] // blk[d], \
                -(-bend // blk[d]) - b_origin[lead + d] // blk[d]
        grid = (-(-glob[0] // br), -(-glob[1] // bc))
        b.tensor(hf + "_scale_inv", grid, dtype, what=f"vLLM parameter {name!r}")
        b.piece(buf, hf + "_scale_inv", Box(tuple(t_origin), tuple(t_shape)), Box(tuple(b_origin), tuple(b_shape)))


def _add_experts(b: LayoutBuilder, w: Dict[str, Any], name: str, parent: str, leaf: str,
                 shape: Tuple[int, ...], dtype: Any, config: EngineConfig,
                 quant: Optional[Callable[[str], Dict[str, Any]]] = None
                 ) -> List[Tuple[str, Tuple[int, ...], Box, Box]]:
    if config.num_experts <= 0:
        raise LayoutError(f"vLLM parameter {name!r}: stacked experts need EngineConfig.num_experts")
    if len(shape) < 2:
        raise LayoutError(f"vLLM parameter {name!r}: stacked experts need a leading expert dim, "
                          f"not shape {shape}")
    ep_size, ep_rank = config.ep()
    tp, t = config.moe_tp()
    experts = expert_ids(config.num_experts, ep_size, ep_rank, config.expert_placement)
    if shape[0] != len(experts):
        raise LayoutError(
            f"vLLM parameter {name!r}: holds {shape[0]} experts, but {config.num_experts} experts "
            f"over EP {ep_size} give rank {ep_rank} {len(experts)}")
    parts = list(config.expert_modules[leaf])
    rules = [_rule(config, p, name) for p in parts]
    inner = shape[1:]
    # Parts stack on the first weight dim (w13: gate then up) and split equally.
    if inner[0] % len(parts) != 0:
        raise LayoutError(f"vLLM parameter {name!r}: dim 1 ({inner[0]}) does not split into {parts}")
    n = inner[0] // len(parts)
    if config.moe_intermediate_size:
        per = n if _EXPERT_KIND.get(rules[0], rules[0]) == "column" else inner[-1]
        if per * tp != config.moe_intermediate_size:
            raise LayoutError(
                f"vLLM parameter {name!r}: {per} intermediate rows per rank on expert TP {tp}, but "
                f"moe_intermediate_size {config.moe_intermediate_size} gives "
                f"{config.moe_intermediate_size / tp:g}")
    buf = b.buffer(w, name, dtype, shape)
    kinds = [_EXPERT_KIND.get(r, r) for r in rules]
    for part, kind in zip(parts, kinds):
        if kind not in ("column", "row", "replicated"):
            raise LayoutError(f"vLLM parameter {name!r}: expert part {part!r} has rule {kind!r}; "
                              "experts take column, row or replicated")
    pieces = []
    for i, e in enumerate(experts):
        offset = 0
        for part, kind in zip(parts, kinds):
            local = (n,) + inner[1:]
            glob, box = _place(kind, local, config, tp, t, name)
            hf = _hf(config, f"{parent}.experts.{e}.{part}") + ".weight"
            b.tensor(hf, glob, dtype, what=f"vLLM parameter {name!r}", quantization=quant and quant(hf))
            bbox = Box((i, offset) + (0,) * (len(inner) - 1), (1, n) + inner[1:])
            b.piece(buf, hf, box, bbox)
            pieces.append((hf, glob, box, bbox))
            offset += n
    return pieces


def engine_layout(params_of: Callable[[int, int], Any], config: EngineConfig, *,
                  placement: RankPlacement = RankPlacement(), model: str = "",
                  **kwargs: Any) -> Dict[str, Any]:
    """The whole engine: ``engine_worker(params_of(dp_rank, tp_rank), config.for_rank(...))`` for
    every rank, ranks ordered ``d * tp_size + t``."""
    b = LayoutBuilder(model)
    for d in range(config.dp_size):
        for t in range(config.tp_size):
            b.add_layout(engine_worker(params_of(d, t), config.for_rank(d, t), placement=placement,
                                       **kwargs))
    return b.build()
