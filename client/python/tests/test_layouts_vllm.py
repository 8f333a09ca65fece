"""refit.layouts.vllm: engine workers in vLLM's conventions, checked piece by piece on small models,
planned against trainer layouts and verified byte-exact with refit-plan; the errors."""

import unittest

import torch

import layout_models as lm
from refit.layouts import (EngineConfig, LayoutError, ParamSpec, RankPlacement, engine_layout,
                           engine_worker, expert_ids, normalize_layout, trainer_layout)


def pieces(layout, buffer):
    """{tensor: (tensor box, buffer box)} of one buffer of a one-worker layout."""
    for b in layout["workers"][0]["buffers"]:
        if b["name"] == buffer:
            return {p["tensor"]: ((tuple(p["tensorBox"]["origin"]), tuple(p["tensorBox"]["shape"])),
                                  (tuple(p["bufferBox"]["origin"]), tuple(p["bufferBox"]["shape"])))
                    for p in b["pieces"]}
    raise KeyError(buffer)


def shapes(layout):
    return {t["name"]: tuple(t["shape"]) for t in layout["tensors"]}


# A small GQA model: 8 heads of 4, 2 kv heads, hidden 16, intermediate 12, vocab 100.
def small(tp, t, kv_heads=2, vocab=100, heads=8):
    hd, H, I = 4, 16, 12
    kv_t = max(1, kv_heads // tp)
    per = -(-vocab // 64) * 64 // tp
    return {
        "model.embed_tokens.weight": ((per, H), "bf16"),
        "model.layers.0.input_layernorm.weight": ((H,), "bf16"),
        "model.layers.0.self_attn.qkv_proj.weight": (((heads // tp + 2 * kv_t) * hd, H), "bf16"),
        "model.layers.0.self_attn.qkv_proj.bias": (((heads // tp + 2 * kv_t) * hd,), "bf16"),
        "model.layers.0.self_attn.o_proj.weight": ((H, heads // tp * hd), "bf16"),
        "model.layers.0.mlp.gate_up_proj.weight": ((2 * I // tp, H), "bf16"),
        "model.layers.0.mlp.down_proj.weight": ((H, I // tp), "bf16"),
        "model.norm.weight": ((H,), "bf16"),
        "lm_head.weight": ((per, H), "bf16"),
    }


class EngineWorkerTest(unittest.TestCase):
    def test_fused_buffers_tp2(self):
        cfg = EngineConfig(num_attention_heads=8, num_key_value_heads=2, vocab_size=100, tp_size=2,
                           tp_rank=1)
        layout = engine_worker(small(2, 1), cfg)
        w = layout["workers"][0]
        self.assertEqual((w["name"], w["node"], w["gpu"]), ("vllm-dp0-tp1", 0, 1))
        qkv = pieces(layout, "model.layers.0.self_attn.qkv_proj.weight")
        self.assertEqual(qkv["model.layers.0.self_attn.q_proj.weight"],
                         (((16, 0), (16, 16)), ((0, 0), (16, 16))))
        self.assertEqual(qkv["model.layers.0.self_attn.k_proj.weight"],
                         (((4, 0), (4, 16)), ((16, 0), (4, 16))))
        self.assertEqual(qkv["model.layers.0.self_attn.v_proj.weight"],
                         (((4, 0), (4, 16)), ((20, 0), (4, 16))))
        bias = pieces(layout, "model.layers.0.self_attn.qkv_proj.bias")
        self.assertEqual(bias["model.layers.0.self_attn.v_proj.bias"], (((4,), (4,)), ((20,), (4,))))
        gu = pieces(layout, "model.layers.0.mlp.gate_up_proj.weight")
        self.assertEqual(gu["model.layers.0.mlp.gate_proj.weight"], (((6, 0), (6, 16)), ((0, 0), (6, 16))))
        self.assertEqual(gu["model.layers.0.mlp.up_proj.weight"], (((6, 0), (6, 16)), ((6, 0), (6, 16))))
        self.assertEqual(pieces(layout, "model.layers.0.mlp.down_proj.weight")
                         ["model.layers.0.mlp.down_proj.weight"][0], ((0, 6), (16, 6)))
        self.assertEqual(pieces(layout, "model.layers.0.self_attn.o_proj.weight")
                         ["model.layers.0.self_attn.o_proj.weight"][0], ((0, 16), (16, 16)))
        # vocabulary 100 padded to 128: rank 1 holds rows [64, 128), of which [64, 100) are real
        self.assertEqual(pieces(layout, "lm_head.weight")["lm_head.weight"],
                         (((64, 0), (36, 16)), ((0, 0), (36, 16))))
        self.assertEqual(shapes(layout)["model.layers.0.self_attn.k_proj.weight"], (8, 16))
        self.assertEqual(shapes(layout)["model.layers.0.mlp.down_proj.weight"], (16, 12))
        self.assertEqual(shapes(layout)["model.embed_tokens.weight"], (100, 16))

    def test_kv_heads_replicated_when_tp_exceeds_them(self):
        # tp 8 over 2 kv heads: 4 replicas each; rank t holds kv head t // 4
        for t in range(8):
            cfg = EngineConfig(num_attention_heads=8, num_key_value_heads=2, vocab_size=100,
                               tp_size=8, tp_rank=t)
            params = {n: v for n, v in small(8, t).items() if "qkv_proj" in n}
            layout = engine_worker(params, cfg)
            qkv = pieces(layout, "model.layers.0.self_attn.qkv_proj.weight")
            self.assertEqual(qkv["model.layers.0.self_attn.q_proj.weight"][0], ((4 * t, 0), (4, 16)))
            self.assertEqual(qkv["model.layers.0.self_attn.k_proj.weight"],
                             (((4 * (t // 4), 0), (4, 16)), ((4, 0), (4, 16))))
            self.assertEqual(shapes(layout)["model.layers.0.self_attn.v_proj.weight"], (8, 16))

    def test_vocab_rank_past_the_real_rows(self):
        # vocabulary 10 padded to 64 over tp 4: 16 rows each; ranks 1..3 hold no real row
        cfg = EngineConfig(num_attention_heads=8, num_key_value_heads=2, vocab_size=10, tp_size=4,
                           tp_rank=2)
        layout = engine_worker({"model.embed_tokens.weight": ((16, 16), "bf16")}, cfg)
        buf = layout["workers"][0]["buffers"][0]
        self.assertEqual((buf["shape"], buf["pieces"]), ([16, 16], []))

    def test_tied_embeddings(self):
        params = small(1, 0)
        cfg = EngineConfig(num_attention_heads=8, num_key_value_heads=2, vocab_size=100,
                           tie_word_embeddings=True)
        self.assertNotIn("lm_head.weight", shapes(engine_worker(params, cfg)))
        # or the same tensor object under both names (vLLM: lm_head = embed_tokens)
        embed = torch.zeros(128, 16)
        cfg.tie_word_embeddings = False
        layout = engine_worker({"model.embed_tokens.weight": embed, "lm_head.weight": embed}, cfg)
        self.assertEqual(list(shapes(layout)), ["model.embed_tokens.weight"])
        # equal (shape, dtype) literals may be one constant object: not a tie
        layout = engine_worker({"model.embed_tokens.weight": ((128, 16), "bf16"),
                                "lm_head.weight": ((128, 16), "bf16")}, cfg)
        self.assertEqual(sorted(shapes(layout)), ["lm_head.weight", "model.embed_tokens.weight"])

    def test_experts_tp_and_ep(self):
        def moe(e_local, inter_t):
            return {"model.layers.0.mlp.gate.weight": ((6, 16), "bf16"),
                    "model.layers.0.mlp.experts.w13_weight": ((e_local, 2 * inter_t, 16), "bf16"),
                    "model.layers.0.mlp.experts.w2_weight": ((e_local, 16, inter_t), "bf16")}
        # TP 2 DP 2, no EP: experts' TP is flattened over DP (4 ranks), all 6 experts everywhere
        cfg = EngineConfig(num_attention_heads=8, num_experts=6, tp_size=2, dp_size=2, tp_rank=1,
                           dp_rank=1, moe_intermediate_size=8)
        layout = engine_worker(moe(6, 2), cfg)
        w13 = pieces(layout, "model.layers.0.mlp.experts.w13_weight")
        self.assertEqual(w13["model.layers.0.mlp.experts.5.up_proj.weight"],
                         (((6, 0), (2, 16)), ((5, 2, 0), (1, 2, 16))))
        self.assertEqual(pieces(layout, "model.layers.0.mlp.experts.w2_weight")
                         ["model.layers.0.mlp.experts.4.down_proj.weight"],
                         (((0, 6), (16, 2)), ((4, 0, 0), (1, 16, 2))))
        self.assertEqual(shapes(layout)["model.layers.0.mlp.experts.0.gate_proj.weight"], (8, 16))
        # EP over 4 ranks: 6 experts -> 2, 2, 1, 1 (linear) or {1, 5} on rank 1 (round robin)
        self.assertEqual([expert_ids(6, 4, r) for r in range(4)], [[0, 1], [2, 3], [4], [5]])
        self.assertEqual(expert_ids(6, 4, 1, "round_robin"), [1, 5])
        cfg = EngineConfig(num_attention_heads=8, num_experts=6, tp_size=2, dp_size=2, tp_rank=0,
                           dp_rank=1, expert_parallel=True)
        layout = engine_worker(moe(1, 8), cfg)
        w13 = pieces(layout, "model.layers.0.mlp.experts.w13_weight")
        self.assertEqual(w13, {"model.layers.0.mlp.experts.4.gate_proj.weight":
                               (((0, 0), (8, 16)), ((0, 0, 0), (1, 8, 16))),
                               "model.layers.0.mlp.experts.4.up_proj.weight":
                               (((0, 0), (8, 16)), ((0, 8, 0), (1, 8, 16)))})
        cfg.expert_placement = "round_robin"
        cfg.dp_rank, cfg.tp_rank = 0, 1
        layout = engine_worker(moe(2, 8), cfg)
        self.assertEqual(sorted(pieces(layout, "model.layers.0.mlp.experts.w2_weight")),
                         ["model.layers.0.mlp.experts.1.down_proj.weight",
                          "model.layers.0.mlp.experts.5.down_proj.weight"])

    def test_mla_fused_qkv_a(self):
        m = lm.load_model("deepseek-v3", scale_down=64, layers=1)
        cfg = EngineConfig.from_hf_config(lm.hf_config(m), tp_size=2, tp_rank=0)
        layout = engine_worker(lm.vllm_params(m, 2, 0), cfg)
        fused = pieces(layout, "model.layers.0.self_attn.fused_qkv_a_proj.weight")
        H = m.hidden
        self.assertEqual(fused["model.layers.0.self_attn.q_a_proj.weight"],
                         (((0, 0), (m.q_lora, H)), ((0, 0), (m.q_lora, H))))
        self.assertEqual(fused["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][1],
                         ((m.q_lora, 0), (m.kv_lora + m.rope, H)))

    def test_torch_module(self):
        # A module tree with vLLM's parameter names (what model.named_parameters() gives).
        class Attn(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv_proj = torch.nn.Linear(16, 48, bias=False)  # (8/2 + 2 * 2/2) heads * 4
                self.o_proj = torch.nn.Linear(16, 16, bias=False)

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.self_attn = Attn()
                self.input_layernorm = torch.nn.LayerNorm(16, elementwise_affine=True)

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed_tokens = torch.nn.Embedding(64, 16)
                self.layers = torch.nn.ModuleList([Layer()])

        class ForCausalLM(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = Model()
                self.lm_head = torch.nn.Linear(16, 64, bias=False)
                self.lm_head.weight = self.model.embed_tokens.weight  # tied

        net = ForCausalLM()
        net.model.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(torch.zeros(16, 16))
        cfg = EngineConfig(num_attention_heads=8, num_key_value_heads=2, vocab_size=100, tp_size=2)
        cfg.sharding = dict(cfg.sharding)
        layout = engine_worker(net.bfloat16(), cfg)
        self.assertEqual(sorted(shapes(layout)), sorted([
            "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
            "model.layers.0.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight",
            "model.layers.0.input_layernorm.bias"]))
        self.assertEqual({t["dtype"] for t in layout["tensors"]}, {"bf16"})

    def test_extending_the_mapping(self):
        # A model fusing w1/w3 as "w13" and naming its attention output "wo".
        cfg = EngineConfig(num_attention_heads=4, tp_size=2, tp_rank=1)
        cfg.packed_modules = {**cfg.packed_modules, "w13": ["w1", "w3"]}
        cfg.sharding = {**cfg.sharding, "w1": "column", "w3": "column", "wo": "row_heads"}
        cfg.name_map = lambda path: path.replace("blocks.", "model.layers.")
        layout = engine_worker({"blocks.0.ffn.w13.weight": ((10, 8), "fp16"),
                                "blocks.0.attn.wo.weight": ((8, 4), "fp16")}, cfg)
        self.assertEqual(pieces(layout, "blocks.0.ffn.w13.weight"),
                         {"model.layers.0.ffn.w1.weight": (((5, 0), (5, 8)), ((0, 0), (5, 8))),
                          "model.layers.0.ffn.w3.weight": (((5, 0), (5, 8)), ((5, 0), (5, 8)))})
        self.assertEqual(shapes(layout)["model.layers.0.attn.wo.weight"], (8, 8))

    def test_errors_name_the_parameter(self):
        base = dict(num_attention_heads=8, num_key_value_heads=2, vocab_size=100)
        cases = [
            ({"model.layers.0.self_attn.rotary.weight": ((4,), "bf16")}, dict(tp_size=2),
             "'model.layers.0.self_attn.rotary.weight'.*no sharding rule for module 'rotary'"),
            ({"model.layers.0.self_attn.qkv_proj.weight": ((48, 16), "bf16")}, dict(tp_size=3),
             "qkv_proj.weight'.*TP 3 does not divide num_attention_heads 8"),
            ({"model.layers.0.self_attn.o_proj.weight": ((16, 4), "bf16")},
             dict(tp_size=16, num_attention_heads=8), "o_proj.weight'.*TP 16 does not divide"),
            ({"model.layers.0.self_attn.qkv_proj.weight": ((40, 16), "bf16")},
             dict(tp_size=4, num_key_value_heads=3, num_attention_heads=12),
             "TP 4 exceeds num_key_value_heads 3"),
            ({"model.layers.0.self_attn.qkv_proj.weight": ((47, 16), "bf16")}, dict(tp_size=2),
             "cannot infer head_dim from 47 rows"),
            ({"model.embed_tokens.weight": ((60, 16), "bf16")}, dict(tp_size=2),
             "embed_tokens.weight'.*60 rows per rank.*padded to 128.*gives 64"),
            ({"model.layers.0.mlp.gate_up_proj.weight_scale": ((2,), "fp32")}, {},
             "weight_scale'.*not a weight or bias"),
            ({"model.layers.0.mlp.experts.w13_weight": ((3, 8, 16), "bf16")},
             dict(num_experts=8, tp_size=2, expert_parallel=True),
             "w13_weight'.*holds 3 experts.*give rank 0 4"),
            ({"model.layers.0.mlp.experts.w13_weight": ((3, 8, 16), "bf16")}, {},
             "w13_weight'.*need EngineConfig.num_experts"),
            ({"model.layers.0.mlp.gate_up_proj.weight": ((10, 16), "bf16")},
             dict(intermediate_size=12, tp_size=2), "gate_up_proj.weight'.*intermediate_size 12"),
            ({"model.layers.0.mlp.gate_up_proj.weight": ((11, 16), "bf16")}, {},
             "gate_up_proj.weight'.*11 rows do not split"),
        ]
        for params, over, msg in cases:
            with self.subTest(msg=msg):
                cfg = EngineConfig(**{**base, **over})
                with self.assertRaisesRegex(LayoutError, msg):
                    engine_worker(params, cfg)

    def test_engine_layout_places_ranks(self):
        cfg = EngineConfig(num_attention_heads=8, num_key_value_heads=2, vocab_size=100, tp_size=2,
                           dp_size=2)
        layout = engine_layout(lambda d, t: small(2, t), cfg, placement=RankPlacement(2, first_node=4))
        self.assertEqual([(w["name"], w["node"], w["gpu"]) for w in layout["workers"]],
                         [("vllm-dp0-tp0", 4, 0), ("vllm-dp0-tp1", 4, 1),
                          ("vllm-dp1-tp0", 5, 0), ("vllm-dp1-tp1", 5, 1)])


class PlanTest(unittest.TestCase):
    """Trainer layouts derived from DTensor placements refit into vLLM engines, byte-exact."""

    CASES = [
        # model, scale, layers, trainer mesh, placements_of(name) on it, engine tp, dp, ep
        ("llama3-8b", 64, 2, (4,), lambda n: ["S(0)"], 2, 1, False),
        ("llama3-8b", 64, 2, (3,), lambda n: ["S(0)"], 4, 2, False),           # uneven FSDP
        ("qwen2.5-7b", 16, 2, (2, 2),
         lambda n: ["_S(0, 2)", "S(0)"] if lm.tp_placement(n) == "S(0)" else
         ["S(0)", lm.tp_placement(n) or "R"], 4, 1, False),                      # FSDP2 + TP
        ("qwen3-30b-a3b", 16, 1, (2, 4), lambda n: ["R", "S(0)"], 2, 2, True),  # HSDP -> EP
        ("qwen3-30b-a3b", 16, 1, (2, 2, 2),
         lambda n: ["R", "_S(0, 2)", "S(0)"] if lm.tp_placement(n) == "S(0)" else
         ["R", "S(0)", lm.tp_placement(n) or "R"], 8, 1, False),                # kv replicated
        ("deepseek-v3", 64, 4, (4,), lambda n: ["S(0)"], 2, 2, True),
    ]

    def test_trainer_to_engine(self):
        for model, scale, layers, mesh, placements_of, tp, dp, ep in self.CASES:
            with self.subTest(model=model, mesh=mesh, tp=tp, dp=dp, ep=ep):
                m = lm.load_model(model, scale, layers)
                trainer = trainer_layout({n: ParamSpec(s, "bf16", placements_of(n))
                                          for n, (s, _) in lm.hf_tensors(m).items()}, mesh)
                cfg = EngineConfig.from_hf_config(lm.hf_config(m), tp_size=tp, dp_size=dp,
                                                  expert_parallel=ep)
                engine = engine_layout(lambda d, t: lm.vllm_params(m, tp, t, dp, d, ep), cfg,
                                       placement=RankPlacement(first_node=4))
                rc, out = lm.plan_verify(trainer, engine)
                self.assertEqual(rc, 0, out)
                # the engine's tensors are the trainer's (names and shapes)
                self.assertEqual({n: s for n, (s, _) in normalize_layout(engine)["tensors"].items()},
                                 {n: s for n, (s, _) in normalize_layout(trainer)["tensors"].items()})


if __name__ == "__main__":
    unittest.main()
