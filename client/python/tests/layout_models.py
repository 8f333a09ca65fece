"""Test helpers for refit.layouts: the tools (refit-plan, refit-layout), real model configs, and the
parameters real frameworks would hold for them.

`vllm_params` writes, for one vLLM rank, the parameter names and local shapes vLLM's modules
create (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
FusedMoE with FusedMoEParallelConfig's flattening, DeepSeek's MLA modules), from the model's
config.json, following vLLM's code rather than refit's generator, so that comparing
refit.layouts' result with refit-layout's tests both.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Optional, Tuple

_REPO = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------------------------------------------
# Tools and files.

def _runfiles_root() -> Optional[Path]:
    srcdir = os.environ.get("TEST_SRCDIR")
    return Path(srcdir) / "refit" if srcdir else None


def tool(name: str) -> str:
    """Path of refit-plan / refit-layout: $REFIT_BIN_DIR, Bazel's runfiles, then bazel-bin."""
    candidates = []
    if os.environ.get("REFIT_BIN_DIR"):
        candidates.append(Path(os.environ["REFIT_BIN_DIR"]) / name)
    root = _runfiles_root()
    if root:
        candidates.append(root / "client" / "tools" / name)
    candidates.append(_REPO / "bazel-bin" / "client" / "tools" / name)
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise FileNotFoundError(f"{name} not found in {[str(c) for c in candidates]}; build it with "
                            f"bazel build //client:{name} or set REFIT_BIN_DIR")


def config_path(model: str) -> str:
    for root in (_runfiles_root(), _REPO):
        if root and (root / "tests" / "configs" / f"{model}.json").is_file():
            return str(root / "tests" / "configs" / f"{model}.json")
    raise FileNotFoundError(f"tests/configs/{model}.json")


_TMP = tempfile.mkdtemp(prefix="refit-layouts-")


def _write(layout: dict, stem: str) -> str:
    fd, path = tempfile.mkstemp(prefix=stem, suffix=".json", dir=_TMP)
    with os.fdopen(fd, "w") as f:
        json.dump(layout, f)
    return path


def write_config(config: dict) -> str:
    """A config.json in a temporary directory (removed at exit with the others)."""
    return _write(config, "config")


def plan_verify(src: dict, dst: dict) -> Tuple[int, str]:
    """Runs ``refit-plan --src --dst --verify``: (exit code, output)."""
    s, d = _write(src, "src"), _write(dst, "dst")
    try:
        r = subprocess.run([tool("refit-plan"), "--src", s, "--dst", d, "--verify"],
                           capture_output=True, text=True, timeout=120)
        return r.returncode, r.stdout + r.stderr
    finally:
        os.unlink(s)
        os.unlink(d)


def refit_layout(model: str, *args: str) -> dict:
    """refit-layout's JSON for tests/configs/<model>.json (or a config.json path) and the flags."""
    path = model if model.endswith(".json") else config_path(model)
    r = subprocess.run([tool("refit-layout"), "--config", path, *args],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"refit-layout {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return json.loads(r.stdout)


def refit_layout_has_flag(flag: str) -> bool:
    r = subprocess.run([tool("refit-layout"), "--help"], capture_output=True, text=True, timeout=60)
    return f"--{flag}" in (r.stdout + r.stderr)


# ------------------------------------------------------------------------------------------------
# Model configs (the fields of client/models/model_config.cc, parsed again here).

@dataclass(frozen=True)
class Model:
    model_type: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    layers: int
    vocab: int
    tie: bool
    bias: bool
    qk_norm: bool
    experts: int = 0
    moe_inter: int = 0
    n_shared: int = 0
    shared_inter: int = 0
    first_dense: int = 0
    moe_freq: int = 1
    sparse_step: int = 1
    mlp_only: Tuple[int, ...] = ()
    router_bias: bool = False
    q_lora: int = 0
    kv_lora: int = 0
    nope: int = 0
    rope: int = 0
    v_head: int = 0
    dtype: str = "bf16"

    def is_moe(self, layer: int) -> bool:
        # DeepSeek: first_k_dense_replace, moe_layer_freq; Qwen-MoE (vLLM's Qwen3MoeDecoderLayer):
        # not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0.
        return (self.experts > 0 and layer >= self.first_dense
                and (self.moe_freq <= 1 or layer % self.moe_freq == 0)
                and (self.sparse_step <= 1 or (layer + 1) % self.sparse_step == 0)
                and layer not in self.mlp_only)

    @property
    def mla(self) -> bool:
        return self.kv_lora > 0

    @property
    def mixtral(self) -> bool:
        """Mixtral: block_sparse_moe with experts' w1 (gate), w2 (down), w3 (up), every layer MoE."""
        return self.model_type == "mixtral"

    @property
    def moe_module(self) -> str:
        return "block_sparse_moe." if self.mixtral else "mlp."


def load_model(name: str, scale_down: int = 1, layers: int = 0) -> Model:
    """tests/configs/<name>.json, widths divided by ``scale_down`` (at least 1 left), at most
    ``layers`` layers: refit-layout's --scale-down and --layers."""
    return model_from_config(json.loads(Path(config_path(name)).read_text()), scale_down, layers)


def model_from_config(c: dict, scale_down: int = 1, layers: int = 0) -> Model:
    """A Model from a config.json dict (see load_model)."""
    mt = c.get("model_type", "")
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    m = Model(
        model_type=mt, hidden=hidden, heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        inter=int(c.get("intermediate_size") or 0), layers=int(c["num_hidden_layers"]),
        vocab=int(c["vocab_size"]), tie=bool(c.get("tie_word_embeddings", False)),
        bias=bool(c.get("attention_bias", mt in ("qwen2", "qwen2_moe"))),
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        experts=int(c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0),
        moe_inter=int(c.get("intermediate_size") if mt == "mixtral" else c.get("moe_intermediate_size") or 0),
        n_shared=int(c.get("n_shared_experts") or 0),
        shared_inter=int(c.get("shared_expert_intermediate_size") or 0),
        first_dense=int(c.get("first_k_dense_replace") or 0),
        moe_freq=int(c.get("moe_layer_freq") or 1),
        sparse_step=int(c.get("decoder_sparse_step") or 1),
        mlp_only=tuple(int(x) for x in c.get("mlp_only_layers") or ()),
        router_bias=c.get("topk_method") == "noaux_tc",
        q_lora=int(c.get("q_lora_rank") or 0), kv_lora=int(c.get("kv_lora_rank") or 0),
        nope=int(c.get("qk_nope_head_dim") or 0), rope=int(c.get("qk_rope_head_dim") or 0),
        v_head=int(c.get("v_head_dim") or 0))
    if scale_down > 1:
        s = lambda v: max(1, v // scale_down) if v > 0 else v  # noqa: E731
        m = replace(m, hidden=s(m.hidden), head_dim=s(m.head_dim), inter=s(m.inter),
                    moe_inter=s(m.moe_inter), shared_inter=s(m.shared_inter), vocab=s(m.vocab),
                    q_lora=s(m.q_lora), kv_lora=s(m.kv_lora), nope=s(m.nope), rope=s(m.rope),
                    v_head=s(m.v_head))
    if layers > 0:
        m = replace(m, layers=min(m.layers, layers))
    return replace(m, first_dense=min(m.first_dense, m.layers))


def hf_config(m: Model) -> dict:
    """The (scaled) model as a Hugging Face config dict, for EngineConfig.from_hf_config."""
    d = {"model_type": m.model_type, "hidden_size": m.hidden, "num_attention_heads": m.heads,
         "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "vocab_size": m.vocab,
         "intermediate_size": m.inter, "tie_word_embeddings": m.tie,
         "num_hidden_layers": m.layers, "moe_intermediate_size": m.moe_inter}
    if m.mixtral:
        d["num_local_experts"] = m.experts
    elif m.experts:
        d["num_experts"] = m.experts
    if m.mla:
        d.update(kv_lora_rank=m.kv_lora, q_lora_rank=m.q_lora or None)
    return d


# ------------------------------------------------------------------------------------------------
# Hugging Face tensors (what a trainer holding the HF module tree has).

def hf_tensors(m: Model) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """{Hugging Face name: (shape, dtype)} of the whole model, in checkpoint order."""
    H = m.hidden
    out: Dict[str, Tuple[Tuple[int, ...], str]] = {}

    def add(name: str, *shape: int, dtype: str = m.dtype) -> None:
        out[name] = (tuple(shape), dtype)

    def mlp(p: str, inter: int) -> None:
        add(p + "gate_proj.weight", inter, H)
        add(p + "up_proj.weight", inter, H)
        add(p + "down_proj.weight", H, inter)

    def expert(p: str, inter: int) -> None:
        if not m.mixtral:
            return mlp(p, inter)
        add(p + "w1.weight", inter, H)
        add(p + "w2.weight", H, inter)
        add(p + "w3.weight", inter, H)

    add("model.embed_tokens.weight", m.vocab, H)
    for layer in range(m.layers):
        p = f"model.layers.{layer}."
        add(p + "input_layernorm.weight", H)
        a = p + "self_attn."
        if m.mla:
            qk = m.nope + m.rope
            if m.q_lora:
                add(a + "q_a_proj.weight", m.q_lora, H)
                add(a + "q_a_layernorm.weight", m.q_lora)
                add(a + "q_b_proj.weight", m.heads * qk, m.q_lora)
            else:
                add(a + "q_proj.weight", m.heads * qk, H)
            add(a + "kv_a_proj_with_mqa.weight", m.kv_lora + m.rope, H)
            add(a + "kv_a_layernorm.weight", m.kv_lora)
            add(a + "kv_b_proj.weight", m.heads * (m.nope + m.v_head), m.kv_lora)
            add(a + "o_proj.weight", H, m.heads * m.v_head)
        else:
            hd = m.head_dim
            add(a + "q_proj.weight", m.heads * hd, H)
            add(a + "k_proj.weight", m.kv_heads * hd, H)
            add(a + "v_proj.weight", m.kv_heads * hd, H)
            if m.bias:
                add(a + "q_proj.bias", m.heads * hd)
                add(a + "k_proj.bias", m.kv_heads * hd)
                add(a + "v_proj.bias", m.kv_heads * hd)
            if m.qk_norm:
                add(a + "q_norm.weight", hd)
                add(a + "k_norm.weight", hd)
            add(a + "o_proj.weight", H, m.heads * hd)
        add(p + "post_attention_layernorm.weight", H)
        if not m.is_moe(layer):
            mlp(p + "mlp.", m.inter)
            continue
        moe = p + m.moe_module
        add(moe + "gate.weight", m.experts, H)
        if m.router_bias:
            add(moe + "gate.e_score_correction_bias", m.experts)
        for e in range(m.experts):
            expert(f"{moe}experts.{e}.", m.moe_inter)
        if m.n_shared:
            mlp(p + "mlp.shared_experts.", m.n_shared * m.moe_inter)
        if m.shared_inter:
            mlp(p + "mlp.shared_expert.", m.shared_inter)
            add(p + "mlp.shared_expert_gate.weight", 1, H)
    add("model.norm.weight", H)
    if not m.tie:
        add("lm_head.weight", m.vocab, H)
    return out


# ------------------------------------------------------------------------------------------------
# vLLM's parameters on one rank.

def _divide(a: int, b: int, what: str) -> int:
    assert a % b == 0, f"vLLM: {what}: {a} is not divisible by {b}"
    return a // b


def vllm_params(m: Model, tp: int = 1, tp_rank: int = 0, dp: int = 1, dp_rank: int = 0,
                expert_parallel: bool = False) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """{vLLM parameter name: (local shape, dtype)} of rank (dp_rank, tp_rank), as vLLM builds it."""
    H, dt = m.hidden, m.dtype
    out: Dict[str, Tuple[Tuple[int, ...], str]] = {}

    def add(name: str, *shape: int, dtype: str = dt) -> None:
        out[name] = (tuple(shape), dtype)

    padded = -(-m.vocab // 64) * 64  # pad_vocab_size(vocab, DEFAULT_VOCAB_PADDING_SIZE)
    per_vocab = _divide(padded, tp, "num_embeddings_padded")
    heads_t = _divide(m.heads, tp, "num_heads")
    if tp >= m.kv_heads:
        _divide(tp, m.kv_heads, "num_kv_head_replicas")
        kv_t = 1
    else:
        kv_t = _divide(m.kv_heads, tp, "num_kv_heads")
    # FusedMoEParallelConfig.make: tp flattened across dp; with EP, ep over it and tp 1.
    flat_tp, flat_rank = dp * tp, dp_rank * tp + tp_rank
    moe_tp, ep = (1, flat_tp) if expert_parallel else (flat_tp, 1)
    ep_rank = flat_rank if expert_parallel else 0
    if m.experts:
        base, rest = divmod(m.experts, ep)
        local_experts = base + (1 if ep_rank < rest else 0)

    def dense_mlp(p: str, inter: int) -> None:
        i_t = _divide(inter, tp, "intermediate_size")
        add(p + "gate_up_proj.weight", 2 * i_t, H)
        add(p + "down_proj.weight", H, i_t)

    add("model.embed_tokens.weight", per_vocab, H)
    for layer in range(m.layers):
        p = f"model.layers.{layer}."
        add(p + "input_layernorm.weight", H)
        a = p + "self_attn."
        if m.mla:
            qk = m.nope + m.rope
            if m.q_lora:
                add(a + "fused_qkv_a_proj.weight", m.q_lora + m.kv_lora + m.rope, H)
                add(a + "q_a_layernorm.weight", m.q_lora)
                add(a + "q_b_proj.weight", heads_t * qk, m.q_lora)
            else:
                add(a + "q_proj.weight", heads_t * qk, H)
                add(a + "kv_a_proj_with_mqa.weight", m.kv_lora + m.rope, H)
            add(a + "kv_a_layernorm.weight", m.kv_lora)
            add(a + "kv_b_proj.weight", heads_t * (m.nope + m.v_head), m.kv_lora)
            add(a + "o_proj.weight", H, heads_t * m.v_head)
        else:
            hd = m.head_dim
            add(a + "qkv_proj.weight", (heads_t + 2 * kv_t) * hd, H)
            if m.bias:
                add(a + "qkv_proj.bias", (heads_t + 2 * kv_t) * hd)
            if m.qk_norm:
                add(a + "q_norm.weight", hd)
                add(a + "k_norm.weight", hd)
            add(a + "o_proj.weight", H, heads_t * hd)
        add(p + "post_attention_layernorm.weight", H)
        if not m.is_moe(layer):
            dense_mlp(p + "mlp.", m.inter)
            continue
        moe = p + m.moe_module
        add(moe + "gate.weight", m.experts, H)
        if m.router_bias:
            add(moe + "gate.e_score_correction_bias", m.experts, dtype="fp32")
        i_t = _divide(m.moe_inter, moe_tp, "moe intermediate_size_per_partition")
        add(moe + "experts.w13_weight", local_experts, 2 * i_t, H)
        add(moe + "experts.w2_weight", local_experts, H, i_t)
        if m.n_shared:
            dense_mlp(p + "mlp.shared_experts.", m.n_shared * m.moe_inter)
        if m.shared_inter:
            dense_mlp(p + "mlp.shared_expert.", m.shared_inter)
            add(p + "mlp.shared_expert_gate.weight", 1, H)
    add("model.norm.weight", H)
    if not m.tie:
        add("lm_head.weight", per_vocab, H)
    return out


# ------------------------------------------------------------------------------------------------
# Trainer parameters as DTensor specs.

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj", "w1", "w3")
ROW = ("o_proj", "down_proj", "w2")


def tp_placement(name: str) -> Optional[str]:
    """The Megatron/torch-TP placement of a Hugging Face tensor on the TP mesh dim."""
    module = name.rsplit(".", 2)[-2]
    leaf = name.rsplit(".", 1)[-1]
    if module in COLUMN:
        return "S(0)"
    if module in ROW:
        return "S(1)" if leaf == "weight" else "R"
    if module in ("embed_tokens", "lm_head"):
        return "S(0)"
    return None  # replicated


def _part(n: int, parts: int, i: int) -> Tuple[int, int]:
    """Megatron's split of layers over stages (the first stages take the remainder)."""
    base, rest = divmod(n, parts)
    begin = i * base + min(i, rest)
    return begin, begin + base + (1 if i < rest else 0)


def _layer_of(name: str, m: Model) -> int:
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    return -1 if "embed_tokens" in name else m.layers


def megatron_specs(m: Model, tp: int = 1, dp: int = 1, pp: int = 1, ep: int = 1) -> dict:
    """{Hugging Face name: ParamSpec} of a Megatron-style trainer told as DTensors: each stage's
    parameters on a (dp, tp) mesh of its ranks (rank = t + tp * (d + dp * stage)), Replicate over
    dp and the TP placement of ``tp_placement``; expert e on the (dp / ep, tp) mesh of the data
    ranks d with d % ep == its expert rank. DeepSeek's router bias is fp32, as Megatron's
    TopKRouter keeps its expert_bias."""
    from refit.layouts import Mesh, ParamSpec
    specs = {}
    for name, (shape, dtype) in hf_tensors(m).items():
        if name.endswith("e_score_correction_bias"):
            dtype = "fp32"
        layer = _layer_of(name, m)
        stage = 0 if layer < 0 else pp - 1 if layer >= m.layers else next(
            s for s in range(pp) if _part(m.layers, pp, s)[0] <= layer < _part(m.layers, pp, s)[1])
        ds = list(range(dp))
        if ".experts." in name:
            e = int(name.split(".experts.")[1].split(".")[0])
            k = next(k for k in range(ep) if _part(m.experts, ep, k)[0] <= e < _part(m.experts, ep, k)[1])
            ds = [d for d in ds if d % ep == k]
        ranks = [[t + tp * (d + dp * stage) for t in range(tp)] for d in ds]
        specs[name] = ParamSpec(shape, dtype, ["R", tp_placement(name) or "R"],
                                Mesh((len(ds), tp), ranks))
    return specs


def fsdp2_specs(m: Model, shards: int, dp: int = 1, replicated=lambda name: False) -> dict:
    """{Hugging Face name: ParamSpec} of fully_shard over ``shards`` ranks, ``dp`` replicas (HSDP:
    mesh (dp, shards), rank = replica * shards + shard); ``replicated(name)`` marks module buffers,
    which FSDP leaves whole on every rank."""
    from refit.layouts import ParamSpec
    return {n: ParamSpec(s, d, None if replicated(n) else ["R", "S(0)"])
            for n, (s, d) in hf_tensors(m).items()}
