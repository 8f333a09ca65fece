"""Block fp8 engines for refit's model tests: an independent reference of the quantizer, and an
engine model whose linear weights are block-fp8 codes (docs/MODELS.md, "fp8 engines").

* The reference (NumPy, vectorized; never refit's C++): ``float_to_e4m3`` / ``e4m3_to_float``
  (OCP float8_e4m3fn) and ``quantize_block_fp8`` / ``dequantize_block_fp8`` by the rules that
  plan/fp8_block.h states. Written from those rules, not from plan/fp8_block.cc's bit
  manipulation: an element is rounded arithmetically (its binade's quantum 2^(e - 3), e at least
  -6, np.rint's ties to even, exact in float64) and then encoded; per block, amax over the finite
  |x|, scale = amax / 448 in fp32 (IEEE division), raised to FLT_MIN, 1 when amax == 0;
  code = e4m3(x / scale) saturating to +-448, NaN kept with its sign (encoded from x itself);
  dequantized value = e4m3_to_float(code) * scale in fp32.
* ``Fp8RefModel``: ``refmodel.RefModel`` whose ``qkv_proj``, ``o_proj``, ``gate_up_proj``,
  ``down_proj`` weights and experts' ``w13_weight``/``w2_weight`` hold e4m3 codes (torch.uint8,
  declared to the layout as ``fp8_e4m3``, where torch has no float8 dtype; ``torch.float8_e4m3fn``
  where it has) with vLLM's ``weight_scale_inv`` parameters (fp32, the blocks of the parameter's
  last two dims; ``experts.w13_weight_scale_inv`` / ``w2_weight_scale_inv``). Its forward
  dequantizes every such weight (codes -> fp32 through a decode table built here from the format's
  fields, times its block's scale expanded over the block, cast to the compute dtype) and then runs
  RefModel's arithmetic unchanged. Embeddings, norms, lm_head, biases and the router stay in the
  compute dtype.
* ``expectation``: what the engine must hold and compute after a round, from the trainer's
  weights: the reference quantization (codes and scales, in checkpoint names; other tensors as
  the trainer's), and the logits and greedy tokens of the trainer's own model (``refmodel.Twin``)
  holding dequantize(quantize(trainer weights)), with its fp64 copy for the 2·T rule.
"""
import math
import os
import re

import numpy as np
import torch
from torch import nn

import refmodel

E4M3_MAX = 448.0
FLT_MIN = np.float32(np.finfo(np.float32).tiny)  # 2^-126

# Checkpoint names of the weights an fp8 engine holds quantized (vLLM's Fp8LinearMethod on every
# linear layer but the head; Fp8MoEMethod on the experts). The router, embeddings, norms, biases
# and lm_head are not quantized.
QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o|q_a|q_b|kv_b)_proj|"
                       r"self_attn\.kv_a_proj_with_mqa|mlp\.(gate|up|down)_proj|"
                       r"mlp\.shared_experts\.(gate|up|down)_proj|"
                       r"mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$")


# ------------------------------------------------------------------------------------------------
# The reference quantizer (NumPy).

def float_to_e4m3(x):
    """fp32 values -> e4m3fn codes (uint8), same shape: round to nearest even on the exact fp32
    value, saturate every |v| >= 448 (and +-inf) to +-448, NaN -> 0x7f / 0xff (its sign), the sign
    of a zero result kept."""
    x = np.asarray(x, dtype=np.float32)
    sign = np.signbit(x).astype(np.uint8) << 7
    with np.errstate(invalid="ignore"):  # NaN payloads (signalling ones included) widen as NaN
        a = np.abs(x.astype(np.float64))                   # exact
    nan = np.isnan(a)
    a = np.where(nan, 0.0, a)
    sat = a >= E4M3_MAX                                     # inf included
    a = np.where(sat, 0.0, a)
    # The binade of a: 2^e <= a < 2^(e+1), e at least -6 (below that, subnormals: quantum 2^-9).
    _, ex = np.frexp(a)                                     # a = m * 2^ex, m in [0.5, 1) (0 for a == 0)
    e = np.maximum(ex.astype(np.int64) - 1, -6)
    quantum = np.ldexp(1.0, e - 3)
    r = np.rint(a / quantum) * quantum                      # a / quantum exact; rint: ties to even
    # Encode r (<= 448: the largest value below 448's binade rounds to at most 448).
    _, rx = np.frexp(r)
    re_ = rx.astype(np.int64) - 1
    normal = (r > 0) & (re_ >= -6)
    mant = np.where(normal, r / np.ldexp(1.0, np.where(normal, re_, 0) - 3) - 8, 0).astype(np.int64)
    field = np.where(normal, ((re_ + 7) << 3) | mant, np.rint(r * 512.0).astype(np.int64))
    code = np.where(sat, 0x7E, np.where(nan, 0x7F, field)).astype(np.uint8)
    return code | sign


def _decode_table_numpy():
    c = np.arange(256, dtype=np.int64)
    s = np.where(c & 0x80, -1.0, 1.0)
    exp = (c >> 3) & 0xF
    mant = c & 0x7
    v = np.where(exp == 0, mant * 2.0 ** -9, np.ldexp((8 + mant).astype(np.float64), exp - 10))
    v = s * v
    v[(c & 0x7F) == 0x7F] = np.nan
    return v.astype(np.float32)


E4M3_VALUES = _decode_table_numpy()


def e4m3_to_float(codes):
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def block_scales(x, block):
    """[rows, cols] fp32 -> the fp32 scale grid [ceil(rows / br), ceil(cols / bc)]."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    br, bc = block
    gr, gc = -(-rows // br), -(-cols // bc)
    a = np.abs(x)
    a = np.where(np.isfinite(a), a, np.float32(0))
    pad = np.zeros((gr * br, gc * bc), np.float32)        # zeros do not change a max of |x| >= 0
    pad[:rows, :cols] = a
    amax = pad.reshape(gr, br, gc, bc).max(axis=(1, 3))
    scale = amax / np.float32(E4M3_MAX)                   # fp32 / fp32: IEEE, round to nearest
    scale = np.where(scale < FLT_MIN, FLT_MIN, scale)
    return np.where(amax == 0, np.float32(1), scale).astype(np.float32)


def expand(scales, shape, block):
    br, bc = block
    return np.repeat(np.repeat(scales, br, axis=0), bc, axis=1)[: shape[0], : shape[1]]


def quantize_block_fp8(x, block):
    """[rows, cols] (fp32 values; bf16 widened exactly by the caller) -> (codes uint8, scales fp32)."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"block fp8 quantizes 2-D weights, not shape {x.shape}")
    scales = block_scales(x, block)
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.where(np.isnan(x), x, x / expand(scales, x.shape, block))
    return float_to_e4m3(y), scales


def dequantize_block_fp8(codes, scales, block):
    return (e4m3_to_float(codes) * expand(scales, codes.shape, block)).astype(np.float32)


def _np(t):
    return t.detach().cpu().float().numpy() if t.dtype != torch.float64 else t.detach().cpu().numpy()


# ------------------------------------------------------------------------------------------------
# The engine.

def torch_decode_table(device="cpu"):
    """The 256 e4m3fn values, built in torch from the format's fields (sign, 4 exponent bits with
    bias 7, 3 mantissa bits; exponent 0: mant * 2^-9; S.1111.111: NaN)."""
    c = torch.arange(256, dtype=torch.int64)
    exp = (c >> 3) & 15
    mant = (c & 7).double()
    mag = torch.where(exp == 0, mant / 512.0, (1.0 + mant / 8.0) * torch.pow(2.0, (exp - 7).double()))
    val = torch.where((c & 128) != 0, -mag, mag)
    val = torch.where((c & 127) == 127, torch.full_like(val, float("nan")), val)
    return val.float().to(device)


def storage_default():
    return "float8" if hasattr(torch, "float8_e4m3fn") else "uint8"


class Fp8RefModel(refmodel.RefModel):
    """RefModel with block-fp8 linear weights (see the module's docstring)."""

    def __init__(self, spec, dtype=torch.float32, device="cpu", block=(128, 128), storage=None):
        super().__init__(spec, dtype=dtype, device=device)
        self.block = tuple(int(b) for b in block)
        self.storage = storage or storage_default()
        if self.storage not in ("uint8", "float8"):
            raise ValueError(f"storage {self.storage!r}: uint8 or float8")
        code_dtype = torch.uint8 if self.storage == "uint8" else torch.float8_e4m3fn
        self.compute_dtype = dtype
        self._table = torch_decode_table(device)
        br, bc = self.block
        for module, leaf in self.quantized_params():
            w = getattr(module, leaf)
            grid = tuple(w.shape[:-2]) + (-(-w.shape[-2] // br), -(-w.shape[-1] // bc))
            setattr(module, leaf, nn.Parameter(torch.zeros(w.shape, dtype=torch.uint8, device=device)
                                               .view(code_dtype), requires_grad=False))
            setattr(module, leaf + "_scale_inv",
                    nn.Parameter(torch.ones(grid, dtype=torch.float32, device=device), requires_grad=False))

    def quantized_params(self):
        """(module, leaf) of every fp8 weight."""
        out = []
        s = self.spec
        for i, layer in enumerate(self.model.layers):
            a, m = layer.self_attn, layer.mlp
            if s.mla:
                names = (["fused_qkv_a_proj", "q_b_proj"] if s.q_lora else ["q_proj", "kv_a_proj_with_mqa"]) + \
                    ["kv_b_proj", "o_proj"]
                out += [(getattr(a, n), "weight") for n in names]
            else:
                out += [(a.qkv_proj, "weight"), (a.o_proj, "weight")]
            if s.is_moe_layer(i):
                out += [(m.experts, "w13_weight"), (m.experts, "w2_weight")]
                if s.n_shared:
                    out += [(m.shared_experts.gate_up_proj, "weight"), (m.shared_experts.down_proj, "weight")]
            else:
                out += [(m.gate_up_proj, "weight"), (m.down_proj, "weight")]
        return out

    def layout_params(self):
        """{name: tensor, or (shape, "fp8_e4m3") for codes held as uint8} for engine_worker."""
        out = {}
        for n, p in self.named_parameters():
            out[n] = (tuple(p.shape), "fp8_e4m3") if p.dtype == torch.uint8 else p
        return out

    def dequantize(self, codes, scales):
        """codes [..., rows, cols] (uint8 or float8_e4m3fn), scales [..., gr, gc] -> the weight in
        the compute dtype: e4m3 value (fp32) times its block's scale (fp32), then cast."""
        br, bc = self.block
        rows, cols = codes.shape[-2:]
        if codes.dtype == torch.uint8:
            v = self._table[codes.long()]
        else:
            v = codes.to(torch.float32)
        s = scales.repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]
        return (v * s).to(self.compute_dtype)

    def linear_weight(self, module, leaf="weight"):
        w = getattr(module, leaf)
        scales = getattr(module, leaf + "_scale_inv", None)
        if scales is None:
            return w
        return self.dequantize(w, scales)

    def checkpoint_views(self):
        """RefModel's views (the codes of a quantized weight as its bytes, torch.uint8) plus each
        quantized weight's scales, ``<name>_scale_inv``: the block rows of its part in the fused
        scale parameter (q, k, v; gate, up; expert e at index e)."""
        views = super().checkpoint_views()
        out = {k: (v.view(torch.uint8) if v.dtype != torch.uint8 and v.element_size() == 1 else v)
               for k, v in views.items()}
        s, (br, _) = self.spec, self.block
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            a = layer.self_attn
            if s.mla:
                if s.q_lora:  # q_a then kv_a in fused_qkv_a_proj: q_lora_rank is whole blocks
                    fs = a.fused_qkv_a_proj.weight_scale_inv
                    out[p + "self_attn.q_a_proj.weight_scale_inv"] = fs[: s.q_lora // br]
                    out[p + "self_attn.kv_a_proj_with_mqa.weight_scale_inv"] = fs[s.q_lora // br:]
                    out[p + "self_attn.q_b_proj.weight_scale_inv"] = a.q_b_proj.weight_scale_inv
                else:
                    out[p + "self_attn.q_proj.weight_scale_inv"] = a.q_proj.weight_scale_inv
                    out[p + "self_attn.kv_a_proj_with_mqa.weight_scale_inv"] = a.kv_a_proj_with_mqa.weight_scale_inv
                out[p + "self_attn.kv_b_proj.weight_scale_inv"] = a.kv_b_proj.weight_scale_inv
            else:
                qs = a.qkv_proj.weight_scale_inv
                out[p + "self_attn.q_proj.weight_scale_inv"] = qs[: q // br]
                out[p + "self_attn.k_proj.weight_scale_inv"] = qs[q // br: (q + kv) // br]
                out[p + "self_attn.v_proj.weight_scale_inv"] = qs[(q + kv) // br:]
            out[p + "self_attn.o_proj.weight_scale_inv"] = a.o_proj.weight_scale_inv
            m = layer.mlp
            if s.is_moe_layer(i):
                n, s13, s2 = s.moe_intermediate, m.experts.w13_weight_scale_inv, m.experts.w2_weight_scale_inv
                for e in range(s.experts):
                    out[p + f"mlp.experts.{e}.gate_proj.weight_scale_inv"] = s13[e, : n // br]
                    out[p + f"mlp.experts.{e}.up_proj.weight_scale_inv"] = s13[e, n // br:]
                    out[p + f"mlp.experts.{e}.down_proj.weight_scale_inv"] = s2[e]
                if s.n_shared:
                    n, sh = s.n_shared * s.moe_intermediate, m.shared_experts
                    out[p + "mlp.shared_experts.gate_proj.weight_scale_inv"] = sh.gate_up_proj.weight_scale_inv[: n // br]
                    out[p + "mlp.shared_experts.up_proj.weight_scale_inv"] = sh.gate_up_proj.weight_scale_inv[n // br:]
                    out[p + "mlp.shared_experts.down_proj.weight_scale_inv"] = sh.down_proj.weight_scale_inv
            else:
                n = s.intermediate
                out[p + "mlp.gate_proj.weight_scale_inv"] = m.gate_up_proj.weight_scale_inv[: n // br]
                out[p + "mlp.up_proj.weight_scale_inv"] = m.gate_up_proj.weight_scale_inv[n // br:]
                out[p + "mlp.down_proj.weight_scale_inv"] = m.down_proj.weight_scale_inv
        return out


def share_module_(module):
    """refit.share_module_ for a module that may hold uint8 codes: every parameter moved into one
    shared arena (refit's arena cuts tensors by refit dtype, and uint8 is none: a code tensor is cut
    as int8 and viewed as uint8, the same bytes)."""
    import refit
    params = [p for p in module.parameters() if p.device.type == "cpu"]
    arena = refit.SharedArena(sum(p.numel() * p.element_size() + 256 for p in params) + 256)
    for p in params:
        if p.dtype == torch.uint8:
            t = arena.empty(tuple(p.shape), "int8").view(torch.uint8)
        else:
            t = arena.empty(tuple(p.shape), p.dtype)
        t.copy_(p.data)
        p.data = t
    return arena


# ------------------------------------------------------------------------------------------------
# The expectation after a round (the driver's side).

class Reference:
    """The trainer's model class (refmodel.Twin, transformers' module names) in the compute dtype
    and in fp64, to hold dequantize(quantize(trainer weights))."""

    def __init__(self, spec, dtype, block, device="cpu"):
        self.spec, self.block, self.dtype = spec, tuple(block), dtype
        self.model = refmodel.Twin(spec, dtype=dtype).to(device)
        self.model64 = refmodel.Twin(spec, dtype=torch.float64).to(device)
        self.device = device

    @torch.no_grad()
    def expectation(self, tr, prompts, steps, greedy):
        """From the trainer's eval result ``tr`` (weights in checkpoint names, logits, tokens,
        logits_ref): a result of the same form for what the fp8 engine must show, the trainer's own
        under "trainer"."""
        weights, deq = {}, {}
        for name, w in tr["weights"].items():
            if QUANTIZED.match(name):
                codes, scales = quantize_block_fp8(_np(w), self.block)
                weights[name] = torch.from_numpy(codes)
                weights[name + "_scale_inv"] = torch.from_numpy(scales)
                deq[name] = torch.from_numpy(dequantize_block_fp8(codes, scales, self.block))
            else:
                weights[name] = w
                deq[name] = w
        out = {"weights": weights, "trainer": tr, "quantized": sum(bool(QUANTIZED.match(n)) for n in tr["weights"]),
               "rel_bound": rel_bound(self.spec)}
        for model, key in [(self.model, "logits"), (self.model64, "logits_ref")]:
            held = dict(model.named_parameters())
            # DeepSeek's router bias: a module buffer of the twin, a parameter of some trainers.
            held.update({n: b for n, b in model.named_buffers() if n in deq})
            views = refmodel.to_checkpoint_names(held, self.spec)
            if set(views) != set(deq):
                raise RuntimeError(f"reference model's tensors differ from the trainer's: "
                                   f"{sorted(set(views) ^ set(deq))[:6]}")
            for name, v in views.items():
                v.copy_(deq[name].to(v.dtype))
            model.eval()
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        threads = torch.get_num_threads()  # the engine's thread count (procs.py): the same GEMM blocking
        torch.set_num_threads(int(os.environ.get("REFIT_TORCH_THREADS", "1")))
        try:
            out["logits"] = self.model(ids).float().cpu()
            out["tokens"] = greedy(self.model, ids, steps).cpu()
            out["logits_ref"] = self.model64(ids).double().cpu()
        finally:
            torch.set_num_threads(threads)
        return out


def rel_bound(spec):
    """A loose bound on the relative RMS error of the fp8 engine's logits against the trainer's:
    sqrt(n) * 2^-4, n = the quantized GEMMs on a token's path (q, k, v, o, gate, up, down: 7 a
    layer). 2^-4 is e4m3's largest relative rounding error of one normal element (half an ulp of a
    3-bit mantissa), so each quantized GEMM's output moves by at most 2^-4 of sum |w| |x|; the
    GEMMs' errors are independent and RMSNorm renormalizes between them, so they add in quadrature
    rather than compound. A heuristic, not a theorem (attention's softmax and the MoE router can
    amplify); measured errors sit 40-70x inside it on the CPU configs, 3.5-9x on the
    GPU runs' transformers-initialised models (docs/MODELS.md). A wrong scale, a wrong block
    or stale weights give errors of order 1."""
    return math.sqrt(7 * spec.layers) * 2.0 ** -4


def vs_trainer(trainer, en):
    """How far the fp8 engine is from the trainer's model (full precision weights): reported, and
    bounded loosely by the test. Per mode: max |Δ|, relative RMS error ||Δ|| / ||z||, top-1
    agreement over prompt positions, greedy tokens equal to the trainer's (and the first
    divergence of each prompt)."""
    z = trainer["logits"].double()
    out = {"trainer_T": float((z - trainer["logits_ref"].double()).abs().max()),
           "trainer_logit_rms": float(z.pow(2).mean().sqrt())}
    top = z.argmax(-1)
    for mode in ["vllm", "hf"]:
        e = en[f"logits_{mode}"].double()
        d = e - z
        out[f"fp8_{mode}_max_abs"] = float(d.abs().max())
        out[f"fp8_{mode}_rel_rms"] = float(d.pow(2).sum().sqrt() / z.pow(2).sum().sqrt())
        out[f"fp8_{mode}_top1_agree"] = float((e.argmax(-1) == top).double().mean())
        same = en[f"tokens_{mode}"] == trainer["tokens"]
        out[f"fp8_{mode}_tokens_matching_trainer"] = int(same.sum())
        # Tokens before the first divergence (greedy continuations drift apart once one differs).
        prefix = torch.cumprod(same.long(), dim=1).sum(dim=1)
        out[f"fp8_{mode}_tokens_prefix_trainer"] = prefix.tolist()
    return out
