"""A worker whose layout declares a tensor otherwise than its group's workers already registered on
its node is refused at registration, as a refit.Error naming the tensor and the worker that holds
the group's declaration; the group stays usable: the right worker registers and a round commits."""
import os
import sys
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


if __name__ == "__main__":
    unittest.main()
