"""refit.layouts against refit-layout (client/models/layout_generator.cc) on the real model configs.

For each config (scaled down), the parameters a real framework would hold are written out
(layout_models: vLLM's modules, DTensor descriptions of FSDP2 and Megatron-style TP), the layout is
derived in Python and compared with refit-layout's JSON after normalising:

* vLLM engines (TP 1/2/4/8/16, DP 2 with and without expert parallelism): equal, buffers, pieces
  and dtypes included (the routed experts' rows split over all dp * tp ranks when expert
  parallelism is off, as FusedMoEParallelConfig.make flattens tp across dp; DeepSeek's
  gate.e_score_correction_bias in fp32);
* FSDP2 trainers (`--fsdp2`, once refit-layout has it): equal;
* Megatron trainers: the same boxes per worker (Megatron fuses into other buffers), the
  vocabulary excepted (Megatron pads it to a multiple of 128 * tp before splitting, which DTensor's
  Shard of the real vocabulary cannot express);
* seeded random dense and MoE configs (written to a temporary config.json) with random parallel
  settings vLLM accepts: engines and FSDP2 trainers equal.

Every case requires exact equality: refit-layout has no known disagreement with these frameworks
left. Pairs are also planned across: Python trainer -> refit-layout engine and refit-layout
trainer -> Python engine, verified.
"""

import json
import random
import re
import unittest
from pathlib import Path

import layout_models as lm
from refit.layouts import (EngineConfig, RankPlacement, coverage, diff_layouts, engine_layout,
                           trainer_layout)

ENGINE_CASES = [
    # model, scale-down, layers, tp, dp, expert parallel
    ("llama3-8b", 64, 2, 1, 1, False),
    ("llama3-8b", 64, 2, 2, 1, False),
    ("llama3-8b", 64, 2, 4, 1, False),
    ("llama3-8b", 64, 2, 2, 2, False),
    ("llama3-8b", 64, 1, 16, 1, False),          # 8 kv heads, each on 2 ranks
    ("qwen2.5-7b", 16, 2, 1, 1, False),          # q/k/v biases
    ("qwen2.5-7b", 16, 2, 2, 1, False),
    ("qwen2.5-7b", 16, 2, 4, 2, False),
    ("qwen3-30b-a3b", 16, 2, 1, 1, False),
    ("qwen3-30b-a3b", 16, 2, 2, 1, False),
    ("qwen3-30b-a3b", 16, 2, 4, 1, False),
    ("qwen3-30b-a3b", 16, 1, 8, 1, False),       # 4 kv heads, each on 2 ranks
    ("qwen3-30b-a3b", 16, 2, 2, 1, True),
    ("qwen3-30b-a3b", 16, 2, 2, 2, True),
    # Without expert parallelism, dp > 1: the experts' rows over all dp * tp ranks.
    ("qwen3-30b-a3b", 16, 2, 1, 2, False),
    ("qwen3-30b-a3b", 16, 2, 2, 2, False),
    ("qwen3-30b-a3b", 16, 1, 2, 4, False),       # 48 rows of each expert over 8 ranks
    ("qwen3-235b-a22b", 32, 1, 4, 1, True),
    ("qwen3-235b-a22b", 32, 1, 2, 2, False),
    # DeepSeek: fp32 router bias; shared experts TP within the replica, routed over dp * tp.
    ("deepseek-v3", 64, 4, 2, 1, False),
    ("deepseek-v3", 64, 4, 2, 2, False),
    ("deepseek-v3", 64, 4, 2, 2, True),
    ("kimi-k2", 64, 2, 4, 1, True),
    ("kimi-k2", 64, 2, 2, 4, False),
    ("many-small-moe", 1, 1, 2, 2, True),
    ("many-small-moe", 1, 1, 2, 2, False),
    # DeepSeek-V2: MLA without q_lora (Lite: q_proj), greedy routers without a bias, 2 shared experts.
    ("deepseek-v2-lite", 16, 3, 2, 2, False),
    ("deepseek-v2-lite", 16, 3, 2, 1, True),
    ("deepseek-v2", 64, 2, 4, 1, True),
    ("deepseek-v2", 64, 2, 2, 2, False),
    # Mixtral: block_sparse_moe, experts w1/w3 stacked in w13_weight, w2 in w2_weight.
    ("mixtral-8x7b", 64, 2, 1, 1, False),
    ("mixtral-8x7b", 64, 2, 2, 1, False),
    ("mixtral-8x7b", 64, 2, 2, 2, False),
    ("mixtral-8x7b", 64, 2, 2, 2, True),
    ("mixtral-8x7b", 64, 1, 8, 1, False),
]


def engine_args(scale, layers, tp, dp, ep, first_node=0):
    return ["--side", "inference", "--tp", str(tp), "--dp", str(dp), "--scale-down", str(scale),
            "--layers", str(layers), "--first-node", str(first_node)] + (
        ["--expert-parallel"] if ep else [])


def by_name(items, name):
    return {x["name"]: x for x in items}[name]


def replicas(layout):
    """{worker: (replica, rank, size)}: the engine replica each worker declares (proto3 JSON omits
    zeros)."""
    return {w["name"]: (w.get("replica", ""), int(w.get("replicaRank", 0)), int(w.get("replicaSize", 0)))
            for w in layout["workers"]}


class EngineAgreementTest(unittest.TestCase):
    def test_vllm_engines(self):
        for model, scale, layers, tp, dp, ep in ENGINE_CASES:
            label = f"{model} tp{tp} dp{dp}{' ep' if ep else ''}"
            with self.subTest(label):
                m = lm.load_model(model, scale, layers)
                cfg = EngineConfig.from_hf_config(lm.hf_config(m), tp_size=tp, dp_size=dp,
                                                  expert_parallel=ep)
                mine = engine_layout(lambda d, t: lm.vllm_params(m, tp, t, dp, d, ep), cfg)
                ref = lm.refit_layout(model, *engine_args(scale, layers, tp, dp, ep))
                self.assertEqual(diff_layouts(mine, ref, limit=200, names=("vllm", "refit-layout")),
                                 [], label)
                self.assertEqual(replicas(mine), replicas(ref), label)
                # Dense: one replica per DP rank, of tp ranks; MoE: the whole dp * tp world.
                moe = cfg.num_experts > 0
                for d in range(dp):
                    for t in range(tp):
                        want = ("engine", d * tp + t, dp * tp) if moe else (f"dp{d}", t, tp)
                        self.assertEqual(replicas(ref)[f"vllm-dp{d}-tp{t}"], want, label)

    def test_experts_flattened_over_dp_and_tp(self):
        # Without expert parallelism vLLM's rank (d, t) holds rows [(d * tp + t) * i, +i) of each
        # expert, i = moe_intermediate / (dp * tp); attention stays TP within the replica.
        m = lm.load_model("qwen3-30b-a3b", 16, 1)
        i = m.moe_inter // 4
        for layout in (lm.refit_layout("qwen3-30b-a3b", *engine_args(16, 1, 2, 2, False)),
                       engine_layout(lambda d, t: lm.vllm_params(m, 2, t, 2, d),
                                     EngineConfig.from_hf_config(lm.hf_config(m), tp_size=2,
                                                                 dp_size=2))):
            for d in range(2):
                for t in range(2):
                    w = by_name(layout["workers"], f"vllm-dp{d}-tp{t}")
                    w13 = by_name(w["buffers"], "model.layers.0.mlp.experts.w13_weight")
                    self.assertEqual(w13["shape"], [m.experts, 2 * i, m.hidden])
                    w2 = by_name(w["buffers"], "model.layers.0.mlp.experts.w2_weight")
                    self.assertEqual(w2["shape"], [m.experts, m.hidden, i])
                    gate = [p for p in w13["pieces"]
                            if p["tensor"] == "model.layers.0.mlp.experts.0.gate_proj.weight"]
                    self.assertEqual(len(gate), 1)
                    self.assertEqual(gate[0]["tensorBox"]["origin"][0], (d * 2 + t) * i)
                    self.assertEqual(gate[0]["tensorBox"]["shape"][0], i)
                    qkv = by_name(w["buffers"], "model.layers.0.self_attn.qkv_proj.weight")
                    self.assertEqual(qkv["shape"][0], (m.heads // 2 + 2 * max(1, m.kv_heads // 2))
                                     * m.head_dim)

    def test_router_bias_is_fp32(self):
        # vLLM's DeepseekV2MoE: nn.Parameter(torch.empty(n_routed_experts, dtype=torch.float32)).
        for model, layers in (("deepseek-v3", 4), ("kimi-k2", 2)):
            with self.subTest(model):
                ref = lm.refit_layout(model, *engine_args(64, layers, 2, 2, False))
                name = f"model.layers.{layers - 1}.mlp.gate.e_score_correction_bias"
                self.assertEqual(by_name(ref["tensors"], name)["dtype"], "fp32")
                self.assertEqual(by_name(ref["tensors"], f"model.layers.{layers - 1}.mlp.gate.weight")
                                 ["dtype"], "bf16")
                for w in ref["workers"]:
                    self.assertEqual(by_name(w["buffers"], name)["dtype"], "fp32")

    def test_plans_across(self):
        # Python engines fed by refit-layout's Megatron trainers, and the other way round.
        for model, scale, layers, ttp, tdp, tep, etp, edp, eep in [
                ("llama3-8b", 64, 2, 2, 2, 1, 4, 1, False),
                ("qwen3-30b-a3b", 16, 2, 2, 2, 2, 2, 2, True),
                ("qwen3-30b-a3b", 16, 2, 2, 2, 2, 2, 2, False),
                ("deepseek-v3", 64, 4, 2, 2, 2, 2, 2, False)]:
            with self.subTest(model=model):
                m = lm.load_model(model, scale, layers)
                cfg = EngineConfig.from_hf_config(lm.hf_config(m), tp_size=etp, dp_size=edp,
                                                  expert_parallel=eep)
                engine = engine_layout(lambda d, t: lm.vllm_params(m, etp, t, edp, d, eep), cfg,
                                       placement=RankPlacement(first_node=2))
                trainer = lm.refit_layout(model, "--side", "trainer", "--tp", str(ttp), "--dp",
                                          str(tdp), "--ep", str(tep), "--scale-down", str(scale),
                                          "--layers", str(layers))
                rc, out = lm.plan_verify(trainer, engine)
                self.assertEqual(rc, 0, out)
                mine = trainer_layout(lm.megatron_specs(m, ttp, tdp, 1, tep), (tdp, ttp),
                                      worker_name="trainer-rank{rank}")
                ref_engine = lm.refit_layout(model, *engine_args(scale, layers, etp, edp, eep, 2))
                rc, out = lm.plan_verify(mine, ref_engine)
                self.assertEqual(rc, 0, out)


class RandomConfigAgreementTest(unittest.TestCase):
    """Seeded random dense and MoE configs and parallel settings vLLM accepts: the Python engine
    and FSDP2 trainer equal refit-layout's, and the pair plans and verifies."""

    def random_config(self, rng):
        kv = rng.choice([1, 2, 4])
        heads = kv * rng.choice([1, 2, 4])
        c = {"model_type": rng.choice(["llama", "qwen2", "qwen3"]), "hidden_size": rng.choice([16, 24, 32]),
             "num_attention_heads": heads, "num_key_value_heads": kv,
             "head_dim": rng.choice([2, 4, 8]), "intermediate_size": 8 * rng.randint(1, 6),
             "num_hidden_layers": rng.randint(1, 3), "vocab_size": rng.randint(30, 300),
             "tie_word_embeddings": rng.random() < 0.3, "torch_dtype": "bfloat16"}
        if rng.random() < 0.4:
            c.update(model_type="qwen3_moe", num_experts=rng.randint(2, 12),
                     moe_intermediate_size=4 * rng.randint(1, 4), decoder_sparse_step=rng.choice([1, 2]))
        return c

    def test_random(self):
        rng = random.Random(7)
        done = 0
        while done < 30:
            c = self.random_config(rng)
            m = lm.model_from_config(c)
            tp = rng.choice([t for t in (1, 2, 4, 8) if m.heads % t == 0 and (
                m.kv_heads % t == 0 or t % m.kv_heads == 0) and m.inter % t == 0])
            ep = m.experts > 0 and rng.random() < 0.5
            dp = rng.choice([1, 2])
            # vLLM refuses: dp * tp not dividing the experts' width (FusedMoE, no EP), more EP
            # ranks than experts, tp above the experts (the Qwen-MoE block).
            if m.experts and (not ep and m.moe_inter % (tp * dp) or ep and tp * dp > m.experts
                              or tp > m.experts):
                continue
            done += 1
            label = f"{c} tp{tp} dp{dp} ep{ep}"
            with self.subTest(label):
                path = lm.write_config(c)
                cfg = EngineConfig.from_hf_config(lm.hf_config(m), tp_size=tp, dp_size=dp,
                                                  expert_parallel=ep)
                engine = engine_layout(lambda d, t: lm.vllm_params(m, tp, t, dp, d, ep), cfg,
                                       placement=RankPlacement(first_node=3))
                ref = lm.refit_layout(path, *engine_args(1, 0, tp, dp, ep, first_node=3))
                self.assertEqual(diff_layouts(engine, ref, names=("vllm", "refit-layout")), [], label)
                self.assertEqual(replicas(engine), replicas(ref), label)
                shards = rng.randint(1, 5)
                trainer = trainer_layout(lm.fsdp2_specs(m, shards), (1, shards))
                if lm.refit_layout_has_flag("fsdp2"):
                    ref = lm.refit_layout(path, "--side", "trainer", "--fsdp2", str(shards))
                    self.assertEqual(diff_layouts(trainer, ref, names=("fsdp2", "refit-layout")), [],
                                     label)
                rc, out = lm.plan_verify(trainer, engine)
                self.assertEqual(rc, 0, out)


class TrainerAgreementTest(unittest.TestCase):
    MEGATRON_CASES = [
        # model, scale-down, layers, tp, dp, pp, ep
        ("llama3-8b", 64, 2, 2, 2, 1, 1),
        ("llama3-8b", 64, 4, 4, 1, 2, 1),
        ("qwen2.5-7b", 16, 3, 2, 1, 2, 1),
        ("qwen3-30b-a3b", 16, 2, 2, 2, 1, 2),
        ("qwen3-30b-a3b", 16, 2, 1, 4, 1, 4),
        ("deepseek-v3", 64, 4, 2, 2, 1, 2),
        ("deepseek-v2-lite", 16, 3, 2, 2, 1, 2),
        ("mixtral-8x7b", 64, 2, 2, 2, 1, 2),
        ("mixtral-8x7b", 64, 4, 1, 2, 2, 2),
    ]

    def test_megatron_boxes(self):
        vocab = re.compile(r"embed_tokens|lm_head")
        for model, scale, layers, tp, dp, pp, ep in self.MEGATRON_CASES:
            label = f"{model} tp{tp} dp{dp} pp{pp} ep{ep}"
            with self.subTest(label):
                m = lm.load_model(model, scale, layers)
                mine = trainer_layout(lm.megatron_specs(m, tp, dp, pp, ep), (dp * pp, tp),
                                      worker_name="trainer-rank{rank}")
                ref = lm.refit_layout(model, "--side", "trainer", "--tp", str(tp), "--dp", str(dp),
                                      "--pp", str(pp), "--ep", str(ep), "--scale-down", str(scale),
                                      "--layers", str(layers))
                a, b = coverage(mine), coverage(ref)
                self.assertEqual(sorted(a), sorted(b))
                for w in a:
                    strip = lambda c: {t: v for t, v in c.items() if not vocab.search(t)}  # noqa: E731
                    self.assertEqual(strip(a[w]), strip(b[w]), f"{label} worker {w}")
                    self.assertEqual(sorted(t for t in a[w] if vocab.search(t)),
                                     sorted(t for t in b[w] if vocab.search(t)))
                rc, out = lm.plan_verify(ref, mine)
                self.assertEqual(rc, 0, out)

    def test_fsdp2(self):
        if not lm.refit_layout_has_flag("fsdp2"):
            self.skipTest("refit-layout has no --fsdp2 yet")
        for model, scale, layers, shards, dp in [("llama3-8b", 64, 2, 4, 1),
                                                 ("llama3-8b", 64, 2, 7, 1),   # uneven, empty
                                                 ("qwen2.5-7b", 16, 2, 3, 2),  # HSDP
                                                 ("qwen3-30b-a3b", 16, 1, 8, 1),
                                                 ("deepseek-v3", 64, 4, 4, 1),
                                                 ("kimi-k2", 64, 2, 4, 1),
                                                 ("deepseek-v2-lite", 16, 3, 4, 1),
                                                 ("deepseek-v2", 64, 2, 3, 2),
                                                 ("mixtral-8x7b", 64, 2, 4, 1)]:
            label = f"{model} fsdp2 {shards} dp {dp}"
            with self.subTest(label):
                m = lm.load_model(model, scale, layers)
                # transformers' DeepseekV3 registers gate.e_score_correction_bias as a module buffer
                buffers = (lambda n: n.endswith("e_score_correction_bias")) \
                    if m.model_type == "deepseek_v3" else (lambda n: False)
                mine = trainer_layout(lm.fsdp2_specs(m, shards, dp, buffers), (dp, shards))
                ref = lm.refit_layout(model, "--side", "trainer", "--fsdp2", str(shards), "--dp",
                                      str(dp), "--scale-down", str(scale), "--layers", str(layers))
                self.assertEqual(diff_layouts(mine, ref, names=("fsdp2", "refit-layout")), [], label)


def fp8_params(params, block):
    """vLLM's parameters of a block-fp8 model (Fp8LinearMethod, Fp8MoEMethod with
    weight_block_size): every linear weight in float8_e4m3fn, with its weight_scale_inv over the
    blocks of the parameter's last two dims."""
    out = {}
    for name, (shape, dtype) in params.items():
        linear = name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight") or \
            name.endswith("experts.w13_weight") or name.endswith("experts.w2_weight")
        if not linear:
            out[name] = (shape, dtype)
            continue
        out[name] = (shape, "fp8_e4m3")
        grid = tuple(shape[:-2]) + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
        out[name + "_scale_inv"] = (grid, "fp32")
    return out


class Fp8EngineAgreementTest(unittest.TestCase):
    """vLLM engines serving block fp8: the Python engine layout (weights in fp8 with their
    weight_scale_inv parameters) equals refit-layout --dtype fp8-block's, quantization and scale
    pieces included, and bf16 trainers plan into it and verify against the CPU reference."""

    CASES = [
        # model, scale-down, layers, tp, dp, expert parallel, block
        ("llama3-8b", 8, 2, 2, 1, False, (64, 64)),
        ("llama3-8b", 8, 2, 1, 2, False, (128, 128)),
        ("qwen3-30b-a3b", 4, 1, 2, 1, True, (32, 32)),
        ("deepseek-v3", 64, 4, 1, 2, True, (8, 8)),
        ("mixtral-8x7b", 16, 1, 2, 1, False, (16, 16)),
    ]

    def test_fp8_engines(self):
        for model, scale, layers, tp, dp, ep, block in self.CASES:
            label = f"{model} tp{tp} dp{dp}{' ep' if ep else ''} block {block}"
            with self.subTest(label):
                m = lm.load_model(model, scale, layers)
                hf = dict(lm.hf_config(m), quantization_config={
                    "quant_method": "fp8", "weight_block_size": list(block)})
                cfg = EngineConfig.from_hf_config(hf, tp_size=tp, dp_size=dp, expert_parallel=ep)
                self.assertEqual(cfg.weight_block_size, block)
                mine = engine_layout(lambda d, t: fp8_params(lm.vllm_params(m, tp, t, dp, d, ep), block), cfg)
                path = lm.write_config(dict(json.loads(Path(lm.config_path(model)).read_text()),
                                            quantization_config={"quant_method": "fp8",
                                                                 "weight_block_size": list(block)}))
                ref = lm.refit_layout(path, *engine_args(scale, layers, tp, dp, ep), "--dtype", "fp8-block")
                self.assertEqual(diff_layouts(mine, ref, limit=200, names=("vllm", "refit-layout")), [], label)
                quantized = [t for t in mine["tensors"] if t.get("quantization")]
                self.assertTrue(quantized, label)
                for t in quantized:
                    self.assertEqual(t["dtype"], "fp8_e4m3")
                    self.assertEqual(t["quantization"]["scale"], t["name"] + "_scale_inv")
                trainer = lm.refit_layout(model, "--side", "trainer", "--fsdp", "2", "--scale-down",
                                          str(scale), "--layers", str(layers))
                rc, out = lm.plan_verify(trainer, mine)
                self.assertEqual(rc, 0, out)

    def test_fp8_by_default_from_quantization_config(self):
        # DeepSeek-V3 as shipped, its blocks made 8x8 to fit the scaled-down widths: refit-layout
        # without --dtype gives the fp8 engine the Python side derives from the same config.
        shipped = json.loads(Path(lm.config_path("deepseek-v3-fp8")).read_text())
        self.assertEqual(shipped["quantization_config"]["weight_block_size"], [128, 128])
        shipped["quantization_config"]["weight_block_size"] = [8, 8]
        path = lm.write_config(shipped)
        m = lm.model_from_config(shipped, 64, 4)
        cfg = EngineConfig.from_hf_config(dict(lm.hf_config(m), quantization_config=shipped["quantization_config"]),
                                          tp_size=1, dp_size=2, expert_parallel=True)
        mine = engine_layout(lambda d, t: fp8_params(lm.vllm_params(m, 1, t, 2, d, True), (8, 8)), cfg)
        ref = lm.refit_layout(path, *engine_args(64, 4, 1, 2, True))
        self.assertEqual(diff_layouts(mine, ref, limit=200, names=("vllm", "refit-layout")), [])
        self.assertIn("fp8_e4m3", {t["dtype"] for t in ref["tensors"]})
        bf16 = lm.refit_layout(path, *engine_args(64, 4, 1, 2, True), "--dtype", "bf16")
        self.assertNotIn("fp8_e4m3", {t["dtype"] for t in bf16["tensors"]})
        self.assertFalse([t for t in bf16["tensors"] if t["name"].endswith("_scale_inv")])

    def test_refusals(self):
        m = lm.load_model("llama3-8b", 8, 1)
        cfg = EngineConfig.from_hf_config(lm.hf_config(m), tp_size=1)
        with self.assertRaisesRegex(Exception, "weight_block_size"):
            engine_layout(lambda d, t: fp8_params(lm.vllm_params(m, 1, t), (128, 128)), cfg)
        # A TP that cuts a block (64 kv rows per rank with 128-row blocks): refused by name.
        cfg = EngineConfig.from_hf_config(dict(lm.hf_config(m), quantization_config={
            "quant_method": "fp8", "weight_block_size": [128, 128]}), tp_size=4)
        with self.assertRaisesRegex(Exception, "cut a 128x128 block"):
            engine_layout(lambda d, t: fp8_params(lm.vllm_params(m, 4, t), (128, 128)), cfg)


if __name__ == "__main__":
    unittest.main()
