"""The real-model harness on the CPU for the MoE families (docs/MODELS.md): DeepSeek-V3 (MLA with
q_lora, a dense first layer, shared experts, the noaux_tc router with its correction bias; also as
a block-fp8 engine with weight_scale_inv), DeepSeek-V2-Lite (no q_lora, greedy softmax router, two
shared experts) and Mixtral, end to end through real refitd daemons; and the harness's exactness
criterion, which must fail an engine that holds the trainer's weights bit for bit yet computes
other tokens (the Mixtral case: routing weights rounded to bf16 where transformers 5 keeps fp32).

    bazel test //tests/models:test_families_cpu      or      python3 tests/models/test_families_cpu.py
"""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
for p in [HERE, os.path.join(REPO, "client", "python"), os.path.join(REPO, "client", "python", "tests")]:
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

import refmodel  # noqa: E402
from procs import greedy  # noqa: E402


def config(name):
    import json
    with open(os.path.join(HERE, "configs", f"{name}.json")) as f:
        return json.load(f)


def loaded_engine(spec, twin, dtype):
    """A RefModel holding the twin's weights, loaded checkpoint tensor by checkpoint tensor."""
    engine = refmodel.RefModel(spec, dtype=dtype)
    views = engine.checkpoint_views()
    ck = refmodel.to_checkpoint_names(dict(twin.named_parameters()), spec)
    if set(views) != set(ck):
        raise AssertionError(f"names differ: {sorted(set(views) ^ set(ck))[:6]}")
    for name, t in ck.items():
        engine.load_checkpoint_tensor(name, t.detach().to(dtype), views)
    return engine


class ReferenceModels(unittest.TestCase):
    """RefModel (vLLM's parameters) against the trainer's twin (transformers' modules)."""

    def test_families_hold_and_compute_the_twins_model(self):
        for name in ["tiny-deepseek-v3", "tiny-deepseek-v2-lite", "tiny-mixtral"]:
            for style in ["per_expert", "fused"]:
                with self.subTest(f"{name} {style}"):
                    spec = refmodel.ModelSpec(config(name), experts_style=style)
                    twin = refmodel.Twin(spec, dtype=torch.float32, seed=3)
                    engine = loaded_engine(spec, twin, torch.float32)
                    ids = torch.randint(0, spec.vocab, (2, 9), generator=torch.Generator().manual_seed(5))
                    with torch.no_grad():
                        want = twin(ids)
                    self.assertTrue(refmodel.bits_equal(engine(ids, mode="hf"), want))
                    self.assertTrue(torch.equal(greedy(lambda x: engine(x, mode="vllm"), ids, 6),
                                                greedy(twin, ids, 6)))

    def test_transformers_view_computes_on_the_engines_memory(self):
        # procs.bind_to_engine with the twin standing in for transformers' model (the same module
        # names): after binding, it computes with whatever the engine's parameters hold.
        import procs
        for name, style in [("tiny-deepseek-v3", "fused"), ("tiny-mixtral", "per_expert"),
                            ("tiny-qwen2", "per_expert")]:
            with self.subTest(f"{name} {style}"):
                spec = refmodel.ModelSpec(config(name), experts_style=style)
                engine = refmodel.RefModel(spec, dtype=torch.float32)
                view = procs.bind_to_engine(refmodel.Twin(spec, dtype=torch.float32, seed=1), engine, spec)
                for p in view.parameters():  # no parameter of its own left: all engine memory
                    self.assertTrue(any(p.data_ptr() == q.data_ptr() or
                                        q.data_ptr() <= p.data_ptr() < q.data_ptr() + q.numel() * q.element_size()
                                        for q in engine.parameters()))
                source = refmodel.Twin(spec, dtype=torch.float32, seed=9)  # "refit" new weights in
                views = engine.checkpoint_views()
                for n, t in refmodel.to_checkpoint_names(dict(source.named_parameters()), spec).items():
                    engine.load_checkpoint_tensor(n, t.detach(), views)
                ids = torch.randint(0, spec.vocab, (2, 7), generator=torch.Generator().manual_seed(4))
                with torch.no_grad():
                    self.assertTrue(refmodel.bits_equal(view(ids), source(ids)))

    def test_deepseek_structure(self):
        spec = refmodel.ModelSpec(config("tiny-deepseek-v3"))
        views = refmodel.RefModel(spec).checkpoint_views()
        # Layer 0 dense (first_k_dense_replace 1), layer 1 MoE with a shared expert; MLA with q_lora.
        self.assertIn("model.layers.0.mlp.gate_proj.weight", views)
        self.assertIn("model.layers.1.mlp.experts.7.down_proj.weight", views)
        self.assertIn("model.layers.1.mlp.shared_experts.up_proj.weight", views)
        self.assertEqual(tuple(views["model.layers.1.self_attn.q_a_proj.weight"].shape), (32, 48))
        self.assertEqual(tuple(views["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape), (20, 48))
        self.assertEqual(tuple(views["model.layers.1.self_attn.kv_b_proj.weight"].shape), (4 * 16, 16))
        lite = refmodel.RefModel(refmodel.ModelSpec(config("tiny-deepseek-v2-lite"))).checkpoint_views()
        self.assertIn("model.layers.1.self_attn.q_proj.weight", lite)
        self.assertNotIn("model.layers.1.self_attn.q_a_proj.weight", lite)

    def test_unmodeled_families_are_refused(self):
        with self.assertRaisesRegex(ValueError, "gemma3"):
            refmodel.ModelSpec({"model_type": "gemma3", "hidden_size": 8, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "vocab_size": 10})
        with self.assertRaisesRegex(ValueError, "rope_scaling"):
            refmodel.ModelSpec(dict(config("tiny-deepseek-v3"), rope_scaling={"type": "yarn", "factor": 40}))


class ExactnessCriterion(unittest.TestCase):
    """driver.compare's ``exact``: bit-equal weights must give the trainer's logits and tokens."""

    def models(self, trainer_fp32_routing, engine_fp32_routing):
        """A bf16 Mixtral trainer and two engines holding its weights bit for bit; the two sides
        may round the routing weights differently."""
        cfg = config("tiny-mixtral")
        tspec = refmodel.ModelSpec(cfg, experts_style="fused", router_weights_fp32=trainer_fp32_routing)
        espec = refmodel.ModelSpec(cfg, experts_style="fused", router_weights_fp32=engine_fp32_routing)
        twin = refmodel.Twin(tspec, dtype=torch.float32, seed=11, std=0.2).to(torch.bfloat16)
        return tspec, twin, loaded_engine(espec, twin, torch.bfloat16), loaded_engine(espec, twin, torch.bfloat16)

    def results(self, models, prompt_seed):
        """(trainer result, engine result) on four prompts drawn with `prompt_seed`."""
        tspec, twin, engine, reference = models
        ids = torch.randint(0, tspec.vocab, (4, 12), generator=torch.Generator().manual_seed(prompt_seed))
        with torch.no_grad():
            tr = {"logits": twin(ids).float(), "tokens": greedy(twin, ids, 24),
                  "logits_ref": twin.double()(ids).double(),
                  "weights": refmodel.to_checkpoint_names(dict(twin.to(torch.bfloat16).named_parameters()), tspec)}
        en = {"weights": {k: v.detach().clone() for k, v in engine.checkpoint_views().items()}}
        for mode in ["vllm", "hf"]:
            for prefix, model in [("", engine), ("reference_", reference)]:
                en[f"{prefix}logits_{mode}"] = model(ids, mode=mode).float()
                en[f"{prefix}tokens_{mode}"] = greedy(lambda x, m=model, mode=mode: m(x, mode=mode), ids, 24)
        return tr, en

    def test_matching_arithmetic_is_exact(self):
        import driver
        tr, en = self.results(self.models(True, True), 2)
        c = driver.compare(tr, en, 1, "mixtral")
        self.assertTrue(c["weights_bits_equal"])
        self.assertTrue(c["exact"], c)

    def test_bit_equal_weights_with_other_tokens_fail(self):
        # The harness's engine before the fix: routing weights rounded to bf16 before scaling the
        # experts' outputs, where transformers 5's Mixtral keeps them fp32. Whether given prompts
        # make the tokens diverge depends on the CPU's arithmetic (its kernels, its threads), so
        # prompts are drawn until they do; every draw must fail the criterion all the same.
        import driver
        models = self.models(True, False)
        seen = []
        for seed in range(2, 12):
            tr, en = self.results(models, seed)
            c = driver.compare(tr, en, 1, "mixtral")
            self.assertTrue(c["weights_bits_equal"])
            self.assertFalse(c["logits_hf_bits_equal"])
            self.assertFalse(c["exact"], c)
            seen.append((seed, c["tokens_hf_matching"], round(c["d_hf"], 4), round(c["tol"], 4)))
            # Other tokens within the old tolerance of 2 T: the criterion that let it pass.
            if not c["tokens_hf_identical"] and c["d_hf"] <= c["tol"]:
                return
        self.fail(f"no prompts made this model's tokens diverge within 2 T (seed, tokens matching of 96, "
                  f"d, 2 T): {seen}")


class FamiliesEndToEnd(unittest.TestCase):
    """Trainer (Twin, AdamW steps) and engine (RefModel) processes with real refitd daemons."""

    def run_case(self, name, **kw):
        import driver
        r = driver.run_case(name + ("-fp8" if kw.get("fp8_block") else ""), os.path.join(HERE, "configs", f"{name}.json"),
                            bench_rounds=2, baseline_repeat=1, prompts_shape=(3, 10), train=(2, 24), **kw)
        self.assertIsNone(r.get("error"), f"{r.get('error')}\n{r.get('traceback')}\n{r.get('logs')}")
        checks = [x["checks"] for x in r["rounds"]] + [r["decode_during_round"]["after"],
                                                       r["after_refusal"]["checks"]]
        for c in checks:
            self.assertTrue(c["exact"], c)
            self.assertTrue(c["tokens_hf_identical"] and c["tokens_vllm_identical"], c)
        self.assertTrue(r["decode_during_round"]["ok"])
        self.assertTrue(r["refused_round"]["ok"])
        self.assertTrue(r["ok"], r.get("summary"))
        return r

    def test_deepseek_v3(self):
        r = self.run_case("tiny-deepseek-v3")
        self.assertEqual(r["rounds"][0]["checks"]["weights_tensors"], 52)

    def test_deepseek_v3_fp8_engine(self):
        r = self.run_case("tiny-deepseek-v3", fp8_block=(8, 8))
        # Quantized: layer 0's q_a, kv_a, q_b, kv_b, o and its dense MLP (8); layer 1's attention
        # (5), 8 experts x 3 and the shared expert's 3. Each weight_scale_inv is checked in (a).
        self.assertEqual(r["rounds"][-1]["checks"]["fp8_quantized"], 8 + 5 + 8 * 3 + 3)

    def test_deepseek_v2_lite(self):
        self.run_case("tiny-deepseek-v2-lite")

    def test_mixtral(self):
        self.run_case("tiny-mixtral")


if __name__ == "__main__":
    unittest.main()
