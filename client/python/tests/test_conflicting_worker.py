"""A worker whose layout declares a tensor otherwise than its group's workers already registered (on
its node, or on another: the coordinator checks those) is refused at registration, as a
refit.RegistrationError naming the tensor and the worker that holds the group's declaration; the
group stays usable: the right worker registers and a round commits."""
import os
import signal
import sys
import threading
import unittest

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402
from sdk_cluster import ArenaCluster  # noqa: E402


def layout(shape, workers):
    return {"tensors": [{"name": "w", "shape": shape, "dtype": "fp32"}], "workers": workers}


def rows(first, count, cols):
    return {"name": "w", "dtype": "fp32", "shape": [count, cols],
            "pieces": [{"tensor": "w", "tensorBox": {"origin": [first, 0], "shape": [count, cols]}}]}


# Two trainer ranks of four rows each on node 0, an engine holding all of it on node 1; and a
# second rank that believes "w" is [8, 8].
TRAINERS = layout([8, 4], [{"name": f"rank{r}", "node": 0, "gpu": r, "buffers": [rows(4 * r, 4, 4)]} for r in range(2)])
WIDER = layout([8, 8], [{"name": "rank1", "node": 0, "gpu": 1, "buffers": [rows(4, 4, 8)]}])
ENGINE = layout([8, 4], [{"name": "engine", "node": 1, "gpu": 0, "buffers": [rows(0, 8, 4)]}])
# The same disagreements on the other node: a trainer rank on node 1, an engine on node 0 (the
# coordinator's own workers are checked against node 1's).
WIDER_ON_1 = layout([8, 8], [{"name": "rank1", "node": 1, "gpu": 1, "buffers": [rows(4, 4, 8)]}])
TRAINER_ON_1 = layout([8, 4], [{"name": "rank1", "node": 1, "gpu": 1, "buffers": [rows(4, 4, 4)]}])
WIDE_ENGINE_ON_0 = layout([8, 8], [{"name": "wide", "node": 0, "gpu": 0, "buffers": [rows(0, 8, 8)]}])
WIDE_TRAINER_ON_0 = layout([8, 8], [{"name": "wide", "node": 0, "gpu": 0, "buffers": [rows(0, 4, 8)]}])


class ConflictingWorker(ArenaCluster):
    def worker(self, node, role, lay, name):
        return self.register(node, role, lay, name, self.arena_tensor(lay, name, "fp32"))

    def test_a_conflicting_shape_is_refused_and_the_group_still_refits(self):
        self.worker(0, "trainer", TRAINERS, "rank0")
        with self.assertRaises(refit.Error) as e:
            self.worker(0, "trainer", WIDER, "rank1")
        message = str(e.exception)
        self.assertIsInstance(e.exception, refit.RegistrationError)
        self.assertIn("FAILED_PRECONDITION", message)
        self.assertIn('tensor "w" as [8, 8] fp32', message)
        self.assertIn('"g/rank0"', message)
        self.assertIn("declares it as [8, 4] fp32", message)

        self.worker(0, "trainer", TRAINERS, "rank1")
        self.worker(1, "inference", ENGINE, "engine")
        self.ctl.wait_ready("g", timeout=30)
        self.assertEqual(self.ctl.refit("g", 1, timeout=30).version, 1)

    def assert_refused(self, error, declared, holder, held):
        message = str(error)
        self.assertIsInstance(error, refit.RegistrationError)
        self.assertIn("FAILED_PRECONDITION", message)
        self.assertIn(f'tensor "w" as {declared}', message)
        self.assertIn(holder, message)
        self.assertIn(f"declares it as {held}", message)

    def test_a_shape_declared_otherwise_on_another_node_is_refused(self):
        self.worker(0, "trainer", TRAINERS, "rank0")
        with self.assertRaises(refit.Error) as e:
            self.worker(1, "trainer", WIDER_ON_1, "rank1")
        self.assert_refused(e.exception, "[8, 8] fp32", 'trainer "g/rank0" on node 0', "[8, 4] fp32")

        # The refused worker left nothing behind: its name is free for the right one.
        self.worker(1, "trainer", TRAINER_ON_1, "rank1")
        self.worker(1, "inference", ENGINE, "engine")
        self.ctl.wait_ready("g", timeout=30)
        self.assertEqual(self.ctl.refit("g", 1, timeout=30).version, 1)

    def test_the_coordinators_own_worker_is_checked_against_another_nodes(self):
        self.worker(0, "trainer", TRAINERS, "rank0")
        self.worker(0, "trainer", TRAINERS, "rank1")
        self.worker(1, "inference", ENGINE, "engine")
        with self.assertRaises(refit.Error) as e:
            self.worker(0, "inference", WIDE_ENGINE_ON_0, "wide")
        self.assert_refused(e.exception, "[8, 8] fp32", 'inference worker "g/engine" on node 1',
                            "[8, 4] fp32")

        self.ctl.wait_ready("g", timeout=30)
        self.assertEqual(self.ctl.refit("g", 1, timeout=30).version, 1)

    def test_a_worker_refused_when_its_node_comes_back_is_dropped_there(self):
        # Node 1's trainer holds "w" as [8, 4]; node 1 is frozen and declared dead, and meanwhile
        # a trainer on node 0 declares "w" as [8, 8]. When node 1 thaws and sends its list again,
        # the coordinator refuses its trainer: node 1 must drop it (not keep a worker its group
        # does not count), and the worker hears why when it tries to register again.
        reasons = []
        heard = threading.Event()

        def on_disconnect(reason):
            reasons.append(reason)
            if "cannot register again" in reason:
                heard.set()

        self.worker_with(1, "trainer", TRAINER_ON_1, "rank1", on_disconnect=on_disconnect)
        node1 = self.cluster.daemons[1]
        node1.proc.send_signal(signal.SIGSTOP)
        try:
            harness.wait_for(lambda: not self.node_alive(1), 15, "node 1 declared dead")
            self.worker(0, "trainer", WIDE_TRAINER_ON_0, "wide")
        finally:
            node1.proc.send_signal(signal.SIGCONT)
        self.assertTrue(heard.wait(20), f"the refused trainer was not dropped by node 1: {reasons}\n"
                                        f"{self.cluster.logs()}")
        message = next(r for r in reasons if "cannot register again" in r)
        self.assertIn("FAILED_PRECONDITION", message)
        self.assertIn('tensor "w" as [8, 4] fp32', message)
        self.assertIn('"g/wide"', message)

    def worker_with(self, node, role, lay, name, **kw):
        return self.register(node, role, lay, name, self.arena_tensor(lay, name, "fp32"), **kw)

    def node_alive(self, node):
        return any(int(n.get("node", 0)) == node and n.get("alive") for n in self.ctl.status().get("nodes", []))


if __name__ == "__main__":
    unittest.main()
