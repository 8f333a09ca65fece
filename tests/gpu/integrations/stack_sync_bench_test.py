"""stack_sync_bench.py's logic on the CPU: the tiny model, refitd's host backend, every stack's
refit adapter and reproduced default path in a trainer and an engine process. What the GPU run
relies on: every sync of every stack leaves the engine byte-equal to the trainer with equal
greedy tokens, the JSON carries medians of the measured rounds only, and a damaged weight
loader is caught by the byte check (so a pass is not a foregone conclusion)."""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "stack_sync_bench.py")


def load_bench():
    spec = importlib.util.spec_from_file_location("stack_sync_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_bench(*flags, env_extra=None):
    out = os.path.join(tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR")), "result.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **(env_extra or {}))
    proc = subprocess.run([sys.executable, SCRIPT, "--out", out, "--model", "tiny", "--device", "cpu",
                           "--timeout", "30", "--verl-bucket-mb", "0.02", "--nemo-host-buffer-mb", "0.04", *flags],
                          env=env, capture_output=True, text=True, timeout=400)
    with open(out) as f:
        return proc.returncode, json.load(f), proc.stdout + proc.stderr


class StackSyncBenchOnCpu(unittest.TestCase):
    def test_every_stack_syncs_byte_exact_with_equal_tokens(self):
        rc, result, log = run_bench("--rounds", "2", "--warmup", "1")
        self.assertEqual(rc, 0, log[-3000:])
        self.assertTrue(result["passed"])
        self.assertEqual(sorted(result["stacks"]), ["nemo_rl", "sglang", "verl"])
        for stack, r in result["stacks"].items():
            self.assertNotIn("error", r, stack)
            self.assertEqual(len(r["rounds"]), 3, stack)
            self.assertEqual([row["warmup"] for row in r["rounds"]], [True, False, False])
            for row in r["rounds"]:
                for method in ("refit", "default"):
                    self.assertTrue(row[method]["bytes_equal"], (stack, method, row[method]["byte_mismatches"]))
                    self.assertTrue(row[method]["tokens_equal"], (stack, method))
            measured = [row["refit"]["seconds"] for row in r["rounds"][1:]]
            self.assertEqual(r["refit_s"]["median"], sum(measured) / 2, stack)  # the warm-up is left out
            self.assertGreater(r["default_s"]["median"], 0)
            self.assertGreater(r["ceiling_s"]["median"], 0)
        versions = [row["refit"]["detail"]["version"] for row in result["stacks"]["sglang"]["rounds"]]
        self.assertEqual(versions, [1, 2, 3])
        # Buffers far smaller than the model: several buckets and ping-pong groups per sync.
        self.assertGreater(result["stacks"]["verl"]["rounds"][0]["default"]["detail"]["buckets"], 1)
        self.assertGreater(result["stacks"]["nemo_rl"]["rounds"][0]["default"]["detail"]["groups"], 2)

    def test_a_loader_that_skips_a_tensor_fails_the_byte_check(self):
        rc, result, _ = run_bench("--rounds", "1", "--warmup", "0", "--stacks", "verl",
                                  env_extra={"STACK_SYNC_BENCH_SKIP_LOAD": "model.norm.weight"})
        self.assertNotEqual(rc, 0)
        self.assertFalse(result["passed"])
        row = result["stacks"]["verl"]["rounds"][0]
        self.assertEqual(row["default"]["byte_mismatches"], ["model.norm.weight"])
        self.assertTrue(row["refit"]["bytes_equal"])


class FusedLayout(unittest.TestCase):
    def test_slices_match_rl_loops_fused_buffers(self):
        import torch
        bench = load_bench()
        import rl_loop
        from tiny_models import HF_CONFIG, hf_shapes
        g = torch.Generator().manual_seed(0)
        hf = {n: torch.randn(s, generator=g) for n, s in hf_shapes().items()}
        buffers, views = rl_loop.fused_buffers(hf, HF_CONFIG["vocab_size"])
        shapes = {n: tuple(t.shape) for n, t in hf.items()}
        self.assertEqual(bench.fused_shapes(shapes, HF_CONFIG["vocab_size"]),
                         {n: tuple(b.shape) for n, b in buffers.items()})
        mine = bench.views_over(buffers, bench.fused_slices(shapes, HF_CONFIG["vocab_size"]))
        self.assertEqual(bench.byte_mismatches(hf, mine), [])
        buffers["model.layers.1.self_attn.qkv_proj.weight"][-1].add_(1)  # the last v row
        self.assertEqual(bench.byte_mismatches(hf, mine), ["model.layers.1.self_attn.v_proj.weight"])


if __name__ == "__main__":
    unittest.main()
