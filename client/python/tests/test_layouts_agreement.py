"""refit.layouts against refit-layout (client/layout_generator.cc) on the real model configs.

For each config (scaled down), the parameters a real framework would hold are written out
(layout_models: vLLM's modules, DTensor descriptions of FSDP2 and Megatron-style TP), the layout is
derived in Python and compared with refit-layout's JSON after normalising:

* vLLM engines (TP 1/2/4/8/16, DP 2, expert parallel): equal, buffers and pieces included;
* FSDP2 trainers (`--fsdp2`, once refit-layout has it): equal;
* Megatron trainers: the same boxes per worker (Megatron fuses into other buffers), the
  vocabulary excepted (Megatron pads it to a multiple of 128 * tp before splitting, which DTensor's
  Shard of the real vocabulary cannot express);
* seeded random dense and MoE configs (written to a temporary config.json) with random parallel
  settings vLLM accepts: engines and FSDP2 trainers equal.

Where refit-layout disagrees with the framework, the case lists the tensors it gets wrong in
KNOWN (see the report in the docstring of each); the test then requires every difference to be
one of those, and passes silently once refit-layout is fixed. Each pair is also planned across:
Python trainer -> refit-layout engine and refit-layout trainer -> Python engine, verified.
"""

import random
import re
import unittest

import layout_models as lm
from refit.layouts import (EngineConfig, RankPlacement, coverage, diff_layouts, engine_layout,
                           trainer_layout)

# vLLM: FusedMoEParallelConfig.make flattens the experts' TP over DP when expert parallelism is
# off (tp_size = dp * tp, tp_rank = dp_rank * tp + tp_rank); refit-layout splits experts over tp
# only, so each of its dp replicas holds twice (dp times) the rows vLLM's ranks hold.
MOE_DP_WITHOUT_EP = r"\.mlp\.experts\."
# vLLM's DeepseekV2MoE creates gate.e_score_correction_bias as float32; refit-layout declares
# every tensor in the weights' dtype.
ROUTER_BIAS_FP32 = r"e_score_correction_bias"

ENGINE_CASES = [
    # model, scale-down, layers, tp, dp, expert parallel, known disagreements
    ("llama3-8b", 64, 2, 1, 1, False, None),
    ("llama3-8b", 64, 2, 2, 1, False, None),
    ("llama3-8b", 64, 2, 4, 1, False, None),
    ("llama3-8b", 64, 2, 2, 2, False, None),
    ("llama3-8b", 64, 1, 16, 1, False, None),          # 8 kv heads, each on 2 ranks
    ("qwen2.5-7b", 16, 2, 1, 1, False, None),          # q/k/v biases
    ("qwen2.5-7b", 16, 2, 2, 1, False, None),
    ("qwen2.5-7b", 16, 2, 4, 2, False, None),
    ("qwen3-30b-a3b", 16, 2, 1, 1, False, None),
    ("qwen3-30b-a3b", 16, 2, 2, 1, False, None),
    ("qwen3-30b-a3b", 16, 2, 4, 1, False, None),
    ("qwen3-30b-a3b", 16, 1, 8, 1, False, None),       # 4 kv heads, each on 2 ranks
    ("qwen3-30b-a3b", 16, 2, 2, 1, True, None),
    ("qwen3-30b-a3b", 16, 2, 2, 2, True, None),
    ("qwen3-30b-a3b", 16, 2, 1, 2, False, MOE_DP_WITHOUT_EP),
    ("qwen3-30b-a3b", 16, 2, 2, 2, False, MOE_DP_WITHOUT_EP),
    ("qwen3-235b-a22b", 32, 1, 4, 1, True, None),
    ("deepseek-v3", 64, 4, 2, 1, False, ROUTER_BIAS_FP32),
    ("deepseek-v3", 64, 4, 2, 2, True, ROUTER_BIAS_FP32),
    ("kimi-k2", 64, 2, 4, 1, True, ROUTER_BIAS_FP32),
    ("many-small-moe", 1, 1, 2, 2, True, None),
]


def engine_args(scale, layers, tp, dp, ep, first_node=0):
    return ["--side", "inference", "--tp", str(tp), "--dp", str(dp), "--scale-down", str(scale),
            "--layers", str(layers), "--first-node", str(first_node)] + (
        ["--expert-parallel"] if ep else [])


def check_known(test, diffs, known, label):
    """No differences, or (a known disagreement) only differences about tensors matching ``known``."""
    if known is None:
        test.assertEqual(diffs, [], label)
        return
    for d in diffs:
        test.assertRegex(d, known, f"{label}: a difference beyond the known one")


class EngineAgreementTest(unittest.TestCase):
    def test_vllm_engines(self):
        for model, scale, layers, tp, dp, ep, known in ENGINE_CASES:
            label = f"{model} tp{tp} dp{dp}{' ep' if ep else ''}"
            with self.subTest(label):
                m = lm.load_model(model, scale, layers)
                cfg = EngineConfig.from_hf_config(lm.hf_config(m), tp_size=tp, dp_size=dp,
                                                  expert_parallel=ep)
                mine = engine_layout(lambda d, t: lm.vllm_params(m, tp, t, dp, d, ep), cfg)
                ref = lm.refit_layout(model, *engine_args(scale, layers, tp, dp, ep))
                diffs = diff_layouts(mine, ref, limit=200, names=("vllm", "refit-layout"))
                check_known(self, diffs, known, label)

    def test_known_disagreements_are_real(self):
        # The MoE case above differs exactly in the experts' rows: vLLM's rank (d, t) holds rows
        # [(d * tp + t) * i, +i) of each expert, i = moe_intermediate / (dp * tp).
        m = lm.load_model("qwen3-30b-a3b", 16, 1)
        cfg = EngineConfig.from_hf_config(lm.hf_config(m), tp_size=2, dp_size=2)
        mine = engine_layout(lambda d, t: lm.vllm_params(m, 2, t, 2, d), cfg)
        ref = lm.refit_layout("qwen3-30b-a3b", *engine_args(16, 1, 2, 2, False))
        w = {x["name"]: x for x in mine["workers"]}["vllm-dp1-tp0"]
        w13 = {b["name"]: b for b in w["buffers"]}["model.layers.0.mlp.experts.w13_weight"]
        self.assertEqual(w13["shape"], [m.experts, 2 * m.moe_inter // 4, m.hidden])
        w = {x["name"]: x for x in ref["workers"]}["vllm-dp1-tp0"]
        w13 = {b["name"]: b for b in w["buffers"]}["model.layers.0.mlp.experts.w13_weight"]
        self.assertIn(w13["shape"], ([m.experts, 2 * m.moe_inter // 2, m.hidden],
                                     [m.experts, 2 * m.moe_inter // 4, m.hidden]))  # the latter: fixed

    def test_plans_across(self):
        # Python engines fed by refit-layout's Megatron trainers, and the other way round.
        for model, scale, layers, ttp, tdp, tep, etp, edp, eep in [
                ("llama3-8b", 64, 2, 2, 2, 1, 4, 1, False),
                ("qwen3-30b-a3b", 16, 2, 2, 2, 2, 2, 2, True)]:
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
            dp = rng.choice([1, 2]) if (ep or not m.experts) else 1  # see MOE_DP_WITHOUT_EP
            if m.experts and not ep and m.moe_inter % (tp * dp) or ep and tp * dp > m.experts:
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
                                                 ("kimi-k2", 64, 2, 4, 1)]:
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


if __name__ == "__main__":
    unittest.main()
