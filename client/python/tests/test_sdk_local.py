"""The SDK's contract without a daemon: one exception root, the role enum, the warning of a
worker that waits for its daemon, and how a group that is not ready is explained by rank."""
import logging
import os
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import refit  # noqa: E402
from refit import controller, dtypes, layout_io  # noqa: E402

LAYOUT = {
    "tensors": [{"name": "w", "shape": [8, 4], "dtype": "fp32"}],
    "workers": [{"name": f"rank{r}", "node": 0, "gpu": r, "buffers": [
        {"name": "w", "dtype": "fp32", "shape": [4, 4],
         "pieces": [{"tensor": "w", "tensorBox": {"origin": [4 * r, 0], "shape": [4, 4]}}]}]} for r in range(2)],
}


class OneRoot(unittest.TestCase):
    """Each deliberate failure is a refit.Error and keeps the builtin base callers catch today."""

    def assert_refit_error(self, fn, builtin, text):
        with self.assertRaises(refit.Error) as e:
            fn()
        self.assertIsInstance(e.exception, builtin)
        self.assertIn(text, str(e.exception))
        return e.exception

    def test_bad_input(self):
        arena = refit.SharedArena(4096)
        self.addCleanup(arena.close)
        cases = [
            (lambda: layout_io.one_worker(LAYOUT, "rank7"), ValueError, "no worker 'rank7' (it has rank0, rank1)"),
            (lambda: layout_io.one_worker(LAYOUT), ValueError, "say which one"),
            (lambda: layout_io.to_proto("/nonexistent/layout.json"), ValueError, "cannot read the layout file"),
            (lambda: layout_io.to_proto(42), ValueError, "not int"),
            (lambda: dtypes.canonical("complex64"), ValueError, "not one refit moves"),
            (lambda: refit.SharedArena(0), ValueError, "positive size"),
            (lambda: arena.empty((4096,), "fp32"), MemoryError, "make a larger SharedArena"),
            (lambda: refit.Role.of("Trainer"), ValueError, "'trainer'"),
            (lambda: refit.Controller("127.0.0.1:1").refit("g", 0), ValueError, "version must be"),
            (lambda: refit.Controller("127.0.0.1:1").rounds("g", limit=0), ValueError, "limit"),
        ]
        for fn, builtin, text in cases:
            with self.subTest(text=text):
                self.assert_refit_error(fn, builtin, text)

    def test_unknown_worker_name_is_an_invalid_argument(self):
        with self.assertRaises(refit.InvalidArgument):
            refit.Worker("unix:/nonexistent/refitd.sock", "g", "trainer", LAYOUT, {}, name="rank9")

    def test_version_refused_locally_is_a_refit_error_too(self):
        import grpc
        e = self.assert_refit_error(lambda: refit.Controller("127.0.0.1:1").refit("g", True), ValueError,
                                    "version must be")
        self.assertIsInstance(e, refit.RefitError)
        self.assertEqual(e.code, grpc.StatusCode.INVALID_ARGUMENT)

    def test_partial_tls_environment(self):
        os.environ["REFIT_TLS_CERT"] = "/x.pem"
        self.addCleanup(os.environ.pop, "REFIT_TLS_CERT", None)
        self.assert_refit_error(refit.TlsFiles.from_env, ValueError, "missing REFIT_TLS_KEY, REFIT_TLS_CA")

    def test_every_exported_exception_derives_from_the_root(self):
        for name in refit.__all__:
            obj = getattr(refit, name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                self.assertTrue(issubclass(obj, refit.Error), name)
        self.assertTrue(issubclass(refit.RefitTimeout, TimeoutError))
        self.assertTrue(issubclass(refit.RegistrationTimeout, refit.RegistrationError))
        from refit.cuda import CudaExportError
        self.assertTrue(issubclass(CudaExportError, refit.ExportError))


class Roles(unittest.TestCase):
    def test_spellings(self):
        self.assertIs(refit.Role.ENGINE, refit.Role.INFERENCE)
        for spelled, role in [("trainer", refit.Role.TRAINER), ("inference", refit.Role.INFERENCE),
                              ("engine", refit.Role.INFERENCE), (refit.Role.TRAINER, refit.Role.TRAINER)]:
            self.assertIs(refit.Role.of(spelled), role)
        self.assertEqual(refit.Role.INFERENCE, "inference")  # a str: old comparisons keep working

    def test_a_wrong_role_names_the_accepted_ones(self):
        for wrong in ["Trainer", "engines", "", None, 1]:
            with self.subTest(role=wrong):
                with self.assertRaises(refit.InvalidArgument) as e:
                    refit.Worker("unix:/nonexistent/refitd.sock", "g", wrong, LAYOUT, {}, name="rank0")
                for accepted in ("refit.Role.TRAINER", "'trainer'", "refit.Role.INFERENCE", "'inference'",
                                 "'engine'"):
                    self.assertIn(accepted, str(e.exception))


class NoDaemon(unittest.TestCase):
    def test_waiting_is_logged_within_two_seconds_and_the_deadline_kept(self):
        socket_dir = tempfile.mkdtemp(prefix="refit-", dir="/tmp")
        path = os.path.join(socket_dir, "refitd-0.sock")
        arena = refit.SharedArena(4096)
        self.addCleanup(arena.close)
        tensors = {"w": arena.empty((4, 4), "fp32")}
        start_wall, start = time.time(), time.monotonic()
        with self.assertLogs("refit.worker", logging.WARNING) as logs:
            with self.assertRaises(refit.RegistrationTimeout) as e:
                refit.Worker("unix:" + path, "g", "trainer", LAYOUT, tensors, name="rank0", register_timeout=3)
        elapsed = time.monotonic() - start
        self.assertGreaterEqual(elapsed, 2.5)
        self.assertLess(elapsed, 5.0)
        self.assertIsInstance(e.exception, TimeoutError)
        self.assertIn(path, str(e.exception))
        waiting = [r for r in logs.records if f"waiting for refitd at {path}" in r.getMessage()]
        self.assertEqual(len(waiting), 1, logs.output)
        self.assertLess(waiting[0].created - start_wall, 2.0)


class PlainTorchSharding(unittest.TestCase):
    """docs/PYTHON.md, "A plain-torch trainer, sharded by hand": every rank's slices match its
    worker of the one layout, and the ranks together hold every element once."""

    def test_as_documented(self):
        try:
            import torch
        except ImportError:
            self.skipTest("needs torch")
        from refit.layouts import RankPlacement, dtensor
        from refit.worker import check_tensors
        world = 3
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
        full = dict(model.named_parameters())
        specs = {n: (tuple(t.shape), t.dtype, ["S(0)"]) for n, t in full.items()}
        layout = dtensor.trainer_layout(specs, mesh=(world,), worker_name="rank{rank}",
                                        placement=RankPlacement(gpus_per_node=8, first_node=0))
        held = {n: 0 for n in full}
        for rank in range(world):
            mine = {}
            for n, t in full.items():
                chunks = torch.chunk(t.detach(), world)
                if rank < len(chunks):
                    mine[n] = chunks[rank]
            arena = refit.SharedArena(refit.arena_bytes(mine.values()))
            self.addCleanup(arena.close)
            shards = {n: arena.empty(t.shape, t.dtype).copy_(t) for n, t in mine.items()}
            worker, specs_ = layout_io.one_worker(layout, f"rank{rank}")
            pairs = check_tensors(worker, specs_, shards)
            for name, t in pairs:
                held[name] += t.numel()
        self.assertEqual(held, {n: t.numel() for n, t in full.items()})


class NotReadyByRank(unittest.TestCase):
    """The daemon's status and workers in, the missing rank named out (the live cases are in
    test_sdk_rounds.py)."""

    NO_SOURCE = ('group "g" is not ready: destination tensor "w" box [4:8, 0:4] (worker "engine" buffer "w" '
                 'box [4:8, 0:4]): 16 of 16 elements of region [4:8, 0:4] have no source in the source layout')

    def test_missing_trainer(self):
        cases = [(["fsdp-rank0"], "fsdp-rank1"), (["rank0", "rank2", "rank3"], "rank1"),
                 (["tp1", "tp0"], "tp2"), (["a", "b"], None), (["x1", "y2"], None), ([], None)]
        for names, want in cases:
            with self.subTest(names=names):
                self.assertEqual(controller.missing_trainer(names), want)

    def test_a_missing_trainer_is_named_not_the_engine(self):
        text, culprit = controller.explain_not_ready("g", self.NO_SOURCE, {"replicas": []}, ["rank0"])
        self.assertTrue(text.startswith('trainer rank 1 ("g/rank1") is not registered'), text)
        self.assertIn(self.NO_SOURCE, text)
        self.assertEqual(culprit, 'worker "g/rank1"')

    def test_a_missing_engine_rank_is_named(self):
        status = {"replicas": [{"name": "dp0", "size": 2, "missing_ranks": [1]}]}
        text, culprit = controller.explain_not_ready("g", "replica ...", status, None)
        self.assertTrue(text.startswith('inference replica "dp0" rank 1 is not registered'), text)
        self.assertIsNone(culprit)

    def test_nothing_to_add(self):
        self.assertEqual(controller.explain_not_ready("g", "x", {"replicas": []}, ["rank0"]), ("x", None))


if __name__ == "__main__":
    unittest.main()
