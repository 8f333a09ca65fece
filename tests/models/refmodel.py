"""Reference models for refit's model tests, pure torch (torch 1.13 and 2.x).

* ``RefModel``: an inference model in vLLM's conventions (what refit's engine layouts describe):
  fused ``self_attn.qkv_proj`` (q, k, v rows stacked, optional bias), fused ``mlp.gate_up_proj``,
  MoE layers with a router ``mlp.gate`` and stacked experts ``mlp.experts.w13_weight``
  ``[E, 2I, H]`` (gate rows then up rows) and ``mlp.experts.w2_weight`` ``[E, H, I]``, the
  vocabulary padded to a multiple of 64 (``embed_tokens``/``lm_head`` rows past the real vocabulary
  stay zero and are never sampled), tied embeddings (no ``lm_head`` parameter). TP=1. It runs its
  own forward on those fused parameters in one of two modes:
    - ``"vllm"``: one GEMM per fused parameter (qkv, gate_up, each expert's w13, the padded head),
      as vLLM computes;
    - ``"hf"``: the same parameters, but the GEMMs split as Hugging Face's modules split them
      (views of the fused buffers: q, k, v and gate, up separately; the head's real rows), so that
      the arithmetic is Hugging Face's, op for op.
  Everything else (RMSNorm in fp32, RoPE computed on the CPU in fp32 and cast, eager attention with
  repeat_kv and an fp32 softmax, the MoE routing and its expert loop with index_add_) follows
  transformers' code (LlamaRMSNorm, LlamaRotaryEmbedding, eager_attention_forward,
  Qwen3MoeSparseMoeBlock / Qwen3MoeExperts, MixtralTopKRouter's fp32 routing weights).
  DeepSeek-V2/V3 and Kimi-K2 (``ModelSpec.deepseek``): multi-head latent attention
  (``self_attn.fused_qkv_a_proj`` = [q_a_proj; kv_a_proj_with_mqa] when q_lora_rank is set, else
  ``q_proj`` and ``kv_a_proj_with_mqa``; ``q_a_layernorm``, ``kv_a_layernorm``, ``kv_b_proj``,
  ``o_proj``), the first ``first_k_dense_replace`` layers dense, ``mlp.shared_experts.gate_up_proj``
  / ``down_proj`` beside the routed experts, and DeepSeek's routers (``mlp.gate.weight``, V3's fp32
  ``e_score_correction_bias``), after transformers 4.5x's DeepseekV3Attention / DeepseekV3MoE.
* ``Twin``: the trainer side's stand-in where transformers is absent (CPU CI): the same
  architectures with Hugging Face's module names and separate projections
  (``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``gate_proj``/``up_proj``/``down_proj``, experts
  either per expert ``mlp.experts.<e>.gate_proj.weight`` (transformers 4, checkpoints) or fused
  ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` (transformers 5)).
* ``fused_experts_to_checkpoint``: rewrites a trainer layout whose experts are fused parameters
  (transformers 5) into pieces of the per-expert checkpoint tensors that engine layouts name.

Numbers only, no I/O; ``ModelSpec.from_config`` reads a Hugging Face config (dict or object).
"""
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_PADDING = 64
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3",
                         "kimi_k2")


def _get(cfg, key, default=None):
    if isinstance(cfg, dict):
        v = cfg.get(key, default)
    else:
        v = getattr(cfg, key, default)
    return default if v is None else v


class ModelSpec:
    """What both sides' forward passes need, from a Hugging Face config (dict or object).
    ``overrides`` (what the live trainer model reports: biases present, experts' naming, the rope
    base it really uses) win over the config's fields."""

    def __init__(self, cfg, **overrides):
        self.model_type = _get(cfg, "model_type", "llama")
        self.hidden = int(_get(cfg, "hidden_size"))
        self.layers = int(_get(cfg, "num_hidden_layers"))
        self.heads = int(_get(cfg, "num_attention_heads"))
        self.kv_heads = int(_get(cfg, "num_key_value_heads", self.heads))
        self.head_dim = int(_get(cfg, "head_dim", self.hidden // self.heads))
        self.intermediate = int(_get(cfg, "intermediate_size", 0))
        self.vocab = int(_get(cfg, "vocab_size"))
        self.eps = float(_get(cfg, "rms_norm_eps", 1e-6))
        rope = _get(cfg, "rope_parameters", None) or {}
        self.rope_theta = float(_get(cfg, "rope_theta", rope.get("rope_theta", 10000.0)
                                     if isinstance(rope, dict) else 10000.0))
        self.tied = bool(_get(cfg, "tie_word_embeddings", False))
        mt = self.model_type
        self.qkv_bias = bool(_get(cfg, "attention_bias", False)) or mt == "qwen2"
        self.o_bias = bool(_get(cfg, "attention_bias", False)) and mt != "qwen2"
        self.qk_norm = mt in ("qwen3", "qwen3_moe")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {mt!r}: the reference models reproduce "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        self.deepseek = mt in ("deepseek_v2", "deepseek_v3", "kimi_k2")
        # Routed experts: Qwen's num_experts, DeepSeek's n_routed_experts, Mixtral's num_local_experts.
        self.experts = int(_get(cfg, "num_experts", 0) or _get(cfg, "n_routed_experts", 0)
                           or _get(cfg, "num_local_experts", 0) or 0)
        self.top_k = int(_get(cfg, "num_experts_per_tok", 0) or 0)
        self.norm_topk = bool(_get(cfg, "norm_topk_prob", mt == "mixtral"))
        self.moe_intermediate = int(_get(cfg, "moe_intermediate_size", 0) or self.intermediate)
        self.experts_style = "per_expert"  # the trainer's naming: "per_expert" or "fused"
        # Whether the router's top-k weights stay fp32 when they scale the experts' outputs
        # (transformers 5's MixtralTopKRouter returns them fp32; Qwen-MoE's, and transformers 4's
        # blocks, cast them to the hidden dtype first). The trainer reports what its model does.
        self.router_weights_fp32 = mt == "mixtral"
        # Mixtral/Mistral attend within a sliding window when the config sets one.
        window = _get(cfg, "sliding_window", None) if mt == "mixtral" else None
        self.sliding_window = int(window) if window else 0
        # DeepSeek (V2, V3, Kimi-K2): multi-head latent attention, the first k layers dense, shared
        # experts beside the routed ones, and DeepSeek's routers.
        self.first_dense = int(_get(cfg, "first_k_dense_replace", 0)) if self.deepseek else 0
        self.n_shared = int(_get(cfg, "n_shared_experts", 0)) if self.deepseek else 0
        self.q_lora = int(_get(cfg, "q_lora_rank", 0) or 0)
        self.kv_lora = int(_get(cfg, "kv_lora_rank", 0) or 0)
        self.nope = int(_get(cfg, "qk_nope_head_dim", 0) or 0)
        self.rope_dim = int(_get(cfg, "qk_rope_head_dim", 0) or 0)
        self.v_head = int(_get(cfg, "v_head_dim", 0) or 0)
        self.scoring = _get(cfg, "scoring_func", "softmax") if self.deepseek else "softmax"
        self.topk_method = _get(cfg, "topk_method", "greedy") if self.deepseek else "greedy"
        self.n_group = int(_get(cfg, "n_group", 1) or 1)
        self.topk_group = int(_get(cfg, "topk_group", 1) or 1)
        self.routed_scaling = float(_get(cfg, "routed_scaling_factor", 1.0) or 1.0)
        self.router_bias = self.deepseek and self.topk_method == "noaux_tc"
        # Whether the trainer holds gate.e_score_correction_bias as a parameter (DeepSeek's remote
        # code) rather than a module buffer (transformers), which refit does not carry.
        self.router_bias_in_trainer = False
        if self.mla:
            self.head_dim = self.rope_dim  # RoPE covers the rope part of each head only
            if _get(cfg, "rope_scaling", None):
                raise ValueError("the reference models compute default RoPE only: cut configs set "
                                 "rope_scaling to null")
        for k, v in overrides.items():
            if not hasattr(self, k):
                raise AttributeError(f"ModelSpec has no field {k!r}")
            setattr(self, k, v)

    @property
    def padded_vocab(self):
        return -(-self.vocab // VOCAB_PADDING) * VOCAB_PADDING

    @property
    def moe(self):
        return self.experts > 0

    @property
    def mla(self):
        return self.kv_lora > 0

    @property
    def qk_head(self):
        return self.nope + self.rope_dim

    def is_moe_layer(self, layer):
        return self.moe and layer >= self.first_dense

    def as_dict(self):
        return dict(self.__dict__)


# ------------------------------------------------------------------------------------------------
# Transformers' arithmetic, op for op.

def rms_norm(x, weight, eps):
    """LlamaRMSNorm.forward."""
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


def rope_inv_freq(spec):
    """LlamaRotaryEmbedding's default inv_freq, computed on the CPU in fp32 (as transformers does
    at construction, before the model moves to its device)."""
    dim = spec.head_dim
    return 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def rope_cos_sin(inv_freq, seq, dtype, device):
    """LlamaRotaryEmbedding.forward for position_ids = arange(seq)[None] (batch 1, broadcast)."""
    position_ids = torch.arange(seq, device=device).unsqueeze(0)
    inv = inv_freq.to(device)[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    pos = position_ids[:, None, :].float()
    freqs = (inv.float() @ pos.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * 1.0).to(dtype), (emb.sin() * 1.0).to(dtype)


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _repeat_kv(x, n):
    b, kv, s, d = x.shape
    if n == 1:
        return x
    return x[:, :, None, :, :].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)


def causal_mask(seq, dtype, device, window=0):
    """The additive causal mask; with ``window`` (Mixtral's sliding_window), position i also
    masks keys j <= i - window, as transformers' sliding_window_overlay does."""
    m = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    if window and seq > window:
        m = m + torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype, device=device).tril(-window)
        m = m.clamp(min=torch.finfo(dtype).min)
    return m[None, None]


def attention(spec, q, k, v, cos, sin, mask, q_norm=None, k_norm=None):
    """q [B, T, Hq*D], k/v [B, T, Hkv*D] (projections done) -> [B, T, Hq*D]: transformers'
    attention module after its projections, eager_attention_forward."""
    b, t = q.shape[:2]
    d = spec.head_dim
    q = q.view(b, t, -1, d)
    k = k.view(b, t, -1, d)
    if q_norm is not None:
        q = rms_norm(q, q_norm, spec.eps)
        k = rms_norm(k, k_norm, spec.eps)
    q = q.transpose(1, 2)
    k = k.transpose(1, 2)
    v = v.view(b, t, -1, d).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q = (q * c) + (_rotate_half(q) * s)
    k = (k * c) + (_rotate_half(k) * s)
    groups = spec.heads // spec.kv_heads
    k = _repeat_kv(k, groups)
    v = _repeat_kv(v, groups)
    w = torch.matmul(q, k.transpose(2, 3)) * (d ** -0.5)
    w = w + mask[:, :, :, : k.shape[-2]]
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.matmul(w, v).transpose(1, 2).contiguous()
    return o.reshape(b, t, -1).contiguous()


def moe_block(spec, x, router, expert_fn):
    """Qwen3MoeSparseMoeBlock / Qwen3MoeExperts.forward (and MixtralSparseMoeBlock's): softmax
    routing in fp32, top-k, renormalised when norm_topk_prob, the weights cast to the hidden dtype
    (Qwen) or kept fp32 (transformers 5's Mixtral: ``spec.router_weights_fp32``, so that each
    expert's output is scaled in fp32 and rounded once), each hit expert in ascending order,
    index_add_."""
    b, t, h = x.shape
    x = x.reshape(-1, h)
    logits = F.linear(x, router)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    weights, chosen = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not spec.router_weights_fp32:
        weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    mask = F.one_hot(chosen, num_classes=spec.experts).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = int(e[0])
        pos, tok = torch.where(mask[e])
        y = expert_fn(e, x[tok])
        y = y * weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out.reshape(b, t, h)


def rope_interleave(q, k, cos, sin):
    """apply_rotary_pos_emb_interleave (transformers' DeepSeek-V3): each head's rope part, stored
    as interleaved pairs, regrouped into halves before the usual rotation."""
    c, s_ = cos.unsqueeze(1), sin.unsqueeze(1)
    b, h, t, d = q.shape
    q = q.view(b, h, t, d // 2, 2).transpose(4, 3).reshape(b, h, t, d)
    b, h, t, d = k.shape
    k = k.view(b, h, t, d // 2, 2).transpose(4, 3).reshape(b, h, t, d)
    return (q * c) + (_rotate_half(q) * s_), (k * c) + (_rotate_half(k) * s_)


def mla_attention(spec, q, ckv, kv_norm, kv_b, cos, sin, mask):
    """Multi-head latent attention after the down projections (DeepseekV3Attention.forward):
    ``q`` [B, T, heads * (nope + rope)] (q_proj, or q_b_proj of the normed q_a_proj), ``ckv``
    [B, T, kv_lora + rope] (kv_a_proj_with_mqa) -> [B, T, heads * v_head], o_proj not applied."""
    b, t = q.shape[:2]
    q = q.view(b, t, -1, spec.qk_head).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [spec.nope, spec.rope_dim], dim=-1)
    k_pass, k_rot = torch.split(ckv, [spec.kv_lora, spec.rope_dim], dim=-1)
    k_pass = F.linear(rms_norm(k_pass, kv_norm, spec.eps), kv_b)
    k_pass = k_pass.view(b, t, -1, spec.nope + spec.v_head).transpose(1, 2)
    k_pass, v = torch.split(k_pass, [spec.nope, spec.v_head], dim=-1)
    k_rot = k_rot.view(b, 1, t, spec.rope_dim)
    q_rot, k_rot = rope_interleave(q_rot, k_rot, cos, sin)
    k_rot = k_rot.expand(*k_pass.shape[:-1], -1)
    qs = torch.cat((q_pass, q_rot), dim=-1)
    ks = torch.cat((k_pass, k_rot), dim=-1)
    w = torch.matmul(qs, ks.transpose(2, 3)) * (spec.qk_head ** -0.5)
    w = w + mask[:, :, :, : ks.shape[-2]]
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(qs.dtype)
    o = torch.matmul(w, v).transpose(1, 2).contiguous()
    return o.reshape(b, t, -1)


def deepseek_route(spec, x, router, bias):
    """DeepSeek's routers on x [N, H] -> (expert indices [N, k], fp32 weights [N, k]): fp32
    logits; sigmoid (V3) or softmax (V2) scores; the choice among the top groups (noaux_tc: each
    group's two best scores plus the correction bias; group_limited_greedy: each group's best);
    weights renormalised when norm_topk_prob, times routed_scaling_factor."""
    logits = F.linear(x.float(), router.float())
    scores = logits.sigmoid() if spec.scoring == "sigmoid" else logits.softmax(dim=-1, dtype=torch.float32)
    choice = scores + bias.float().unsqueeze(0) if bias is not None else scores
    E = spec.experts
    if spec.topk_method in ("noaux_tc", "group_limited_greedy") and spec.n_group > 1:
        grouped = choice.view(-1, spec.n_group, E // spec.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if spec.topk_method == "noaux_tc" \
            else grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, spec.n_group, E // spec.n_group).reshape(-1, E)
        choice = choice.masked_fill(~score_mask.bool(), 0.0)
    idx = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    if spec.norm_topk and spec.top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, weights * spec.routed_scaling


def deepseek_moe(spec, x, router, bias, expert_fn, shared_fn):
    """DeepseekV3MoE.forward: the routed experts' outputs scaled and summed in fp32 (ascending
    experts, index_add_), cast to the hidden dtype, plus the shared experts."""
    b, t, h = x.shape
    flat = x.reshape(-1, h)
    idx, weights = deepseek_route(spec, flat, router, bias)
    # fp32 (the weights') for bf16 and fp32 models, as transformers; fp64 for the fp64 reference.
    out = torch.zeros_like(flat, dtype=torch.promote_types(weights.dtype, flat.dtype))
    mask = F.one_hot(idx, num_classes=spec.experts).permute(2, 0, 1)
    for e in range(spec.experts):
        tok, pos = torch.where(mask[e])
        if tok.numel() > 0:
            out.index_add_(0, tok, expert_fn(e, flat[tok]) * weights[tok, pos].unsqueeze(-1))
    y = out.type(x.dtype).view(b, t, h)
    return y + shared_fn(x) if shared_fn is not None else y


# ------------------------------------------------------------------------------------------------
# The engine: vLLM's parameters.

class _P(nn.Module):
    """A module holding named parameters only (vLLM's module paths, no forward of its own)."""

    def __init__(self, **params):
        super().__init__()
        for k, v in params.items():
            setattr(self, k, nn.Parameter(v, requires_grad=False))


class RefModel(nn.Module):
    """vLLM's parameter conventions (see the module's docstring); zeros until refit fills it."""

    def __init__(self, spec, dtype=torch.bfloat16, device="cpu"):
        super().__init__()
        self.spec = spec
        s = spec
        z = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim
        inner = nn.Module()
        inner.embed_tokens = _P(weight=z(s.padded_vocab, s.hidden))
        inner.layers = nn.ModuleList()
        for i in range(s.layers):
            layer = nn.Module()
            layer.input_layernorm = _P(weight=z(s.hidden))
            attn = nn.Module()
            if s.mla:  # DeepseekV2Attention (vLLM): q_a and kv_a fused when q_lora_rank is set
                kv_a = s.kv_lora + s.rope_dim
                if s.q_lora:
                    attn.fused_qkv_a_proj = _P(weight=z(s.q_lora + kv_a, s.hidden))
                    attn.q_a_layernorm = _P(weight=z(s.q_lora))
                    attn.q_b_proj = _P(weight=z(s.heads * s.qk_head, s.q_lora))
                else:
                    attn.q_proj = _P(weight=z(s.heads * s.qk_head, s.hidden))
                    attn.kv_a_proj_with_mqa = _P(weight=z(kv_a, s.hidden))
                attn.kv_a_layernorm = _P(weight=z(s.kv_lora))
                attn.kv_b_proj = _P(weight=z(s.heads * (s.nope + s.v_head), s.kv_lora))
                attn.o_proj = _P(weight=z(s.hidden, s.heads * s.v_head))
            else:
                attn.qkv_proj = _P(weight=z(qkv_rows, s.hidden), **({"bias": z(qkv_rows)} if s.qkv_bias else {}))
                attn.o_proj = _P(weight=z(s.hidden, s.heads * s.head_dim),
                                 **({"bias": z(s.hidden)} if s.o_bias else {}))
            if s.qk_norm:
                attn.q_norm = _P(weight=z(s.head_dim))
                attn.k_norm = _P(weight=z(s.head_dim))
            layer.self_attn = attn
            layer.post_attention_layernorm = _P(weight=z(s.hidden))
            mlp = nn.Module()
            if s.is_moe_layer(i):
                gate = {"weight": z(s.experts, s.hidden)}
                if s.router_bias:  # vLLM's DeepseekV2MoE: an fp32 parameter
                    gate["e_score_correction_bias"] = torch.zeros(s.experts, dtype=torch.float32, device=device)
                mlp.gate = _P(**gate)
                mlp.experts = _P(w13_weight=z(s.experts, 2 * s.moe_intermediate, s.hidden),
                                 w2_weight=z(s.experts, s.hidden, s.moe_intermediate))
                if s.n_shared:
                    n = s.n_shared * s.moe_intermediate
                    shared = nn.Module()
                    shared.gate_up_proj = _P(weight=z(2 * n, s.hidden))
                    shared.down_proj = _P(weight=z(s.hidden, n))
                    mlp.shared_experts = shared
            else:
                mlp.gate_up_proj = _P(weight=z(2 * s.intermediate, s.hidden))
                mlp.down_proj = _P(weight=z(s.hidden, s.intermediate))
            layer.mlp = mlp
            inner.layers.append(layer)
        inner.norm = _P(weight=z(s.hidden))
        self.model = inner
        if not s.tied:
            self.lm_head = _P(weight=z(s.padded_vocab, s.hidden))
        self._inv_freq = rope_inv_freq(s)

    def head_weight(self):
        return self.model.embed_tokens.weight if self.spec.tied else self.lm_head.weight

    # -- the weights in Hugging Face's checkpoint names (views into the fused parameters) -----

    def checkpoint_views(self):
        """{checkpoint name: view of the live fused parameter}, from the model's own semantics
        (rows of q, k, v in qkv_proj; gate then up; expert e at index e) -- independent of any
        refit layout, so it checks the layouts rather than repeating them."""
        s = self.spec
        out = {}
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        out["model.embed_tokens.weight"] = self.model.embed_tokens.weight[: s.vocab]
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
            a = layer.self_attn
            if s.mla:
                if s.q_lora:
                    out[p + "self_attn.q_a_proj.weight"] = a.fused_qkv_a_proj.weight[: s.q_lora]
                    out[p + "self_attn.kv_a_proj_with_mqa.weight"] = a.fused_qkv_a_proj.weight[s.q_lora:]
                    out[p + "self_attn.q_a_layernorm.weight"] = a.q_a_layernorm.weight
                    out[p + "self_attn.q_b_proj.weight"] = a.q_b_proj.weight
                else:
                    out[p + "self_attn.q_proj.weight"] = a.q_proj.weight
                    out[p + "self_attn.kv_a_proj_with_mqa.weight"] = a.kv_a_proj_with_mqa.weight
                out[p + "self_attn.kv_a_layernorm.weight"] = a.kv_a_layernorm.weight
                out[p + "self_attn.kv_b_proj.weight"] = a.kv_b_proj.weight
            else:
                for leaf in (["weight", "bias"] if s.qkv_bias else ["weight"]):
                    t = getattr(a.qkv_proj, leaf)
                    out[p + f"self_attn.q_proj.{leaf}"] = t[:q]
                    out[p + f"self_attn.k_proj.{leaf}"] = t[q:q + kv]
                    out[p + f"self_attn.v_proj.{leaf}"] = t[q + kv:]
            out[p + "self_attn.o_proj.weight"] = a.o_proj.weight
            if s.o_bias:
                out[p + "self_attn.o_proj.bias"] = a.o_proj.bias
            if s.qk_norm:
                out[p + "self_attn.q_norm.weight"] = a.q_norm.weight
                out[p + "self_attn.k_norm.weight"] = a.k_norm.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
            m = layer.mlp
            if s.is_moe_layer(i):
                out[p + "mlp.gate.weight"] = m.gate.weight
                if s.router_bias and s.router_bias_in_trainer:
                    out[p + "mlp.gate.e_score_correction_bias"] = m.gate.e_score_correction_bias
                n = s.moe_intermediate
                for e in range(s.experts):
                    out[p + f"mlp.experts.{e}.gate_proj.weight"] = m.experts.w13_weight[e, :n]
                    out[p + f"mlp.experts.{e}.up_proj.weight"] = m.experts.w13_weight[e, n:]
                    out[p + f"mlp.experts.{e}.down_proj.weight"] = m.experts.w2_weight[e]
                if s.n_shared:
                    n = s.n_shared * s.moe_intermediate
                    sh = m.shared_experts
                    out[p + "mlp.shared_experts.gate_proj.weight"] = sh.gate_up_proj.weight[:n]
                    out[p + "mlp.shared_experts.up_proj.weight"] = sh.gate_up_proj.weight[n:]
                    out[p + "mlp.shared_experts.down_proj.weight"] = sh.down_proj.weight
            else:
                n = s.intermediate
                out[p + "mlp.gate_proj.weight"] = m.gate_up_proj.weight[:n]
                out[p + "mlp.up_proj.weight"] = m.gate_up_proj.weight[n:]
                out[p + "mlp.down_proj.weight"] = m.down_proj.weight
        out["model.norm.weight"] = self.model.norm.weight
        if not s.tied:
            out["lm_head.weight"] = self.lm_head.weight[: s.vocab]
        return out

    @torch.no_grad()
    def load_checkpoint_tensor(self, name, tensor, views=None):
        """What engines do today (vLLM's load_weights): copy one checkpoint tensor into its
        place in the fused parameters."""
        views = views if views is not None else self.checkpoint_views()
        views[name].copy_(tensor)

    # -- forward -------------------------------------------------------------------------------

    def linear_weight(self, module, leaf="weight"):
        """The weight a linear layer's GEMM uses: the parameter itself (an fp8 engine,
        tests/models/fp8ref.Fp8RefModel, dequantizes its codes here)."""
        return getattr(module, leaf)


    def _attention(self, a, x, cos, sin, mask, fused):
        s = self.spec
        q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
        w = self.linear_weight(a.qkv_proj)
        bias = a.qkv_proj.bias if s.qkv_bias else None
        if fused:
            qkv = F.linear(x, w, bias)
            q, k, v = qkv[..., :q_rows], qkv[..., q_rows:q_rows + kv_rows], qkv[..., q_rows + kv_rows:]
        else:
            sl = [slice(0, q_rows), slice(q_rows, q_rows + kv_rows), slice(q_rows + kv_rows, None)]
            q, k, v = (F.linear(x, w[i], None if bias is None else bias[i]) for i in sl)
        o = attention(s, q, k, v, cos, sin, mask,
                      a.q_norm.weight if s.qk_norm else None, a.k_norm.weight if s.qk_norm else None)
        return F.linear(o, self.linear_weight(a.o_proj), a.o_proj.bias if s.o_bias else None)

    def _mla(self, a, x, cos, sin, mask, fused):
        """Latent attention: vLLM's fused_qkv_a_proj is one GEMM in "vllm" mode, transformers'
        q_a_proj and kv_a_proj_with_mqa two in "hf" mode."""
        s = self.spec
        if s.q_lora:
            w = self.linear_weight(a.fused_qkv_a_proj)
            if fused:
                qa_kv = F.linear(x, w)
                qa, ckv = qa_kv[..., : s.q_lora], qa_kv[..., s.q_lora:]
            else:
                qa, ckv = F.linear(x, w[: s.q_lora]), F.linear(x, w[s.q_lora:])
            q = F.linear(rms_norm(qa, a.q_a_layernorm.weight, s.eps), self.linear_weight(a.q_b_proj))
        else:
            q = F.linear(x, self.linear_weight(a.q_proj))
            ckv = F.linear(x, self.linear_weight(a.kv_a_proj_with_mqa))
        o = mla_attention(s, q, ckv, a.kv_a_layernorm.weight, self.linear_weight(a.kv_b_proj), cos, sin, mask)
        return F.linear(o, self.linear_weight(a.o_proj))

    def _dense_mlp(self, m, x, n, fused):
        gu = self.linear_weight(m.gate_up_proj)
        if fused:
            y = F.linear(x, gu)
            g, u = y[..., :n], y[..., n:]
        else:
            g, u = F.linear(x, gu[:n]), F.linear(x, gu[n:])
        return F.linear(F.silu(g) * u, self.linear_weight(m.down_proj))

    def _moe(self, m, x, fused, experts_fused_gemm):
        s = self.spec
        w13, w2 = self.linear_weight(m.experts, "w13_weight"), self.linear_weight(m.experts, "w2_weight")
        n = s.moe_intermediate

        def expert(e, xe):
            if experts_fused_gemm:
                g, u = F.linear(xe, w13[e]).chunk(2, dim=-1)
            else:
                g, u = F.linear(xe, w13[e, :n]), F.linear(xe, w13[e, n:])
            return F.linear(F.silu(g) * u, w2[e])

        if not s.deepseek:
            return moe_block(s, x, m.gate.weight, expert)
        shared = None
        if s.n_shared:
            def shared(xs):
                return self._dense_mlp(m.shared_experts, xs, s.n_shared * s.moe_intermediate, fused)
        bias = m.gate.e_score_correction_bias if s.router_bias else None
        return deepseek_moe(s, x, m.gate.weight, bias, expert, shared)

    @torch.no_grad()
    def forward(self, ids, mode="vllm", experts_fused_gemm=None):
        """Logits [B, T, vocab] (the real vocabulary) of token ids [B, T]. ``mode``: "vllm" (one
        GEMM per fused parameter) or "hf" (transformers' GEMM split, on views of the same
        parameters). ``experts_fused_gemm`` (hf mode): whether the trainer's experts use one
        gate_up GEMM per expert (transformers 5) or two (transformers 4)."""
        s = self.spec
        fused = mode == "vllm"
        if experts_fused_gemm is None:
            experts_fused_gemm = fused or s.experts_style == "fused"
        h = F.embedding(ids, self.model.embed_tokens.weight)
        dtype, dev = h.dtype, h.device
        cos, sin = rope_cos_sin(self._inv_freq, ids.shape[1], dtype, dev)
        mask = causal_mask(ids.shape[1], dtype, dev, s.sliding_window)
        for i, layer in enumerate(self.model.layers):
            r = h
            x = rms_norm(h, layer.input_layernorm.weight, s.eps)
            attend = self._mla if s.mla else self._attention
            h = r + attend(layer.self_attn, x, cos, sin, mask, fused)
            r = h
            x = rms_norm(h, layer.post_attention_layernorm.weight, s.eps)
            m = layer.mlp
            if s.is_moe_layer(i):
                y = self._moe(m, x, fused, experts_fused_gemm)
            else:
                y = self._dense_mlp(m, x, s.intermediate, fused)
            h = r + y
        h = rms_norm(h, self.model.norm.weight, s.eps)
        head = self.head_weight()
        if fused:  # the padded head, as vLLM's ParallelLMHead; padded logits dropped before sampling
            return F.linear(h, head)[..., : s.vocab]
        return F.linear(h, head[: s.vocab])


# ------------------------------------------------------------------------------------------------
# The trainer's stand-in: Hugging Face's names and modules, pure torch.

class Twin(nn.Module):
    """A causal LM in transformers' module layout (see the module's docstring)."""

    def __init__(self, spec, dtype=torch.float32, seed=0, std=0.02):
        super().__init__()
        self.spec = s = spec
        g = torch.Generator().manual_seed(seed)

        def lin(o, i, bias=False):
            m = nn.Linear(i, o, bias=bias)
            with torch.no_grad():
                m.weight.copy_(torch.randn(o, i, generator=g) * std)
                if bias:
                    m.bias.copy_(torch.randn(o, generator=g) * std)
            return m

        def norm(n):
            m = nn.Module()
            m.weight = nn.Parameter(torch.ones(n) + 0.1 * torch.randn(n, generator=g))
            return m

        inner = nn.Module()
        inner.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        with torch.no_grad():
            inner.embed_tokens.weight.copy_(torch.randn(s.vocab, s.hidden, generator=g) * std * 10)
        inner.layers = nn.ModuleList()
        def mlp(inter):
            m = nn.Module()
            m.gate_proj, m.up_proj, m.down_proj = lin(inter, s.hidden), lin(inter, s.hidden), lin(s.hidden, inter)
            return m

        for i in range(s.layers):
            L = nn.Module()
            L.input_layernorm = norm(s.hidden)
            a = nn.Module()
            if s.mla:  # DeepseekV3Attention's modules, in its registration order
                if s.q_lora:
                    a.q_a_proj = lin(s.q_lora, s.hidden)
                    a.q_a_layernorm = norm(s.q_lora)
                    a.q_b_proj = lin(s.heads * s.qk_head, s.q_lora)
                else:
                    a.q_proj = lin(s.heads * s.qk_head, s.hidden)
                a.kv_a_proj_with_mqa = lin(s.kv_lora + s.rope_dim, s.hidden)
                a.kv_a_layernorm = norm(s.kv_lora)
                a.kv_b_proj = lin(s.heads * (s.nope + s.v_head), s.kv_lora)
                a.o_proj = lin(s.hidden, s.heads * s.v_head)
            else:
                a.q_proj = lin(s.heads * s.head_dim, s.hidden, s.qkv_bias)
                a.k_proj = lin(s.kv_heads * s.head_dim, s.hidden, s.qkv_bias)
                a.v_proj = lin(s.kv_heads * s.head_dim, s.hidden, s.qkv_bias)
                a.o_proj = lin(s.hidden, s.heads * s.head_dim, s.o_bias)
            if s.qk_norm:
                a.q_norm = norm(s.head_dim)
                a.k_norm = norm(s.head_dim)
            L.self_attn = a
            L.post_attention_layernorm = norm(s.hidden)
            m = nn.Module()
            if s.is_moe_layer(i):
                m.gate = lin(s.experts, s.hidden)
                if s.router_bias:  # transformers' DeepseekV3TopkRouter: a module buffer, zeros
                    m.gate.register_buffer("e_score_correction_bias", torch.zeros(s.experts))
                n = s.moe_intermediate
                if s.experts_style == "fused":
                    ex = nn.Module()
                    ex.gate_up_proj = nn.Parameter(torch.randn(s.experts, 2 * n, s.hidden, generator=g) * std)
                    ex.down_proj = nn.Parameter(torch.randn(s.experts, s.hidden, n, generator=g) * std)
                else:
                    ex = nn.ModuleList()
                    for _ in range(s.experts):
                        e = nn.Module()
                        e.gate_proj, e.up_proj, e.down_proj = lin(n, s.hidden), lin(n, s.hidden), lin(s.hidden, n)
                        ex.append(e)
                m.experts = ex
                if s.n_shared:
                    m.shared_experts = mlp(s.n_shared * s.moe_intermediate)
            else:
                m = mlp(s.intermediate)
            L.mlp = m
            inner.layers.append(L)
        inner.norm = norm(s.hidden)
        self.model = inner
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        if s.tied:
            self.lm_head.weight = inner.embed_tokens.weight
        else:
            with torch.no_grad():
                self.lm_head.weight.copy_(torch.randn(s.vocab, s.hidden, generator=g) * std)
        self._inv_freq = rope_inv_freq(s)
        self.to(dtype)

    def forward(self, ids):
        s = self.spec
        h = self.model.embed_tokens(ids)
        cos, sin = rope_cos_sin(self._inv_freq, ids.shape[1], h.dtype, h.device)
        mask = causal_mask(ids.shape[1], h.dtype, h.device, s.sliding_window)
        for i, L in enumerate(self.model.layers):
            a = L.self_attn
            r = h
            x = rms_norm(h, L.input_layernorm.weight, s.eps)
            if s.mla:
                q = a.q_b_proj(rms_norm(a.q_a_proj(x), a.q_a_layernorm.weight, s.eps)) if s.q_lora else a.q_proj(x)
                o = mla_attention(s, q, a.kv_a_proj_with_mqa(x), a.kv_a_layernorm.weight, a.kv_b_proj.weight,
                                  cos, sin, mask)
            else:
                o = attention(s, a.q_proj(x), a.k_proj(x), a.v_proj(x), cos, sin, mask,
                              a.q_norm.weight if s.qk_norm else None, a.k_norm.weight if s.qk_norm else None)
            h = r + a.o_proj(o)
            r = h
            x = rms_norm(h, L.post_attention_layernorm.weight, s.eps)
            m = L.mlp
            if s.is_moe_layer(i):
                if s.experts_style == "fused":
                    ex = m.experts

                    def expert(e, xe, ex=ex):
                        g, u = F.linear(xe, ex.gate_up_proj[e]).chunk(2, dim=-1)
                        return F.linear(F.silu(g) * u, ex.down_proj[e])
                else:
                    def expert(e, xe, ex=m.experts):
                        return ex[e].down_proj(F.silu(ex[e].gate_proj(xe)) * ex[e].up_proj(xe))
                if s.deepseek:
                    sh = getattr(m, "shared_experts", None)
                    shared = (lambda xs, sh=sh: sh.down_proj(F.silu(sh.gate_proj(xs)) * sh.up_proj(xs))) \
                        if sh is not None else None
                    bias = m.gate.e_score_correction_bias if s.router_bias else None
                    y = deepseek_moe(s, x, m.gate.weight, bias, expert, shared)
                else:
                    y = moe_block(s, x, m.gate.weight, expert)
            else:
                y = m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
            h = r + y
        h = rms_norm(h, self.model.norm.weight, s.eps)
        return self.lm_head(h)


# ------------------------------------------------------------------------------------------------
# Names.

_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def to_checkpoint_names(named, spec):
    """{checkpoint name: tensor} from a trainer's full tensors: transformers 5's fused experts
    ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` split into the
    per-expert checkpoint tensors (views); tied ``lm_head`` left out; other names kept."""
    out = {}
    for name, t in named.items():
        m = _FUSED_EXPERTS.match(name)
        if m and t.dim() == 3:
            base, kind = m.groups()
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    n = t.shape[1] // 2
                    out[f"{base}.{e}.gate_proj.weight"] = t[e, :n]
                    out[f"{base}.{e}.up_proj.weight"] = t[e, n:]
                else:
                    out[f"{base}.{e}.down_proj.weight"] = t[e]
            continue
        if name == "lm_head.weight" and spec.tied:
            continue
        out[name] = t
    return out


def _intersect(o, n, lo, hi):
    """[o, o + n) ∩ [lo, hi) as (begin, end), possibly empty."""
    return max(o, lo), min(o + n, hi)


def fused_experts_to_checkpoint(layout):
    """A trainer layout (refit.layouts.dtensor's dict) whose buffers hold transformers 5's fused
    expert parameters, rewritten so that their pieces name the per-expert checkpoint tensors
    (``<p>.experts.<e>.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I]) that
    engine layouts use. Any box of the fused tensor (FSDP2's Shard(0) of experts, TP cuts of dim 1
    or 2) becomes the per-expert boxes it covers. Other buffers are unchanged."""
    tensors = {t["name"]: t for t in layout["tensors"]}
    new_tensors = {}
    for w in layout["workers"]:
        for b in w["buffers"]:
            pieces = []
            for p in b["pieces"]:
                m = _FUSED_EXPERTS.match(p["tensor"])
                t = tensors.get(p["tensor"])
                if not m or t is None or len(t["shape"]) != 3:
                    pieces.append(p)
                    continue
                base, kind = m.groups()
                E, D1, D2 = t["shape"]
                to, ts = p["tensorBox"]["origin"], p["tensorBox"]["shape"]
                bo = p["bufferBox"]["origin"]
                parts = [("gate_proj", 0, D1 // 2), ("up_proj", D1 // 2, D1)] if kind == "gate_up_proj" \
                    else [("down_proj", 0, D1)]
                for e in range(to[0], to[0] + ts[0]):
                    for part, lo, hi in parts:
                        r0, r1 = _intersect(to[1], ts[1], lo, hi)
                        if r1 <= r0:
                            continue
                        name = f"{base}.{e}.{part}.weight"
                        new_tensors[name] = {"name": name, "shape": [hi - lo, D2], "dtype": t["dtype"]}
                        pieces.append({
                            "tensor": name,
                            "tensorBox": {"origin": [r0 - lo, to[2]], "shape": [r1 - r0, ts[2]]},
                            "bufferBox": {"origin": [bo[0] + e - to[0], bo[1] + r0 - to[1], bo[2]],
                                          "shape": [1, r1 - r0, ts[2]]}})
            b["pieces"] = pieces
    fused = {n for n in tensors if _FUSED_EXPERTS.match(n) and len(tensors[n]["shape"]) == 3}
    layout["tensors"] = [t for n, t in tensors.items() if n not in fused] + list(new_tensors.values())
    return layout


def bits_equal(a, b):
    """Bit for bit: same shape, dtype and bytes (NaNs and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
