"""End to end on the host backend: real refitd daemons on loopback, Python trainer and engine
processes holding their tensors in shared memory, every destination byte checked by the engine
after every round; Python and C++ workers mixed; a refusal; a daemon restarted under live
Python workers."""
import os
import signal
import sys
import time
import unittest

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402
from refit._proto import refit_pb2  # noqa: E402

from e2e_lib import Reports, layouts, names, start_python, start_sim  # noqa: E402


LAYOUT_ONE = {
    "tensors": [{"name": "w", "shape": [8, 4], "dtype": "fp32"}],
    "workers": [{"name": "rank0", "node": 0, "gpu": 0, "buffers": [
        {"name": "w", "dtype": "fp32", "shape": [8, 4],
         "pieces": [{"tensor": "w", "tensorBox": {"origin": [0, 0], "shape": [8, 4]}}]}]}],
}


def log_since(path, offset):
    """What the log at `path` holds from byte `offset` on."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


class EndToEnd(unittest.TestCase):
    def setUp(self):
        self.cluster = harness.Cluster(nodes=2)
        self.reports = Reports(self.cluster)
        self.files = layouts(self.cluster)
        self.ctl = refit.Controller(self.cluster.control)

    def tearDown(self):
        self.ctl.close()
        self.cluster.close()

    def start_side(self, role, kind, node, **kw):
        layout = self.files["trainer" if role == "trainer" else "inference"]
        keys = []
        for w in names(layout):
            key = f"{role}-{w}"
            if kind == "python":
                start_python(self.cluster, key, node, role, layout, w, *kw.get("extra", []))
            else:
                start_sim(self.cluster, key, node, role, layout, w)
            keys.append(key)
        for key in keys:
            self.reports.wait(key, "registered")
        return keys

    def refit_rounds(self, engines, versions):
        self.ctl.wait_ready("policy", timeout=20)
        for v in versions:
            stats = self.ctl.refit("policy", v, timeout=60)
            self.assertTrue(stats.committed, stats)
            self.assertGreater(stats.bytes, 0)
            for key in engines:
                self.reports.wait(key, f"commit {v} ")
                last = [l for l in self.reports.lines(key) if l.startswith(f"commit {v} ")][-1]
                self.assertIn(" ok ", last, f"{key}: {last}")

    def test_python_trainer_to_python_engine(self):
        self.start_side("trainer", "python", 0)
        engines = self.start_side("inference", "python", 1)
        self.refit_rounds(engines, [1, 2, 3])
        # Status and workers through the controller.
        g = self.ctl.group("policy")
        self.assertEqual(int(g["version"]), 3)
        self.assertEqual(len(self.ctl.workers("policy")), 4)
        self.assertGreater(int(self.ctl.plan("policy")["bytes_total"]), 0)

    def test_blocking_workers_serve_rounds(self):
        self.start_side("trainer", "python", 0, extra=["--blocking"])
        engines = self.start_side("inference", "python", 1, extra=["--blocking", "--numpy"])
        self.refit_rounds(engines, [4, 9])
        for key in engines:
            self.reports.wait(key, "served")

    def test_python_trainer_to_cpp_engine(self):
        self.start_side("trainer", "python", 0)
        engines = self.start_side("inference", "cpp", 1)
        self.refit_rounds(engines, [1, 2])

    def test_cpp_trainer_to_python_engine(self):
        self.start_side("trainer", "cpp", 0)
        engines = self.start_side("inference", "python", 1, extra=["--numpy"])
        self.refit_rounds(engines, [1, 2])

    def test_refusal_aborts_at_once_with_its_reason(self):
        self.start_side("trainer", "python", 0)
        layout = self.files["inference"]
        ws = names(layout)
        start_python(self.cluster, "bad", 1, "inference", layout, ws[0], "--refuse", "kv cache still in use")
        start_python(self.cluster, "good", 1, "inference", layout, ws[1])
        self.reports.wait("bad", "registered")
        self.reports.wait("good", "registered")
        self.ctl.wait_ready("policy", timeout=20)
        t = time.monotonic()
        with self.assertRaises(refit.RefitError) as caught:
            self.ctl.refit("policy", 1, timeout=30)
        elapsed = time.monotonic() - t
        self.assertLess(elapsed, 1.0, f"the refused round took {elapsed:.2f} s to abort")
        e = caught.exception
        self.assertIn("kv cache still in use", e.reason)
        self.assertEqual(e.phase, "PREPARE")
        self.assertIn(ws[0], e.culprit or "")
        # Structured, from the daemons (refit.v1.Culprit in the status details).
        self.assertIsNotNone(e.blamed, e)
        self.assertEqual(e.blamed.kind, refit_pb2.Culprit.WORKER)
        self.assertEqual(e.blamed.worker_id, f"policy/{ws[0]}")
        self.assertEqual(e.blamed.node, 1)
        self.assertEqual(e.blamed.phase, "PREPARE")
        self.reports.wait("good", "abort")

    def test_a_worker_name_belongs_to_its_registration(self):
        """The Python worker keeps its session key: nobody else unregisters it or registers its
        name; its own close() unregisters it."""
        import grpc
        from refit import _rpc, layout_io
        layout = LAYOUT_ONE
        worker_proto, _ = layout_io.one_worker(layout, None)
        arena = refit.SharedArena(1 << 16)
        tensors = {b.name: arena.empty(tuple(b.shape), "fp32") for b in worker_proto.buffers}
        address = self.cluster.daemons[0].worker_address
        w = refit.Worker(address, "policy", "trainer", layout, tensors)
        channel = grpc.insecure_channel(address)
        try:
            self.assertTrue(w.wait_connected(10))
            stub = _rpc.Stub(channel, "RefitWorker")
            for key in ["", "0" * 32]:
                with self.assertRaises(grpc.RpcError) as e:
                    stub.Unregister(refit_pb2.UnregisterWorkerRequest(worker_id=w.worker_id, session_key=key),
                                    timeout=5)
                self.assertEqual(e.exception.code(), grpc.StatusCode.PERMISSION_DENIED, e.exception.details())
            # A second registration of its name: refused while it is registered.
            with self.assertRaises(refit.RegistrationError) as e:
                refit.Worker(address, "policy", "trainer", layout, tensors, register_timeout=2)
            self.assertIn("ALREADY_EXISTS", str(e.exception))
            # A window for a wrongly ended session to show: nothing marks that it was left alone.
            time.sleep(0.3)
            self.assertTrue(w.connected)
            self.assertEqual([x["worker_id"] for x in self.ctl.workers()], [w.worker_id])
            w.close()  # unregisters with its key
            harness.wait_for(lambda: not self.ctl.workers(), 10, "the worker unregistered")
        finally:
            w.close()
            channel.close()
            arena.close()

    def test_a_worker_killed_and_restarted_at_once_registers_again(self):
        """An engine process frozen, its replacement started, then the frozen one killed (as a
        supervisor replaces a hung process): the name is still held by the old session at the
        replacement's first tries; it registers all the same once the old session ends (the
        client retries ALREADY_EXISTS a few seconds), and rounds go on."""
        self.start_side("trainer", "python", 0)
        engines = self.start_side("inference", "python", 1)
        self.refit_rounds(engines, [1])
        victim = engines[0]
        proc = next(p for p in self.cluster.procs if p.log_path.endswith(f"{victim}.log"))
        # Frozen first, so that its session (and name) outlive the replacement's first try;
        # then killed, which ends the session.
        proc.send_signal(signal.SIGSTOP)
        os.unlink(self.reports.path(victim))
        layout = self.files["inference"]
        mark = os.path.getsize(proc.log_path)  # the replacement logs to the same file
        start_python(self.cluster, victim, 1, "inference", layout, victim[len("inference-"):])
        # Killed once the replacement was refused the name its frozen predecessor holds (it logs
        # that it waits, after its first second of tries).
        harness.wait_for(lambda: "ALREADY_EXISTS" in log_since(proc.log_path, mark), 20,
                         f"the replacement of {victim} to be refused the name its frozen predecessor holds")
        proc.kill()
        proc.wait()
        self.reports.wait(victim, "registered", timeout=30)
        self.refit_rounds(engines, [2])

    def test_daemon_restarted_under_live_workers(self):
        self.start_side("trainer", "python", 0)
        engines = self.start_side("inference", "python", 1)
        self.refit_rounds(engines, [1])
        d = self.cluster.daemons[1]
        d.kill(signal.SIGKILL)
        for key in engines:
            self.reports.wait(key, "disconnected", timeout=5)
        d.start()
        for key in engines:
            self.reports.wait(key, "reconnected", timeout=10)
        self.refit_rounds(engines, [2, 3])


if __name__ == "__main__":
    unittest.main()
