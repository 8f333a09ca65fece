"""A coordinator restarted at a *new* address. The other daemons find it through
--coordinator file:PATH (read again when heartbeats fail), rejoin within 2 s of the file naming
it, their workers' registrations reach it, and the next round commits byte-exact; versions never
go back (the state file moved with it). Python workers on the coordinator's node register again
by themselves (same socket).

Run: bazel test //tests/integration:coordinator_moved_test, or with the binaries built:
PYTHONPATH=client/python/tests:client/python python3 tests/integration/coordinator_moved_test.py
"""
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import grpc

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402
from e2e_lib import Reports, layouts, names, start_python  # noqa: E402


def log_since(path, offset=0):
    """What the log at `path` holds from byte `offset` on."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


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
        others = self.cluster.daemons[1:]
        marks = {d.node: os.path.getsize(d.log) for d in others}
        coordinator.kill(signal.SIGKILL)
        coordinator.listen = "127.0.0.1:0"  # a new port: a pod rescheduled elsewhere
        coordinator.start()
        new = coordinator.address
        self.assertNotEqual(new, old)
        # Until told, the others keep calling the old address (nobody answers there): each has seen a
        # heartbeat to it fail, and joins nobody else.
        failed = f"heartbeat to the coordinator at {old} failed"
        harness.wait_for(lambda: all(failed in log_since(d.log, marks[d.node]) for d in others), 10,
                         f"nodes 1 and 2 to log \"{failed}\"")
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


class StartedBeforeItsCoordinator(unittest.TestCase):
    """A daemon whose coordinator is not up yet waits for it (bounded back-off,
    logged) instead of exiting, and joins once it is; SIGTERM while it waits ends it at once."""

    def test_waits_then_joins(self):
        d = harness.scratch()
        socket_dir = tempfile.mkdtemp(prefix="refit-", dir="/tmp")
        named = os.path.join(d, "coordinator.addr")  # names nobody yet
        addr = os.path.join(d, "node1.addr")
        log = open(os.path.join(d, "node1.log"), "wb")
        cmd = [harness.binary("refitd"), "--node", "1", "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
               "--worker-socket", os.path.join(socket_dir, "refitd-1.sock"), "--address-file", addr,
               "--heartbeat", "0.2", "--coordinator", "file:" + named]
        certs = harness.make_certs(os.path.join(d, "certs")) if harness.tls_wanted() else None
        if certs:
            cmd += harness.tls_flags(certs, 1)
        node1 = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        coordinator = None
        try:
            # Its first attempt failed and it says it waits (or it exited: the assertion says so).
            harness.wait_for(lambda: "waiting for the coordinator" in log_since(log.name) or node1.poll() is not None,
                             15, "node 1 to log that it waits for its coordinator")
            self.assertIsNone(node1.poll(), f"refitd exited while its coordinator was not up: {log_since(log.name)}")
            cluster = harness.Cluster(nodes=1, certs=certs)
            coordinator = cluster
            self.assertIsNone(node1.poll(), "refitd exited while its coordinator was starting")
            with open(named + ".tmp", "w") as f:
                f.write(cluster.daemons[0].address + "\n")
            os.replace(named + ".tmp", named)
            harness.wait_for(lambda: os.path.exists(addr) and os.path.getsize(addr) > 0, 15,
                             "node 1 to join the coordinator once the file named it")
            ctl = refit.Controller(cluster.control)
            harness.wait_for(lambda: any(int(n.get("node", 0)) == 1 and n.get("alive")
                                         for n in ctl.status().get("nodes", [])), 10, "node 1 alive")
            ctl.close()
        finally:
            node1.terminate()
            self.assertEqual(node1.wait(timeout=30), 0)
            log.close()
            if coordinator is not None:
                coordinator.close()

    def test_sigterm_while_waiting_ends_it(self):
        d = harness.scratch()
        socket_dir = tempfile.mkdtemp(prefix="refit-", dir="/tmp")
        cmd = [harness.binary("refitd"), "--node", "1", "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
               "--worker-socket", os.path.join(socket_dir, "refitd-1.sock"), "--coordinator", "127.0.0.1:1"]
        with open(os.path.join(d, "node1.log"), "wb") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            harness.wait_for(lambda: "waiting for the coordinator" in log_since(log.name) or p.poll() is not None, 15,
                             "the daemon to log that it waits for its coordinator")
            self.assertIsNone(p.poll(), f"refitd exited while its coordinator was not up: {log_since(log.name)}")
            t = time.monotonic()
            p.terminate()
            self.assertEqual(p.wait(timeout=10), 0)
            self.assertLess(time.monotonic() - t, 2.0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
