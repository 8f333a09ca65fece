"""What a new user of the SDK relies on, against real daemons: an engine described by hand with
`dtensor.trainer_layout(..., replica=...)` is one replica, refit only once all its ranks are
registered (and one described without it is warned about); the version of the next round read
from the controller, so that a job run again is not refused as not newer."""
import asyncio
import logging
import os
import sys
import unittest

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import grpc  # noqa: E402
import refit  # noqa: E402
import refit.aio  # noqa: E402
from refit.layouts import RankPlacement, dtensor  # noqa: E402

import torch  # noqa: E402

from sdk_cluster import ArenaCluster  # noqa: E402

# One 8x4 fp32 tensor, rows over two ranks on either side, as docs/PYTHON.md describes them.
SPECS = {"w": ((8, 4), torch.float32, ["S(0)"])}


def trainers_layout():
    return dtensor.trainer_layout(SPECS, mesh=(2,), worker_name="rank{rank}")


def engine_layout(replica):
    return dtensor.trainer_layout(SPECS, mesh=(2,), worker_name="engine-tp{rank}",
                                  placement=RankPlacement(first_node=1), replica=replica)


class Cluster(ArenaCluster):
    def worker(self, node, role, layout, name, fill=0.0):
        t = self.arena_tensor(layout, name, torch.float32).fill_(fill)
        return self.register(node, role, layout, name, t), t

    def trainers(self):
        layout = trainers_layout()
        return [self.worker(0, "trainer", layout, f"rank{r}", fill=float(r + 1))[1] for r in range(2)]


class HandDescribedEngine(Cluster):
    def test_replica_declares_every_rank(self):
        layout = engine_layout("tp")
        self.assertEqual([(w["name"], w["node"], w["replica"], w["replicaRank"], w["replicaSize"])
                          for w in layout["workers"]],
                         [("engine-tp0", 1, "tp", 0, 2), ("engine-tp1", 1, "tp", 1, 2)])
        with self.assertRaises(refit.layouts.LayoutError):
            engine_layout("")

    def test_a_tp2_engine_is_refit_only_once_both_ranks_registered(self):
        shards = self.trainers()
        layout = engine_layout("tp")
        engine0, w0 = self.worker(1, "inference", layout, "engine-tp0")
        with self.assertRaises(refit.RefitTimeout) as t:
            self.ctl.wait_ready("g", timeout=1)
        self.assertIn('inference replica "tp" rank 1 is not registered', str(t.exception))
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("g", 1, timeout=30)
        self.assertIn('inference replica "tp" rank 1 is not registered', e.exception.reason)
        self.assertEqual(engine0.version, 0)
        self.assertTrue(torch.equal(w0, torch.zeros(4, 4)))  # not written while its peer was missing
        engine1, w1 = self.worker(1, "inference", layout, "engine-tp1")
        self.ctl.wait_ready("g", timeout=20)
        self.assertTrue(self.ctl.refit("g", 1, timeout=30).committed)
        for engine in (engine0, engine1):
            self.assertTrue(engine.wait_version(1, 10))
        self.assertTrue(torch.equal(torch.cat([w0, w1]), torch.cat(shards)))
        (replica,) = self.ctl.group("g")["replicas"]
        self.assertEqual((replica["name"], replica["size"], replica.get("complete")), ("tp", 2, True))

    def test_an_engine_rank_without_a_replica_is_warned_about(self):
        with self.assertLogs("refit.worker", logging.WARNING) as logs:
            self.worker(1, "inference", engine_layout(None), "engine-tp0")
        self.assertIn("'engine-tp0' holds part of the model (tensor 'w': 16 of 32 elements)", logs.output[0])
        self.assertIn("declares no replica", logs.output[0])
        whole = dtensor.trainer_layout({"w": ((8, 4), torch.float32, None)}, mesh=(2,),
                                       worker_name="full{rank}", placement=RankPlacement(first_node=1))
        with self.assertNoLogs("refit.worker", logging.WARNING):  # each holds all of it: a replica indeed
            self.worker(1, "inference", whole, "full0")
        with self.assertNoLogs("refit.worker", logging.WARNING):  # a trainer's slices are no engine's
            self.worker(0, "trainer", trainers_layout(), "rank0")


class Versions(Cluster):
    def test_next_version_follows_what_the_group_committed(self):
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.next_version("g")  # no worker registered it: its version cannot be read
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("no registered worker", e.exception.reason)
        self.trainers()
        self.worker(1, "inference", engine_layout("tp"), "engine-tp0")
        self.worker(1, "inference", engine_layout("tp"), "engine-tp1")
        self.ctl.wait_ready("g", timeout=20)
        self.assertEqual((self.ctl.committed_version("g"), self.ctl.next_version("g")), (0, 1))
        for step in (1, 2, 3):
            self.ctl.refit("g", step, timeout=30)
        # The same loop run again with a new controller: step 1 is not newer; next_version is.
        with refit.Controller(self.cluster.control) as again:
            with self.assertRaises(refit.RefitError) as e:
                again.refit("g", 1, timeout=30)
            self.assertIn("not newer", e.exception.reason)
            self.assertEqual(again.next_version("g"), 4)
            self.assertEqual(again.refit("g", again.next_version("g"), timeout=30).version, 4)
        self.assertEqual(self.ctl.committed_version("g"), 4)

        async def aio_versions():
            async with refit.aio.Controller(self.cluster.control) as ctl:
                return await ctl.committed_version("g"), await ctl.next_version("g")

        self.assertEqual(asyncio.run(aio_versions()), (4, 5))


if __name__ == "__main__":
    unittest.main()
