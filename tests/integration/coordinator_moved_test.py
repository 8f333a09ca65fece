"""Issue 13.1: a coordinator restarted at a *new* address. The other daemons find it through
--coordinator file:PATH (read again when heartbeats fail), rejoin within 2 s of the file naming
it, their workers' registrations reach it, and the next round commits byte-exact; versions never
go back (the state file moved with it). Python workers on the coordinator's node register again
by themselves (same socket).

Run: bazel test //tests/integration:coordinator_moved_test, or with the binaries built:
PYTHONPATH=client/python/tests:client/python python3 tests/integration/coordinator_moved_test.py
"""
import os
import signal
import sys
import time
import unittest

import grpc

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402
from e2e_lib import Reports, layouts, names, start_python  # noqa: E402


class CoordinatorMoved(unittest.TestCase):
    def setUp(self):
        self.state = os.path.join(harness.scratch(), "coordinator.state")
        self.cluster = harness.Cluster(nodes=3, coordinator_file=True,
                                       daemon_flags=["--state-file", self.state])
        self.reports = Reports(self.cluster)
        self.files = layouts(self.cluster)
        self.ctl = refit.Controller(self.cluster.control)

    def tearDown(self):
        self.ctl.close()
        self.cluster.close()

    def nodes_alive(self, ctl):
        try:
            return {int(n.get("node", 0)): n.get("alive", False) for n in ctl.status(timeout=2).get("nodes", [])}
        except refit.RefitError:
            return {}

    def test_restarted_at_a_new_address(self):
        # Trainer on node 0 (the coordinator's own), engines on node 1, node 2 idle but joined.
        trainer = self.files["trainer"]
        engine = self.files["inference"]
        keys = []
        for w in names(trainer):
            start_python(self.cluster, f"t-{w}", 0, "trainer", trainer, w)
            keys.append(f"t-{w}")
        engines = []
        for w in names(engine):
            start_python(self.cluster, f"e-{w}", 1, "inference", engine, w)
            engines.append(f"e-{w}")
        for k in keys + engines:
            self.reports.wait(k, "registered")
        self.ctl.wait_ready("policy", timeout=20)
        self.assertTrue(self.ctl.refit("policy", 1, timeout=60).committed)

        coordinator = self.cluster.daemons[0]
        old = coordinator.address
        coordinator.kill(signal.SIGKILL)
        coordinator.listen = "127.0.0.1:0"  # a new port: a pod rescheduled elsewhere
        coordinator.start()
        new = coordinator.address
        self.assertNotEqual(new, old)
        # Until told, the others keep calling the old address (nobody answers there).
        time.sleep(1.0)
        ctl = refit.Controller(new)
        self.assertFalse(all(self.nodes_alive(ctl).get(n) for n in (1, 2)),
                         "nodes joined a coordinator at an address nobody named")
        told = time.monotonic()
        self.cluster.name_coordinator(new)
        rejoined = None
        while time.monotonic() < told + 10:
            if all(self.nodes_alive(ctl).get(n) for n in (1, 2)):
                rejoined = time.monotonic() - told
                break
            time.sleep(0.05)
        self.assertIsNotNone(rejoined, f"nodes 1 and 2 did not rejoin within 10 s: {self.cluster.logs()}")
        print(f"nodes 1 and 2 rejoined {rejoined:.2f} s after the file named the new address", flush=True)
        self.assertLessEqual(rejoined, 2.0, f"rejoined {rejoined:.2f} s after the file named the new address")

        # Its own workers re-register by themselves; the engines' registrations reach it again.
        for k in keys:
            self.reports.wait(k, "reconnected")
        ctl.wait_ready("policy", timeout=20)
        # Versions never go back: 1 was committed before the move.
        with self.assertRaises(refit.RefitError) as e:
            ctl.refit("policy", 1, timeout=30)
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        stats = ctl.refit("policy", 2, timeout=60)
        self.assertTrue(stats.committed, stats)
        for k in engines:
            self.reports.wait(k, "commit 2 ")
            last = [l for l in self.reports.lines(k) if l.startswith("commit 2 ")][-1]
            self.assertIn(" ok ", last, f"{k}: {last}")
        # An operator call through a non-coordinator daemon is forwarded to the new address.
        via = refit.Controller(self.cluster.daemons[2].address)
        self.assertTrue(via.refit("policy", 3, timeout=60).committed)
        via.close()
        ctl.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
