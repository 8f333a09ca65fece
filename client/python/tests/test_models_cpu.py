"""Real models on the CPU (docs/MODELS.md): a trainer process (tests/models/refmodel.Twin,
transformers' module names and separate projections, AdamW steps between rounds, its parameters
in shared memory) and an engine process (refmodel.RefModel, vLLM's fused parameters, layout from
refit.layouts.vllm), each registered with its own refitd (host backend, two nodes). After every
round: (a) the engine's weights, read back from its fused parameters by the model's own
semantics, equal the trainer's bit for bit; (b) its logits on fixed prompts are within 2·T of the
trainer's (T: the trainer's fp32 logits against the same model in fp64), and 32 greedy tokens are
identical; (c) a decode in flight finishes on the old version and a refused round leaves the
engine serving the previous version exactly. Dense (Qwen2 structure: GQA, q/k/v bias, tied
embeddings, padded vocabulary) and MoE (Qwen3-MoE structure: q/k norms, stacked experts,
transformers 5's fused expert parameters on the trainer)."""
import os
import sys
import unittest

import harness


def _models_dir():
    """tests/models: in the runfiles when //tests/models is a data dependency, else the source
    tree this file is linked from."""
    candidates = []
    if os.environ.get("TEST_SRCDIR"):
        candidates.append(os.path.join(os.environ["TEST_SRCDIR"], "refit", "tests", "models"))
    candidates.append(os.path.join(harness.REPO, "tests", "models"))
    real = os.path.realpath(os.path.abspath(__file__))
    candidates.append(os.path.join(os.path.dirname(real), "..", "..", "..", "tests", "models"))
    for c in candidates:
        if os.path.exists(os.path.join(c, "driver.py")):
            return os.path.abspath(c)
    raise FileNotFoundError(f"tests/models not found (tried {candidates})")


MODELS = _models_dir()
sys.path.insert(0, MODELS)

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


@unittest.skipUnless(HAVE_TORCH, "needs torch")
class ModelsCPU(unittest.TestCase):
    def run_case(self, name, **kw):
        import driver
        r = driver.run_case(name, os.path.join(MODELS, "configs", f"{name}.json"), bench_rounds=2,
                            baseline_repeat=1, prompts_shape=(3, 10), train=(2, 24), **kw)
        self.assertIsNone(r.get("error"), f"{r.get('error')}\n{r.get('traceback')}\n{r.get('logs')}")
        checks = [x["checks"] for x in r["rounds"]] + [r["decode_during_round"]["after"],
                                                       r["after_refusal"]["checks"]]
        self.assertEqual(len(checks), 5)
        for c in checks:
            v = c["version"]
            self.assertTrue(c["weights_bits_equal"], f"round {v}: {c.get('weights_problems')}")
            self.assertGreater(c["weights_tensors"], 10)
            self.assertGreater(c["T"], 0.0, f"round {v}: no rounding error measured")
            for mode in ["vllm", "hf"]:
                self.assertLessEqual(c[f"d_{mode}"], c["tol"], f"round {v} {mode}: {c}")
                self.assertTrue(c[f"tokens_{mode}_identical"], f"round {v} {mode}: {c}")
                self.assertEqual(c[f"tokens_{mode}_matching"], 3 * 32)
            # transformers' GEMM split on views of the fused parameters: the same arithmetic.
            self.assertTrue(c["logits_hf_bits_equal"], f"round {v}: {c}")
        # Every round carried new weights: the trainer's loss moved and the engine followed.
        for a, b in zip(r["rounds"], r["rounds"][1:]):
            self.assertNotEqual(a["loss"], b["loss"])
        self.assertTrue(all(x["committed"] for x in r["rounds"]))
        d = r["decode_during_round"]
        self.assertTrue(d["ok"], d)
        f = r["refused_round"]
        self.assertTrue(f["ok"], f)
        self.assertEqual(f["phase"], "PREPARE")
        self.assertIn("engine refuses", f["reason"])
        # worker.version drops to 0 at PREPARE and stays 0 after the abort (refit's rule), while
        # the engine's weights still hold the previous version, untouched.
        self.assertEqual(f["engine_worker_version"], 0)
        self.assertTrue(r["baseline"]["ok"])
        self.assertTrue(r["ok"], r.get("summary"))
        return r

    def test_dense_qwen2_structure(self):
        self.run_case("tiny-qwen2")

    def test_moe_qwen3_structure_fused_experts(self):
        self.run_case("tiny-qwen3-moe", experts_style="fused")


if __name__ == "__main__":
    unittest.main()
