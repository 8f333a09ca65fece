"""A new user's path, end to end with real daemons: a plain torch module (a 2-layer MLP) moved
into shared memory with refit.share_module_, its layout from refit.layouts.dtensor.trainer_worker,
refit from a trainer to an engine holding the same module after real optimizer steps; versions
that are not newer are refused; a blocking trainer that never serves makes the round abort at the
prepare timeout, naming it, and serve() then reports that round; garbage on the handle socket is
answered and leaves the daemon serving."""
import os
import socket
import struct
import sys
import time
import unittest

import grpc

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402
from refit.layouts import dtensor  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


@unittest.skipIf(torch is None, "needs torch")
class TorchModuleRefit(unittest.TestCase):
    def setUp(self):
        self.cluster = harness.Cluster(nodes=2, daemon_flags=["--prepare-timeout", "1"])
        self.ctl = refit.Controller(self.cluster.control)
        self.workers = []

    def tearDown(self):
        for w in self.workers:
            w.close()
        self.ctl.close()
        self.cluster.close()

    def start(self, blocking=False):
        trainer, engine = mlp(0), mlp(1)
        refit.share_module_(trainer)
        refit.share_module_(engine)
        tp, ep = dict(trainer.named_parameters()), dict(engine.named_parameters())
        self.assertFalse(all(torch.equal(tp[k], ep[k]) for k in tp))
        wt = refit.Worker(self.cluster.daemons[0].worker_address, "mlp", "trainer",
                          dtensor.trainer_worker(tp, rank=0), tp, blocking=blocking)
        self.workers.append(wt)
        we = refit.Worker(self.cluster.daemons[1].worker_address, "mlp", "inference",
                          dtensor.trainer_worker(ep, rank=0, node=1, worker_name="engine-0"), ep)
        self.workers.append(we)
        self.ctl.wait_ready("mlp", timeout=20)
        return trainer, engine, wt, we

    def assert_same(self, trainer, engine):
        tp, ep = dict(trainer.named_parameters()), dict(engine.named_parameters())
        for k in tp:
            self.assertTrue(torch.equal(tp[k], ep[k]), k)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            self.assertTrue(torch.equal(trainer(x), engine(x)))

    def test_optimizer_steps_reach_the_engine_module(self):
        trainer, engine, _, we = self.start()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
        for v in (1, 2, 3):
            trainer(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            stats = self.ctl.refit("mlp", v, timeout=30)
            self.assertTrue(stats.committed, stats)
            self.assertTrue(we.wait_version(v, 10))
            self.assertEqual(we.version, v)
            self.assert_same(trainer, engine)

    def test_versions_not_newer_are_refused(self):
        trainer, engine, _, _ = self.start()
        self.assertTrue(self.ctl.refit("mlp", 5, timeout=30).committed)
        for v in (5, 3):
            with self.assertRaises(refit.RefitError) as e:
                self.ctl.refit("mlp", v, timeout=30)
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION, e.exception)
            self.assertIn("not newer", e.exception.reason)
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("mlp", 0, timeout=30)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT, e.exception)
        self.assertEqual(int(self.ctl.group("mlp")["version"]), 5)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1.0)
        self.assertTrue(self.ctl.refit("mlp", 6, timeout=30).committed)
        self.assert_same(trainer, engine)

    def test_unserved_blocking_trainer_aborts_at_the_prepare_timeout(self):
        trainer, engine, wt, _ = self.start(blocking=True)
        t = time.monotonic()
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("mlp", 1, timeout=30)  # nobody calls wt.serve()
        self.assertLess(time.monotonic() - t, 5)
        self.assertEqual(e.exception.phase, "PREPARE", e.exception)
        self.assertEqual(e.exception.culprit, 'worker "mlp/fsdp-rank0"', e.exception)
        r = wt.serve(timeout=0)  # the round that ended unserved is reported, not prepared
        self.assertIsNotNone(r)
        self.assertFalse(r.committed)
        self.assertEqual(r.version, 1)
        self.assertIsNone(wt.serve(timeout=0))
        # Served, the next round commits.
        round_id = self.ctl.start_refit("mlp", 2)
        r = wt.serve(timeout=10)
        self.assertIsNotNone(r)
        self.assertTrue(r.committed, r)
        self.assertEqual(r.round_id, round_id)
        self.assert_same(trainer, engine)

    def test_garbage_on_the_handle_socket_is_answered(self):
        trainer, engine, _, _ = self.start()
        path = self.cluster.daemons[0].socket + ".handles"
        token = b"a" * 32
        for packet in [b"hello", os.urandom(4096), b"RFH1" + b"0" * 10,
                       b"RFH1" + b"Z" * 32 + struct.pack("<II", 0, 1),
                       b"RFH1" + token + struct.pack("<II", 5, 1),
                       b"RFH1" + token + struct.pack("<II", 300, 1)]:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(5)
            s.connect(path)
            s.send(packet)
            reply = s.recv(4096)
            s.close()
            self.assertEqual(reply[:4], b"ER\0\0", (packet[:16], reply))
        self.assertIsNone(self.cluster.daemons[0].proc.poll())
        self.assertTrue(self.ctl.refit("mlp", 1, timeout=30).committed)
        self.assert_same(trainer, engine)


if __name__ == "__main__":
    unittest.main()
