"""Real models with a block-fp8 engine, on the CPU (docs/MODELS.md, "fp8 engines"): the trainer
(tests/models/refmodel.Twin, fp32 or bf16, AdamW steps between rounds) and an engine whose linear
weights are block-fp8 codes with vLLM's weight_scale_inv parameters (tests/models/fp8ref.Fp8RefModel;
codes in torch.uint8 where torch has no float8 dtype, declared fp8_e4m3), two refitd daemons (host
backend) quantizing on the way. After every round:
(a) the engine's codes and scales, read back in checkpoint names from its fused parameters, equal
    an independent NumPy quantization of the trainer's current weights bit for bit (and every
    other tensor equals the trainer's);
(b) its logits on fixed prompts equal, bit for bit (and so within 2·T), those of the trainer's
    model class holding dequantize(quantize(trainer weights)), in both modes, and its 32 greedy
    tokens are identical to that model's;
(c) how far it is from the trainer's own model is reported and bounded loosely (relative RMS error
    of the logits at most sqrt(7 * layers) * 2^-4: 2^-4 is e4m3's largest relative rounding error
    of one element, 7 quantized GEMMs a layer, fp8ref.rel_bound; top-1 agreement on at least 80%
    of the prompt positions);
and the harness's round checks (a decode in flight finishes on the old version, a refused round
leaves the previous version's codes in place). The reference quantizer itself is checked first:
against a nearest-code search on every bf16 pattern and at every tie, and its special cases."""
import os
import sys
import types
import unittest

import harness

try:
    import numpy as np
    import torch
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


def _models_dir():
    candidates = []
    if os.environ.get("TEST_SRCDIR"):
        candidates.append(os.path.join(os.environ["TEST_SRCDIR"], "refit", "tests", "models"))
    candidates.append(os.path.join(harness.REPO, "tests", "models"))
    real = os.path.realpath(os.path.abspath(__file__))
    candidates.append(os.path.join(os.path.dirname(real), "..", "..", "..", "tests", "models"))
    for c in candidates:
        if os.path.exists(os.path.join(c, "fp8ref.py")):
            return os.path.abspath(c)
    raise FileNotFoundError(f"tests/models not found (tried {candidates})")


MODELS = _models_dir()
sys.path.insert(0, MODELS)
if os.path.join(harness.REPO, "client", "python") not in sys.path:  # run by hand from the source tree
    sys.path.append(os.path.join(harness.REPO, "client", "python"))

HAVE_FLOAT8 = HAVE_TORCH and hasattr(torch, "float8_e4m3fn")
# e4m3's largest relative rounding error of a normal element: half an ulp of a 3-bit mantissa.
E4M3_REL = 2.0 ** -4


def _finite_codes():
    import fp8ref
    return np.array([c for c in range(256) if not np.isnan(fp8ref.E4M3_VALUES[c])], dtype=np.int64)


def _nearest_codes(x):
    """The e4m3 code nearest to each fp32 value (clamped to +-448), by search over all finite
    codes: ties to the even code (mantissa bit 0), a zero result signed as x."""
    import fp8ref
    codes = _finite_codes()
    values = fp8ref.E4M3_VALUES[codes].astype(np.float64)
    xc = np.clip(x.astype(np.float64), -448.0, 448.0)
    d = np.abs(xc[:, None] - values[None, :])
    tie = d == d.min(axis=1, keepdims=True)
    score = tie * 4 + tie * ((codes & 1) == 0)[None, :] * 2 + \
        tie * (((codes & 0x80) != 0)[None, :] == np.signbit(x)[:, None])
    return codes[score.argmax(axis=1)].astype(np.uint8)


@unittest.skipUnless(HAVE_TORCH, "needs torch and numpy")
class ReferenceQuantizerTest(unittest.TestCase):
    """fp8ref's NumPy quantizer, against rules rather than against refit's C++."""

    def test_every_bf16_pattern_is_the_nearest_code(self):
        import fp8ref
        x = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
        got = fp8ref.float_to_e4m3(x)
        with np.errstate(invalid="ignore"):
            finite = np.isfinite(x)
            nan = np.isnan(x)
        np.testing.assert_array_equal(got[finite], _nearest_codes(x[finite]))
        self.assertTrue(np.all(got[nan] & 0x7F == 0x7F))                       # NaN stays NaN
        np.testing.assert_array_equal(got[nan] >> 7, np.signbit(x[nan]).astype(np.uint8))  # with its sign
        np.testing.assert_array_equal(got[np.isinf(x)], np.where(x[np.isinf(x)] > 0, 0x7E, 0xFE))

    def test_ties_and_their_neighbours(self):
        import fp8ref
        codes = _finite_codes()
        pos = np.sort(fp8ref.E4M3_VALUES[codes[codes < 0x80]].astype(np.float32))
        mids = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)  # exact in fp32
        xs = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9)),
                             np.float32([464, 463.99997, 464.00003, 480, 1e38])])
        xs = np.concatenate([xs, -xs])
        np.testing.assert_array_equal(fp8ref.float_to_e4m3(xs), _nearest_codes(xs))
        rng = np.random.default_rng(0)
        r = (rng.standard_normal(20000) * np.exp2(rng.integers(-14, 10, 20000))).astype(np.float32)
        np.testing.assert_array_equal(fp8ref.float_to_e4m3(r), _nearest_codes(r))

    def test_special_values(self):
        import fp8ref
        f = lambda *v: fp8ref.float_to_e4m3(np.array(v, np.float32)).tolist()  # noqa: E731
        self.assertEqual(f(0.0, -0.0, -2.0 ** -11, 2.0 ** -10, np.nextafter(np.float32(2.0 ** -10), np.float32(1))),
                         [0, 0x80, 0x80, 0, 1])
        self.assertEqual(f(2.0 ** -9, 7 * 2.0 ** -9, 7.5 * 2.0 ** -9, 2.0 ** -6), [1, 7, 8, 8])
        self.assertEqual(f(448.0, 464.0, -1e30, float("inf"), float("-inf")), [0x7E, 0x7E, 0xFE, 0x7E, 0xFE])
        self.assertEqual(f(1.0, 1.0625, 1.1875, 240.0, 256.0), [0x38, 0x38, 0x3A, 0x77, 0x78])
        self.assertEqual(f(1.4e-45, -1.4e-45), [0, 0x80])                     # fp32 subnormals

    def test_decode_table(self):
        import fp8ref
        v = fp8ref.E4M3_VALUES
        self.assertEqual(v[0x7E], 448.0)
        self.assertEqual(v[0x08], 2.0 ** -6)
        self.assertEqual(v[0x01], 2.0 ** -9)
        self.assertEqual(v[0xB8], -1.0)
        self.assertTrue(np.isnan(v[0x7F]) and np.isnan(v[0xFF]))
        self.assertEqual(int(np.isnan(v).sum()), 2)
        # The engine's table (torch, from the format's fields) is the same, bit for bit.
        t = fp8ref.torch_decode_table().numpy()
        ok = ~np.isnan(v)
        np.testing.assert_array_equal(t[ok].view(np.uint32), v[ok].view(np.uint32))
        self.assertTrue(np.all(np.isnan(t[~ok])))
        # Every finite code decodes and re-encodes to itself.
        np.testing.assert_array_equal(fp8ref.float_to_e4m3(v[ok]), np.arange(256)[ok])

    @unittest.skipUnless(HAVE_FLOAT8, "this torch has no float8_e4m3fn")
    def test_against_torch_float8(self):
        import fp8ref
        x = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
        with np.errstate(invalid="ignore"):
            x = x[np.isfinite(x)]
        t = torch.from_numpy(x).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        np.testing.assert_array_equal(fp8ref.float_to_e4m3(x), t)
        codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
        dec = codes.view(torch.float8_e4m3fn).float().numpy()
        ok = ~np.isnan(fp8ref.E4M3_VALUES)
        np.testing.assert_array_equal(dec[ok], fp8ref.E4M3_VALUES[ok])

    def test_block_scales(self):
        import fp8ref
        blk = (2, 3)
        x = np.zeros((5, 7), np.float32)                 # grid [3, 3]: a partial last row and column
        x[0, 0], x[1, 2] = 3.0, -448.0 * 5               # block (0, 0): amax 2240
        x[2, 3:6] = [np.nan, np.inf, 1e-42]              # block (1, 1): amax 1e-42 (inf, NaN skipped)
        x[4, 6] = 0.5                                    # block (2, 2): a 1x1 partial block
        codes, s = fp8ref.quantize_block_fp8(x, blk)
        self.assertEqual(s.shape, (3, 3))
        self.assertEqual(s.dtype, np.float32)
        self.assertEqual(s[0, 0], np.float32(2240.0) / np.float32(448.0))
        self.assertEqual(s[1, 1], np.finfo(np.float32).tiny)          # raised to FLT_MIN
        self.assertEqual(s[2, 2], np.float32(0.5) / np.float32(448.0))
        self.assertEqual(s[0, 1], 1.0)                                 # all zeros: scale 1
        self.assertEqual(codes[1, 2], 0xFE)                            # -amax: -448
        self.assertEqual(codes[2, 3] & 0x7F, 0x7F)                     # NaN kept
        self.assertEqual(codes[2, 4], 0x7E)                            # inf saturates
        self.assertEqual(codes[4, 6], 0x7E)
        self.assertEqual(codes[0, 0], fp8ref.float_to_e4m3(np.float32(3.0) / s[0, 0]))
        # Dequantized: within half an ulp (2^-4 relative) for normal elements, whatever the block.
        rng = np.random.default_rng(1)
        w = (rng.standard_normal((70, 50)) * np.exp2(rng.integers(-20, 8, (70, 1)))).astype(np.float32)
        c, sc = fp8ref.quantize_block_fp8(w, (32, 16))
        self.assertEqual(sc.shape, (3, 4))
        d = fp8ref.dequantize_block_fp8(c, sc, (32, 16))
        scale = fp8ref.expand(sc, w.shape, (32, 16))
        normal = np.abs(w) >= scale * 2.0 ** -6
        err = np.abs(d.astype(np.float64) - w)
        self.assertTrue(np.all(err[normal] <= E4M3_REL * np.abs(w[normal]) * (1 + 1e-6)))
        self.assertTrue(np.all(err[~normal] <= scale[~normal] * 2.0 ** -10 * (1 + 1e-6)))

    def test_engine_dequantize_equals_reference(self):
        """Fp8RefModel's torch dequantization (decode table, scales expanded over blocks, 2-D and
        stacked 3-D, partial blocks) equals the NumPy reference's bit for bit."""
        import fp8ref
        import refmodel
        spec = refmodel.ModelSpec({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
                                   "num_hidden_layers": 1, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "vocab_size": 70})
        m = fp8ref.Fp8RefModel(spec, dtype=torch.float32, block=(32, 48), storage="uint8")
        rng = np.random.default_rng(2)
        for shape in [(96, 64), (3, 40, 70)]:
            codes = rng.integers(0, 256, shape).astype(np.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0
            grid = shape[:-2] + (-(-shape[-2] // 32), -(-shape[-1] // 48))
            scales = (rng.random(grid) * 0.01).astype(np.float32)
            got = m.dequantize(torch.from_numpy(codes), torch.from_numpy(scales)).numpy()
            want = np.stack([fp8ref.dequantize_block_fp8(c, s, (32, 48))
                             for c, s in zip(codes.reshape((-1,) + shape[-2:]), scales.reshape((-1,) + grid[-2:]))])
            np.testing.assert_array_equal(got.reshape(want.shape).view(np.uint32), want.view(np.uint32))
            if HAVE_FLOAT8:
                f8 = torch.from_numpy(codes).view(torch.float8_e4m3fn)
                np.testing.assert_array_equal(m.dequantize(f8, torch.from_numpy(scales)).numpy(), got)
        # The layout sees codes as fp8_e4m3, the scales as fp32.
        described = m.layout_params()
        self.assertEqual(described["model.layers.0.self_attn.qkv_proj.weight"], ((128, 64), "fp8_e4m3"))
        self.assertEqual(tuple(described["model.layers.0.mlp.gate_up_proj.weight_scale_inv"].shape), (6, 2))


@unittest.skipUnless(HAVE_TORCH, "needs torch")
class Uint8StorageTest(unittest.TestCase):
    """refit.dtypes: a torch.uint8 tensor is fp8's storage (as a NumPy uint8 array is), no other."""

    def test_matches(self):
        from refit import dtypes
        u8 = torch.zeros(4, dtype=torch.uint8)
        self.assertTrue(dtypes.matches(u8, "fp8_e4m3"))
        self.assertTrue(dtypes.matches(u8, "fp8_e5m2"))
        for other in ["int8", "bf16", "fp16", "fp32", "int32"]:
            self.assertFalse(dtypes.matches(u8, other), other)
        self.assertFalse(dtypes.matches(torch.zeros(4, dtype=torch.int8), "fp8_e4m3"))
        self.assertFalse(dtypes.matches(torch.zeros(4, dtype=torch.float32), "fp8_e4m3"))
        self.assertTrue(dtypes.matches(np.zeros(4, np.uint8), "fp8_e4m3"))   # as before
        if HAVE_FLOAT8:
            self.assertTrue(dtypes.matches(torch.zeros(4, dtype=torch.float8_e4m3fn), "fp8_e4m3"))
            self.assertFalse(dtypes.matches(torch.zeros(4, dtype=torch.float8_e4m3fn), "fp8_e5m2"))

    def test_registration_check(self):
        from refit.errors import RegistrationError
        from refit.worker import check_tensors
        buf = lambda n, dt: types.SimpleNamespace(name=n, shape=[2, 3], dtype=dt)  # noqa: E731
        w = types.SimpleNamespace(name="w", buffers=[buf("codes", "fp8_e4m3"), buf("scales", "fp32")])
        pairs = check_tensors(w, None, {"codes": torch.zeros(2, 3, dtype=torch.uint8),
                                        "scales": torch.zeros(2, 3)})
        self.assertEqual([n for n, _ in pairs], ["codes", "scales"])
        w = types.SimpleNamespace(name="w", buffers=[buf("x", "bf16")])
        with self.assertRaisesRegex(RegistrationError, "'x' is torch.uint8, but the layout's buffer is bf16"):
            check_tensors(w, None, {"x": torch.zeros(2, 3, dtype=torch.uint8)})


@unittest.skipUnless(HAVE_TORCH, "needs torch")
class ModelsFp8CPU(unittest.TestCase):
    def run_case(self, name, block, quantized, dtype="float32", storage=None, **kw):
        import driver
        r = driver.run_case(f"{name}-fp8", os.path.join(MODELS, "configs", f"{name}.json"), bench_rounds=2,
                            baseline_repeat=0, prompts_shape=(3, 10), train=(2, 24), dtype=dtype,
                            fp8_block=block, fp8_storage=storage, **kw)
        self.assertIsNone(r.get("error"), f"{r.get('error')}\n{r.get('traceback')}\n{r.get('logs')}")
        checks = [x["checks"] for x in r["rounds"]] + [r["decode_during_round"]["after"],
                                                       r["after_refusal"]["checks"]]
        self.assertEqual(len(checks), 5)
        for c in checks:
            v = c["version"]
            # (a) codes and scales (and every other tensor) bit for bit.
            self.assertTrue(c["weights_bits_equal"], f"round {v}: {c.get('weights_problems')}")
            self.assertEqual(c["fp8_quantized"], quantized)
            # (b) the trainer's model class holding dequantize(quantize(trainer weights)).
            self.assertGreater(c["T"], 0.0, f"round {v}: no rounding error measured")
            for mode in ["vllm", "hf"]:
                self.assertLessEqual(c[f"d_{mode}"], c["tol"], f"round {v} {mode}: {c}")
                self.assertTrue(c[f"logits_{mode}_bits_equal"], f"round {v} {mode}: {c}")
                self.assertTrue(c[f"tokens_{mode}_identical"], f"round {v} {mode}: {c}")
                self.assertEqual(c[f"tokens_{mode}_matching"], 3 * 32)
                # (c) the trainer itself: loosely (docs/MODELS.md, "fp8 engines").
                self.assertGreater(c[f"fp8_{mode}_max_abs"], 0.0, f"round {v}: the engine is not quantized")
                self.assertLessEqual(c[f"fp8_{mode}_rel_rms"], c["fp8_rel_bound"], f"round {v} {mode}: {c}")
                self.assertGreaterEqual(c[f"fp8_{mode}_top1_agree"], 0.8, f"round {v} {mode}: {c}")
        # Every round brought new codes and scales for every quantized weight: a stale engine fails (a).
        for rec in r["rounds"][1:]:
            self.assertEqual(rec["checks"]["fp8_quantized_changed"], quantized)
        for a, b in zip(r["rounds"], r["rounds"][1:]):
            self.assertNotEqual(a["loss"], b["loss"])
        self.assertTrue(all(x["committed"] for x in r["rounds"]))
        d = r["decode_during_round"]
        self.assertTrue(d["ok"], d)
        f = r["refused_round"]
        self.assertTrue(f["ok"], f)          # the previous version's codes, not the new ones
        self.assertEqual(f["phase"], "PREPARE")
        self.assertTrue(r["ok"], r.get("summary"))
        worst = {k: max(c[k] for c in checks) for k in ["fp8_vllm_max_abs", "fp8_vllm_rel_rms", "trainer_T"]}
        worst["rel_bound"] = checks[0]["fp8_rel_bound"]
        worst["top1_min"] = min(c["fp8_vllm_top1_agree"] for c in checks)
        worst["tokens_matching_trainer_min"] = min(c["fp8_vllm_tokens_matching_trainer"] for c in checks)
        print(f"\n[{name} fp8 {block} {dtype} {r['fp8']['storage']}] vs the trainer: {worst}; "
              f"refit median {r['summary']['refit_median_ms']:.2f} ms", file=sys.stderr)
        return r

    def test_dense_qwen2_structure_fp32_trainer(self):
        # Blocks 32x48: 48 does not divide the hidden size 64, so every row ends in a partial block.
        self.run_case("tiny-qwen2", (32, 48), quantized=14)

    def test_dense_qwen2_structure_bf16_trainer(self):
        self.run_case("tiny-qwen2", (32, 48), quantized=14, dtype="bfloat16")

    @unittest.skipUnless(HAVE_FLOAT8, "codes in uint8 are the default where torch has no float8")
    def test_dense_uint8_codes(self):
        self.run_case("tiny-qwen2", (32, 48), quantized=14, storage="uint8")

    def test_moe_qwen3_structure_fused_experts(self):
        # Blocks 32x32 over hidden 48 and moe_intermediate 32: partial blocks in rows (o_proj, w2)
        # and columns (qkv, w13); the experts' scales stacked [E, 2, 2] and [E, 2, 1].
        self.run_case("tiny-qwen3-moe", (32, 32), quantized=44, experts_style="fused")


if __name__ == "__main__":
    unittest.main()
