"""refit's vLLM adapter end to end without vLLM: the stand-in of vLLM's weight-transfer interfaces
(tests/integrations/standins) with a one-layer Qwen2-shaped model, one trainer, one engine, one
refitd. From the repository root, with a refitd running (docs/DEPLOYMENT.md):

    PYTHONPATH=client/python:tests/integrations/standins \\
        python3 tests/integrations/examples/vllm_quickstart.py --control 127.0.0.1:7070 \\
        --daemon unix:/tmp/refitd-0.sock

It prints the version of each round and "engine holds the trainer's weights" when they match.
"""
import argparse

import refit
import refit.integrations.vllm as adapter
import torch
from vllm.config import ModelConfig, VllmConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.entrypoints.llm import LLM
from vllm.v1.worker.gpu_worker import Worker

# What the adapter reads from the engine's hf_config: heads, kv heads, head_dim, vocabulary,
# intermediate size, tied embeddings (refit.layouts.vllm.EngineConfig.from_hf_config).
HF_CONFIG = {"model_type": "qwen2", "vocab_size": 50, "hidden_size": 16, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 32, "num_hidden_layers": 1,
             "tie_word_embeddings": False}
H, Q, KV, INTER, VOCAB, PADDED = 16, 16, 8, 32, 50, 64  # vLLM pads the vocabulary to 64


def module_of(shapes):
    """A module whose named_parameters() are exactly `shapes` (dotted names: submodules)."""
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape) * 0.1))
    return root


L = "model.layers.0."
# The trainer: Hugging Face names, separate q/k/v and gate/up.
TRAINER = {"model.embed_tokens.weight": (VOCAB, H), L + "self_attn.q_proj.weight": (Q, H),
           L + "self_attn.k_proj.weight": (KV, H), L + "self_attn.v_proj.weight": (KV, H),
           L + "self_attn.q_proj.bias": (Q,), L + "self_attn.k_proj.bias": (KV,), L + "self_attn.v_proj.bias": (KV,),
           L + "self_attn.o_proj.weight": (H, Q), L + "mlp.gate_proj.weight": (INTER, H),
           L + "mlp.up_proj.weight": (INTER, H), L + "mlp.down_proj.weight": (H, INTER),
           L + "input_layernorm.weight": (H,), L + "post_attention_layernorm.weight": (H,),
           "model.norm.weight": (H,), "lm_head.weight": (VOCAB, H)}
# The engine: vLLM's parameter names, fused qkv_proj (q, k, v stacked on dim 0) and gate_up_proj
# (gate, up), the vocabulary padded.
ENGINE = {"model.embed_tokens.weight": (PADDED, H), L + "self_attn.qkv_proj.weight": (Q + 2 * KV, H),
          L + "self_attn.qkv_proj.bias": (Q + 2 * KV,), L + "self_attn.o_proj.weight": (H, Q),
          L + "mlp.gate_up_proj.weight": (2 * INTER, H), L + "mlp.down_proj.weight": (H, INTER),
          L + "input_layernorm.weight": (H,), L + "post_attention_layernorm.weight": (H,),
          "model.norm.weight": (H,), "lm_head.weight": (PADDED, H)}


class Client:
    """The trainer's refit.integrations.vllm.WeightSyncClient over the engine client."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info):
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self):
        self.llm.start_weight_update()

    def update_weights(self, update_info):
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self):
        self.llm.finish_weight_update()

    def pause_generation(self, mode):
        self.llm.pause_generation(mode=mode)

    def resume_generation(self):
        self.llm.resume_generation()

    def reset_prefix_cache(self):
        self.llm.reset_prefix_cache()


def engine_matches(trainer, engine):
    t, e = dict(trainer.named_parameters()), dict(engine.named_parameters())
    a = L + "self_attn."
    pairs = [(e[a + "qkv_proj.weight"], torch.cat([t[a + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")])),
             (e[L + "mlp.gate_up_proj.weight"], torch.cat([t[L + "mlp.gate_proj.weight"], t[L + "mlp.up_proj.weight"]])),
             (e["model.embed_tokens.weight"][:VOCAB], t["model.embed_tokens.weight"]),
             (e["model.norm.weight"], t["model.norm.weight"])]
    return all(torch.equal(x.detach(), y.detach()) for x, y in pairs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--control", required=True, help="a refitd's control address, host:port")
    ap.add_argument("--daemon", required=True, help="the local refitd's worker socket, unix:PATH")
    ap.add_argument("--node", type=int, default=0, help="this host's node id")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    adapter.register()  # `pip install` declares this entry point; vLLM then runs it itself

    # Engine side: what vLLM builds in each worker process (CPU here: parameters in shared memory).
    engine = module_of(ENGINE)
    refit.share_module_(engine)
    config = VllmConfig(model_config=ModelConfig(hf_config=HF_CONFIG, dtype=torch.float32),
                        weight_transfer_config=WeightTransferConfig(backend="refit"))
    llm = LLM([Worker(config, engine, torch.device("cpu"))])

    # Trainer side: its live parameters, registered once; one round per send_weights().
    trainer = module_of(TRAINER)
    refit.share_module_(trainer)
    info = adapter.RefitTrainerInitInfo(control=args.control, daemon=args.daemon, node=args.node,
                                        engine={"daemon": args.daemon, "node": args.node, "timeout_s": 30})
    sender = WeightTransferTrainerFactory.trainer_init("refit", WeightTransferConfig(backend="refit"), info,
                                                       client=Client(llm), source=adapter.LiveModuleSource(trainer))
    opt = torch.optim.SGD(trainer.parameters(), lr=0.1)
    try:
        for _ in range(args.rounds):
            sum(p.square().sum() for p in trainer.parameters()).backward()  # a training step
            opt.step()
            opt.zero_grad()
            sender.send_weights()
            print(f"round committed: version {sender.last_version}")
        if not engine_matches(trainer, engine):
            raise SystemExit("the engine's weights differ from the trainer's")
        print("engine holds the trainer's weights")
    finally:
        sender.shutdown()
        llm.shutdown()


if __name__ == "__main__":
    main()
