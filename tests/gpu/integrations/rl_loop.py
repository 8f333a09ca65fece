"""An RL-style loop on a real transformers model, its weight sync driven through refit's vLLM
adapter (refit.integrations.vllm) against the vLLM stand-in (tests/integrations/standins), on one
GPU with one `refitd --backend cuda`:

    trainer: AutoModelForCausalLM (bf16, CUDA), AdamW; registers its live parameters
             (RefitTrainerWeightTransferEngine + LiveModuleSource)
    engine:  a second copy of the model whose q/k/v and gate/up weights are views into fused
             qkv_proj / gate_up_proj buffers and whose embedding is a view into a vocabulary
             padded to 64 rows: vLLM's memory layout; its fused buffers are what the vLLM worker
             registers (RefitWeightTransferEngine, created by WeightTransferEngineFactory after
             the plugin loaded through the vllm.general_plugins entry point)
    loop:    optimizer step -> send_weights() -> every engine byte checked against the trainer
             -> greedy generation on both, token for token
    timing:  each refit round against the stack's default path on the same weights: for every
             tensor a full copy (the broadcast's receive buffer) and the weight loader's copy into
             the fused buffer (one GPU, one process: a lower bound of vLLM's NCCL path, which adds
             the collective itself)

    python3 tests/gpu/integrations/rl_loop.py --out result.json [--model Qwen/Qwen2.5-0.5B]

The model comes from the local Hugging Face cache (no download: HF_HUB_OFFLINE=1); without it, a
small Qwen2 config is built from scratch. `--selftest` runs the CPU-only parts (fusing, byte
checks) on a random state dict and needs neither a GPU nor transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "integrations", "standins"))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "client", "python", "tests"))

import torch  # noqa: E402

PAD = 64


# ------------------------------------------------------------------------------------------------
# CPU-testable parts: vLLM's fused layout over a Hugging Face state dict.

def fused_buffers(hf: Dict[str, torch.Tensor], vocab: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(vLLM-named fused buffers, Hugging Face name -> view into them), the buffers new tensors on
    the same device holding copies of `hf`. Embedding and head padded to a multiple of 64 rows."""
    buffers: Dict[str, torch.Tensor] = {}
    views: Dict[str, torch.Tensor] = {}
    done = set()
    padded = -(-vocab // PAD) * PAD
    for name, t in hf.items():
        if name in done:
            continue
        module, _, leaf = name.rpartition(".")
        parent, _, part = module.rpartition(".")
        if part in ("q_proj", "k_proj", "v_proj"):
            parts = [f"{parent}.{p}.{leaf}" for p in ("q_proj", "k_proj", "v_proj")]
            fused_name = f"{parent}.qkv_proj.{leaf}"
        elif part in ("gate_proj", "up_proj"):
            parts = [f"{parent}.{p}.{leaf}" for p in ("gate_proj", "up_proj")]
            fused_name = f"{parent}.gate_up_proj.{leaf}"
        elif part in ("embed_tokens", "lm_head"):
            buf = torch.empty((padded,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            buf[:vocab].copy_(t)
            buf[vocab:].zero_()
            buffers[name] = buf
            views[name] = buf[:vocab]
            done.add(name)
            continue
        else:
            buffers[name] = t.detach().clone()
            views[name] = buffers[name]
            done.add(name)
            continue
        rows = [hf[p].shape[0] for p in parts]
        buf = torch.empty((sum(rows),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        off = 0
        for p, r in zip(parts, rows):
            buf[off:off + r].copy_(hf[p])
            views[p] = buf[off:off + r]
            off += r
            done.add(p)
        buffers[fused_name] = buf
    return buffers, views


def byte_mismatches(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> List[str]:
    """Names whose bytes differ between two name -> tensor maps over the same names."""
    bad = []
    for name, t in a.items():
        u = b[name]
        if t.shape != u.shape or t.dtype != u.dtype or not torch.equal(
                t.detach().contiguous().view(torch.uint8), u.detach().contiguous().view(torch.uint8)):
            bad.append(name)
    return bad


def default_path_copy(hf: Dict[str, torch.Tensor], views: Dict[str, torch.Tensor]) -> float:
    """The default sync's data movement on one device: each tensor into a fresh receive buffer
    (the broadcast), then into the engine's parameter (the weight loader). Returns seconds."""
    if any(t.is_cuda for t in hf.values()):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for name, t in hf.items():
        recv = torch.empty_like(t)
        recv.copy_(t)
        views[name].copy_(recv)
    if any(t.is_cuda for t in hf.values()):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def selftest() -> Dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    hf = {"model.embed_tokens.weight": torch.randn(50, 8, generator=g)}
    for p in ("q_proj", "k_proj", "v_proj"):
        hf[f"model.layers.0.self_attn.{p}.weight"] = torch.randn(8 if p == "q_proj" else 4, 8, generator=g)
    for p in ("gate_proj", "up_proj"):
        hf[f"model.layers.0.mlp.{p}.weight"] = torch.randn(12, 8, generator=g)
    hf["model.norm.weight"] = torch.randn(8, generator=g)
    buffers, views = fused_buffers(hf, vocab=50)
    assert set(buffers) == {"model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                            "model.layers.0.mlp.gate_up_proj.weight", "model.norm.weight"}, sorted(buffers)
    assert buffers["model.embed_tokens.weight"].shape == (64, 8)
    assert byte_mismatches(hf, views) == []
    hf["model.norm.weight"].add_(1)
    assert byte_mismatches(hf, views) == ["model.norm.weight"]
    default_path_copy(hf, views)
    assert byte_mismatches(hf, views) == []
    return {"selftest": "passed"}


# ------------------------------------------------------------------------------------------------
# The GPU run.

def load_models(name: str, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        cfg = AutoConfig.from_pretrained(name)
        make = lambda: AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)  # noqa: E731
        source = f"{name} (local Hugging Face cache)"
    except Exception as e:  # noqa: BLE001 (no cache: a small model from scratch)
        from transformers import Qwen2Config
        cfg = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                          torch_dtype="bfloat16")
        seed_state = {}

        def make():
            torch.manual_seed(0)
            m = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
            if not seed_state:
                seed_state.update({k: v.clone() for k, v in m.state_dict().items()})
            else:
                m.load_state_dict(seed_state)
            return m
        source = f"Qwen2 config from scratch ({type(e).__name__}: {e})"
    trainer = make().to(device)
    engine = make().to(device)
    return cfg, trainer, engine, source


def rebind_to_views(model: torch.nn.Module, views: Dict[str, torch.Tensor]) -> None:
    """Points the engine model's parameters at the fused buffers' views (vLLM's memory layout)."""
    for name, view in views.items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, leaf, torch.nn.Parameter(view, requires_grad=False))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


class EngineModule(torch.nn.Module):
    """The vLLM worker's model: its parameters are the fused buffers (vLLM's names), its forward
    the Hugging Face model running on views of them."""

    def __init__(self, hf_model: torch.nn.Module, buffers: Dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.hf_model = [hf_model]
        for name, buf in buffers.items():
            *path, leaf = name.split(".")
            m = self
            for part in path:
                if not hasattr(m, part):
                    m.add_module(part, torch.nn.Module())
                m = getattr(m, part)
            m.register_parameter(leaf, torch.nn.Parameter(buf, requires_grad=False))

    @torch.no_grad()
    def greedy(self, ids: List[int], n: int) -> List[int]:
        return greedy(self.hf_model[0], ids, n)


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: List[int], n: int) -> List[int]:
    dev = next(model.parameters()).device
    out = model.generate(torch.tensor([ids], device=dev), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import harness
    import refit
    from refit.integrations.vllm import LiveModuleSource, RefitTrainerInitInfo
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.entrypoints.llm import LLM
    from vllm.v1.worker.gpu_worker import Worker

    sys.path.insert(0, os.path.join(REPO, "tests", "integrations"))
    import itest  # noqa: F401 (installs refit's entry point as distribution metadata)
    itest.install_entry_point()
    from test_vllm import SyncClient

    device = "cuda"
    cfg, trainer, engine_hf, source = load_models(args.model, device)
    vocab = cfg.vocab_size
    hf_now = lambda: {n: p for n, p in trainer.named_parameters()}  # noqa: E731
    if getattr(cfg, "tie_word_embeddings", False):
        engine_state = {n: p for n, p in engine_hf.named_parameters() if n != "lm_head.weight"}
    else:
        engine_state = dict(engine_hf.named_parameters())
    buffers, views = fused_buffers({n: p.detach() for n, p in engine_state.items()}, vocab)
    rebind_to_views(engine_hf, views)
    engine = EngineModule(engine_hf, buffers)

    result: Dict[str, Any] = {"model": source, "device": torch.cuda.get_device_name(0),
                              "torch": torch.__version__, "rounds": []}
    with harness.Cluster(nodes=1, daemon_flags=["--backend", "cuda"] + args.refitd_flag) as cluster:
        daemon = cluster.daemons[0].worker_address
        vcfg = VllmConfig(model_config=ModelConfig(hf_config=cfg, dtype=torch.bfloat16),
                          weight_transfer_config=WeightTransferConfig(backend="refit"))
        worker = Worker(vcfg, engine, torch.device("cuda", 0))
        llm = LLM([worker])
        client = SyncClient(llm)
        info = RefitTrainerInitInfo(control=cluster.control, daemon=daemon, node=0,
                                    engine={"daemon": daemon, "node": 0, "timeout_s": 120}, timeout_s=120, rank=0)
        sender = WeightTransferTrainerFactory.trainer_init("refit", WeightTransferConfig(backend="refit"), info,
                                                           client=client, source=LiveModuleSource(trainer))
        opt = torch.optim.AdamW(trainer.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, vocab, (16,), generator=g).tolist()
        total_bytes = sum(p.numel() * p.element_size() for p in engine_state.values())
        for step in range(1, args.rounds + 1):
            batch = torch.randint(0, vocab, (4, 64), generator=g).to(device)
            trainer(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for b in buffers.values():
                    b.view(torch.uint8).fill_(0xA5)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sender.send_weights()
            refit_s = time.perf_counter() - t0
            hf_trainer = {n: p for n, p in hf_now().items() if n in views}
            bad = byte_mismatches(hf_trainer, views)
            baseline_s = default_path_copy({n: p.detach() for n, p in hf_trainer.items()}, views)
            tokens_engine = llm.generate(prompt, args.gen_tokens)
            tokens_trainer = greedy(trainer, prompt, args.gen_tokens)
            result["rounds"].append({
                "version": sender.last_version, "bytes": total_bytes, "refit_round_s": refit_s,
                "send_weights_s": sender.last_seconds,
                "default_path_copy_s": baseline_s, "byte_mismatches": bad[:10],
                "tokens_equal": tokens_engine == tokens_trainer,
                "tokens_engine": tokens_engine, "tokens_trainer": tokens_trainer})
        sender.shutdown()
        llm.shutdown()
    result["passed"] = all(not r["byte_mismatches"] and r["tokens_equal"] for r in result["rounds"])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where to write the JSON result")
    ap.add_argument("--model", default="Qwen/Qwen2.5-0.5B")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--refitd-flag", action="append", default=[], help="extra refitd flag (repeatable)")
    ap.add_argument("--selftest", action="store_true", help="CPU-only checks of this script's helpers")
    args = ap.parse_args()
    try:
        result = selftest() if args.selftest else run(args)
    except Exception as e:  # noqa: BLE001 (the JSON says what failed)
        import traceback
        result = {"passed": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    return 0 if result.get("passed", result.get("selftest") == "passed") else 1


if __name__ == "__main__":
    sys.exit(main())
