"""Trainers that declare their rank and world size (Worker(..., rank=, world_size=)): a missing
rank is named even when it is the last one, which no guess from the other ranks' names can tell;
ranks that disagree on the world size are named; bad declarations are refused before anything is
sent."""
import asyncio
import os
import sys
import unittest

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402
import refit.aio  # noqa: E402
from sdk_cluster import ArenaCluster  # noqa: E402

# Trainer: four ranks of two rows each, on node 0. Engine: one worker holding all of it, on node 1.
TENSORS = [{"name": "w", "shape": [8, 4], "dtype": "fp32"}]


def rows(first, count):
    return {"name": "w", "dtype": "fp32", "shape": [count, 4],
            "pieces": [{"tensor": "w", "tensorBox": {"origin": [first, 0], "shape": [count, 4]}}]}


def trainer_layout(names, rows_each):
    return {"tensors": TENSORS, "workers": [{"name": n, "node": 0, "gpu": 0, "buffers": [rows(rows_each * r, rows_each)]}
                                            for r, n in enumerate(names)]}


RANK_NAMES = [f"rank{r}" for r in range(4)]
# Names that say nothing of the rank: only the declaration can.
HOST_NAMES = ["node0-gpu0", "node0-gpu1", "node1-gpu0", "node1-gpu1"]
ENGINE = {"tensors": TENSORS, "workers": [{"name": "engine", "node": 1, "gpu": 0, "buffers": [rows(0, 8)]}]}


class TrainerRanks(ArenaCluster):
    def trainer(self, layout, index, **kw):
        """The trainer of `layout`'s worker `index`; `kw` its declaration (rank=, world_size=)."""
        name = layout["workers"][index]["name"]
        return self.register(0, "trainer", layout, name, self.arena_tensor(layout, name, "fp32"), **kw)

    def engine(self):
        return self.register(1, "inference", ENGINE, "engine", self.arena_tensor(ENGINE, "engine", "fp32"))

    def test_the_last_of_four_trainer_ranks_missing_is_named(self):
        layout = trainer_layout(RANK_NAMES, 2)
        for rank in range(3):  # rank 3 never registers
            self.trainer(layout, rank, rank=rank, world_size=4)
        self.engine()
        with self.assertRaises(refit.RefitTimeout) as t:
            self.ctl.wait_ready("g", timeout=1)
        self.assertIn("trainer rank 3 of 4 is not registered", str(t.exception))
        status = self.ctl.group("g")
        self.assertFalse(status.get("ready", False))
        self.assertEqual(status["trainer_ranks"]["world_size"], 4)
        self.assertEqual(status["trainer_ranks"]["missing_ranks"], [3])
        self.assertEqual(status["trainer_ranks"]["workers"], ["rank0", "rank1", "rank2", ""])
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("g", 1, timeout=30)
        self.assertIn("trainer rank 3 of 4 is not registered", e.exception.reason)
        self.assertEqual(e.exception.culprit, 'worker "g/rank3"')

        async def refused():
            async with refit.aio.Controller(self.cluster.control) as ctl:
                with self.assertRaises(refit.RefitError) as e:
                    await ctl.refit("g", 1, timeout=30)
                return e.exception
        self.assertIn("trainer rank 3 of 4 is not registered", asyncio.run(refused()).reason)

        # The rank comes: the group is ready, and a round commits.
        self.trainer(layout, 3, rank=3, world_size=4)
        self.assertTrue(self.ctl.wait_ready("g", timeout=10)["trainer_ranks"]["complete"])
        self.assertTrue(self.ctl.refit("g", 1, timeout=30).committed)

    def test_a_declared_rank_missing_is_refused_even_when_the_others_cover_the_model(self):
        whole = {"tensors": TENSORS, "workers": [{"name": f"rank{r}", "node": 0, "gpu": 0, "buffers": [rows(0, 8)]}
                                                 for r in range(2)]}
        self.trainer(whole, 0, rank=0, world_size=2)
        self.engine()
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("g", 1, timeout=30)
        self.assertIn('group "g" is not ready: trainer rank 1 of 2 is not registered', e.exception.reason)
        self.trainer(whole, 1, rank=1, world_size=2)
        self.assertTrue(self.ctl.refit("g", 1, timeout=30).committed)

    def test_a_missing_rank_is_named_whatever_the_workers_are_called(self):
        layout = trainer_layout(HOST_NAMES, 2)
        for rank in (0, 1, 3):
            self.trainer(layout, rank, rank=rank, world_size=4)
        self.engine()
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("g", 1, timeout=30)
        self.assertIn("trainer rank 2 of 4 is not registered", e.exception.reason)
        self.assertIsNone(e.exception.culprit)  # its name cannot be told from the others'

    def test_trainers_that_disagree_on_the_world_size_are_named(self):
        layout = trainer_layout(RANK_NAMES[:2], 4)
        self.trainer(layout, 0, rank=0, world_size=2)
        self.trainer(layout, 1, rank=1, world_size=4)
        self.engine()
        ranks = self.ctl.group("g")["trainer_ranks"]
        self.assertFalse(ranks.get("complete", False))
        self.assertIn('trainers "rank0" and "rank1" disagree on the trainer world size (2 and 4)', ranks["problem"])
        self.assertIn("trainer rank 1 of 2 is not registered", ranks["problem"])

    def test_trainers_that_declare_nothing_are_reported_as_before(self):
        layout = trainer_layout(RANK_NAMES[:2], 4)
        self.trainer(layout, 0)
        self.engine()
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("g", 1, timeout=30)
        self.assertIn('trainer rank 1 ("g/rank1") is not registered', e.exception.reason)
        self.assertNotIn("trainer_ranks", self.ctl.group("g"))


class BadDeclarations(unittest.TestCase):
    """Refused before anything is sent: no daemon is needed."""

    def refused(self, role="trainer", **kw):
        layout = trainer_layout(["t"], 8)
        with self.assertRaises(refit.InvalidArgument) as e:
            refit.Worker("unix:/nonexistent/refitd.sock", "g", role, layout, {}, **kw)
        return str(e.exception)

    def test_each_bad_value_is_named(self):
        self.assertIn("rank must be in [0, world_size) = [0, 4), not 4", self.refused(rank=4, world_size=4))
        self.assertIn("rank must be in [0, world_size) = [0, 4), not -1", self.refused(rank=-1, world_size=4))
        self.assertIn("world_size must be between 1 and", self.refused(rank=0, world_size=0))
        self.assertIn("rank= was given without world_size=", self.refused(rank=1))
        self.assertIn("world_size= was given without rank=", self.refused(world_size=2))
        self.assertIn("rank must be an int, not True", self.refused(rank=True, world_size=2))
        self.assertIn("world_size must be an int, not '4'", self.refused(rank=0, world_size="4"))
        self.assertIn("a trainer's", self.refused(role="inference", rank=0, world_size=2))


if __name__ == "__main__":
    unittest.main()
