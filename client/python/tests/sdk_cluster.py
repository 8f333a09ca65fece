"""A test case with two real daemons, a controller, a shared-memory arena and the workers a test
makes (closed after each test): the fixture of the SDK's tests against daemons."""
import os
import sys
import unittest

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402


class ArenaCluster(unittest.TestCase):
    def setUp(self):
        self.cluster = harness.Cluster(nodes=2)
        self.ctl = refit.Controller(self.cluster.control)
        self.arena = refit.SharedArena(1 << 16)
        self.workers = []

    def tearDown(self):
        for w in self.workers:
            w.close()
        self.ctl.close()
        self.cluster.close()
        self.arena.close()

    def arena_tensor(self, layout, name, dtype):
        """A tensor in the arena shaped as worker `name`'s buffer."""
        shape = next(tuple(b["shape"]) for w in layout["workers"] if w["name"] == name for b in w["buffers"])
        return self.arena.empty(shape, dtype)

    def register(self, node, role, layout, name, tensor, **kw):
        """A worker of group "g" on `node` holding `tensor` as "w" (closed after the test)."""
        w = refit.Worker(self.cluster.daemons[node].worker_address, "g", role, layout, {"w": tensor}, name=name, **kw)
        self.workers.append(w)
        return w
