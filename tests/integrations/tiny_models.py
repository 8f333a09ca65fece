"""A small Qwen2-shaped causal LM twice: as a trainer holds it (Hugging Face names, separate q/k/v
and gate/up) and as a vLLM engine holds it (fused qkv_proj and gate_up_proj, vocabulary padded to
a multiple of 64, an Attention module whose forward uses a tensor it derives from its layer's
weights in process_weights_after_loading, as vLLM's MLA derives its absorbed matrices). Both run
the same causal forward, so equal weights give equal greedy tokens."""
from typing import Dict, List, Optional

import torch

HF_CONFIG = {
    "model_type": "qwen2", "vocab_size": 50, "hidden_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "num_hidden_layers": 2,
    "tie_word_embeddings": False,
}
PADDED_VOCAB = 64


def _tree(params: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose named_parameters() are exactly `params` (dotted names become submodules)."""
    root = torch.nn.Module()
    for name, t in params.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=True))
    return root


def hf_shapes(cfg=HF_CONFIG) -> Dict[str, tuple]:
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _forward(get, o_weight, ids: List[int], cfg=HF_CONFIG) -> torch.Tensor:
    """Logits of the last position. `get(name)` gives a Hugging Face tensor (views of fused
    buffers on the engine); `o_weight(layer)` the attention output weight the layer uses."""
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    x = get("model.embed_tokens.weight")[torch.tensor(ids)]
    t = len(ids)
    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, get(p + "input_layernorm.weight"))
        q = (h @ get(p + "self_attn.q_proj.weight").T + get(p + "self_attn.q_proj.bias")).view(t, nq, hd)
        k = (h @ get(p + "self_attn.k_proj.weight").T + get(p + "self_attn.k_proj.bias")).view(t, nkv, hd)
        v = (h @ get(p + "self_attn.v_proj.weight").T + get(p + "self_attn.v_proj.bias")).view(t, nkv, hd)
        k = k.repeat_interleave(nq // nkv, dim=1)
        v = v.repeat_interleave(nq // nkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5 + mask
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nq * hd)
        x = x + attn @ o_weight(i).T
        h = _rms(x, get(p + "post_attention_layernorm.weight"))
        gate = h @ get(p + "mlp.gate_proj.weight").T
        up = h @ get(p + "mlp.up_proj.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ get(p + "mlp.down_proj.weight").T
    x = _rms(x, get("model.norm.weight"))
    return x[-1] @ get("lm_head.weight")[: cfg["vocab_size"]].T


class TrainerModel(torch.nn.Module):
    """Hugging Face names; `seed` fixes the initial weights."""

    def __init__(self, seed: int, cfg=HF_CONFIG) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        params = {n: torch.randn(s, generator=g) * 0.2 for n, s in hf_shapes(cfg).items()}
        self.inner = _tree(params)
        self.cfg = cfg

    def hf(self) -> Dict[str, torch.Tensor]:
        return {n[len("inner."):]: p for n, p in self.named_parameters()}

    def logits(self, ids: List[int]) -> torch.Tensor:
        w = self.hf()
        return _forward(w.__getitem__, lambda i: w[f"model.layers.{i}.self_attn.o_proj.weight"], ids, self.cfg)

    def loss(self, ids: List[int]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.logits(ids[:-1])[None], torch.tensor([ids[-1]]))

    @torch.no_grad()
    def greedy(self, ids: List[int], n: int) -> List[int]:
        out = list(ids)
        for _ in range(n):
            out.append(int(self.logits(out).argmax()))
        return out[len(ids):]


class Attention(torch.nn.Module):
    """vLLM's attention layer, reduced to what matters here: it derives `o_t` (the output
    projection, transposed) from its layer's weights after loading, and the forward uses it."""

    def __init__(self, o_proj: torch.nn.Module) -> None:
        super().__init__()
        self._o_proj = [o_proj]  # not a submodule: no second path to the parameter
        self.o_t: Optional[torch.Tensor] = None
        self.derivations = 0

    def process_weights_after_loading(self, act_dtype) -> None:
        self.o_t = self._o_proj[0].weight.detach().t().contiguous()
        self.derivations += 1


def engine_shapes(cfg=HF_CONFIG) -> Dict[str, tuple]:
    hf = hf_shapes(cfg)
    h = cfg["hidden_size"]
    shapes = {"model.embed_tokens.weight": (PADDED_VOCAB, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv_rows = hf[a + "q_proj.weight"][0] + 2 * hf[a + "k_proj.weight"][0]
        shapes.update({
            a + "qkv_proj.weight": (qkv_rows, h), a + "qkv_proj.bias": (qkv_rows,),
            a + "o_proj.weight": hf[a + "o_proj.weight"],
            p + "mlp.gate_up_proj.weight": (2 * cfg["intermediate_size"], h),
            p + "mlp.down_proj.weight": hf[p + "mlp.down_proj.weight"],
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (PADDED_VOCAB, h)
    return shapes


class EngineModel(torch.nn.Module):
    """vLLM names and fused buffers; `hf_view(name)` reads a Hugging Face tensor out of them."""

    def __init__(self, seed: int, cfg=HF_CONFIG) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        tree = _tree({n: torch.randn(s, generator=g) * 0.2 for n, s in engine_shapes(cfg).items()})
        for name, child in tree.named_children():
            self.add_module(name, child)
        self.cfg = cfg
        for i in range(cfg["num_hidden_layers"]):
            attn_parent = self.get_submodule(f"model.layers.{i}.self_attn")
            attn_parent.add_module("attn", Attention(attn_parent.o_proj))
            attn_parent.attn.process_weights_after_loading(None)

    def hf_view(self, name: str) -> torch.Tensor:
        cfg = self.cfg
        params = dict(self.named_parameters())
        q = cfg["num_attention_heads"] * cfg["head_dim"]
        kv = cfg["num_key_value_heads"] * cfg["head_dim"]
        inter = cfg["intermediate_size"]
        module, _, leaf = name.rpartition(".")
        parent, _, part = module.rpartition(".")
        if part in ("q_proj", "k_proj", "v_proj"):
            fused = params[f"{parent}.qkv_proj.{leaf}"]
            start = {"q_proj": 0, "k_proj": q, "v_proj": q + kv}[part]
            return fused[start:start + (q if part == "q_proj" else kv)]
        if part in ("gate_proj", "up_proj"):
            fused = params[f"{parent}.gate_up_proj.{leaf}"]
            return fused[:inter] if part == "gate_proj" else fused[inter:]
        if part in ("embed_tokens", "lm_head"):
            return params[name][: cfg["vocab_size"]]
        return params[name]

    def padding(self) -> Dict[str, torch.Tensor]:
        """The padded vocabulary rows, which no Hugging Face tensor maps to."""
        params = dict(self.named_parameters())
        return {n: params[n][self.cfg["vocab_size"]:] for n in ("model.embed_tokens.weight", "lm_head.weight")}

    def post_load_weights(self) -> None:
        """SGLang's name for the same step: re-derive what the forward derives from weights."""
        for attn in self.attentions():
            attn.process_weights_after_loading(None)

    def attentions(self) -> List[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def logits(self, ids: List[int]) -> torch.Tensor:
        attns = self.attentions()
        return _forward(self.hf_view, lambda i: attns[i].o_t.t(), ids, self.cfg)

    @torch.no_grad()
    def greedy(self, ids: List[int], n: int) -> List[int]:
        out = list(ids)
        for _ in range(n):
            out.append(int(self.logits(out).argmax()))
        return out[len(ids):]


def poison_(tensors) -> None:
    """Every byte of every tensor set to 0xA5: a refit that skips a byte leaves it visible."""
    with torch.no_grad():
        for t in tensors:
            t.view(torch.uint8).fill_(0xA5)


def train_step(model: TrainerModel, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, model.cfg["vocab_size"], (6,), generator=g).tolist()
    model.loss(ids).backward()
    opt.step()
    opt.zero_grad()
