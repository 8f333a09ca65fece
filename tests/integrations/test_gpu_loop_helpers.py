"""The CPU-only parts of tests/gpu/integrations/rl_loop.py (the GPU loop through the vLLM
adapter): vLLM's fused layout over a state dict, the byte comparison, the default path's copies."""
import importlib.util
import os
import unittest

import harness


def load_rl_loop():
    path = harness.repo_file("tests/gpu/integrations/rl_loop.py")
    spec = importlib.util.spec_from_file_location("rl_loop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class GpuLoopHelpers(unittest.TestCase):
    def test_selftest_passes(self):
        self.assertEqual(load_rl_loop().selftest(), {"selftest": "passed"})

    def test_fused_views_alias_the_buffers(self):
        import torch
        rl = load_rl_loop()
        hf = {f"l.self_attn.{p}.weight": torch.full((2, 3), float(i)) for i, p in enumerate(("q_proj", "k_proj", "v_proj"))}
        buffers, views = rl.fused_buffers(hf, vocab=1)
        buffers["l.self_attn.qkv_proj.weight"].fill_(7)
        self.assertTrue(all(bool((v == 7).all()) for v in views.values()))
        self.assertEqual(sorted(rl.byte_mismatches(hf, views)), sorted(hf))


if __name__ == "__main__":
    unittest.main()
