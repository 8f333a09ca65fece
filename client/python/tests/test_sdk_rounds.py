"""The SDK against real daemons: an engine's version after an aborted round, a parameter whose
storage was replaced, a missing rank named on either side, the round history, serve()'s timing,
and the asyncio controller."""
import asyncio
import os
import signal
import sys
import threading
import time
import unittest

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402
import refit.aio  # noqa: E402
from sdk_cluster import ArenaCluster  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def layout(workers):
    return {"tensors": [{"name": "w", "shape": [8, 4], "dtype": "fp32"}], "workers": workers}


def rows(first, count):
    return {"name": "w", "dtype": "fp32", "shape": [count, 4],
            "pieces": [{"tensor": "w", "tensorBox": {"origin": [first, 0], "shape": [count, 4]}}]}


# Trainer: two ranks of four rows each, on node 0. Engine: one worker holding all of it, on node
# 1, or a replica of two ranks of four rows.
TRAINERS = layout([{"name": f"rank{r}", "node": 0, "gpu": r, "buffers": [rows(4 * r, 4)]} for r in range(2)])
ENGINE = layout([{"name": "engine", "node": 1, "gpu": 0, "buffers": [rows(0, 8)]}])
ENGINE_TP2 = layout([{"name": f"engine-tp{r}", "node": 1, "gpu": r, "replica": "dp0", "replicaRank": r,
                      "replicaSize": 2, "buffers": [rows(4 * r, 4)]} for r in range(2)])


class Rounds(ArenaCluster):
    def worker(self, node, role, lay, name, tensor=None, **kw):
        t = tensor if tensor is not None else self.arena_tensor(lay, name, "fp32")
        return self.register(node, role, lay, name, t, **kw)

    def trainers(self, **kw):
        return [self.worker(0, "trainer", TRAINERS, f"rank{r}", **kw) for r in range(2)]

    def test_an_engine_holds_no_version_after_an_aborted_round(self):
        engine_prepared, engine_aborted = threading.Event(), threading.Event()
        refuse = threading.Event()

        def trainer_prepare(version):
            if refuse.is_set():  # once the engine is prepared, so that the round aborts after its PREPARE
                engine_prepared.wait(10)
                raise RuntimeError("optimizer step in progress")

        self.worker(0, "trainer", TRAINERS, "rank0", on_prepare=trainer_prepare)
        self.worker(0, "trainer", TRAINERS, "rank1")
        engine = self.worker(1, "engine", ENGINE, "engine", on_prepare=lambda v: engine_prepared.set(),
                             on_abort=lambda reason: engine_aborted.set())
        self.assertIs(engine.role, refit.Role.INFERENCE)
        self.ctl.wait_ready("g", timeout=20)
        self.assertTrue(self.ctl.refit("g", 1, timeout=30).committed)
        self.assertTrue(engine.wait_version(1, 10))
        engine_prepared.clear()
        refuse.set()
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("g", 2, timeout=30)
        self.assertIn("optimizer step in progress", e.exception.reason)
        self.assertTrue(engine_prepared.is_set(), "the engine was never prepared for the aborted round")
        self.assertTrue(engine_aborted.wait(10))
        self.assertEqual(engine.version, 0)
        refuse.clear()
        self.assertTrue(self.ctl.refit("g", 3, timeout=30).committed)
        self.assertTrue(engine.wait_version(3, 10))

    @unittest.skipIf(torch is None, "needs torch")
    def test_a_replaced_storage_fails_the_round_naming_the_parameter(self):
        param = torch.nn.Parameter(self.arena.empty((4, 4), "fp32"), requires_grad=False)
        param.data.fill_(1.0)
        rank0 = self.worker(0, "trainer", TRAINERS, "rank0", tensor=param)
        self.worker(0, "trainer", TRAINERS, "rank1")
        engine_w = self.arena.empty((8, 4), "fp32")
        self.worker(1, "inference", ENGINE, "engine", tensor=engine_w)
        self.ctl.wait_ready("g", timeout=20)
        self.assertTrue(self.ctl.refit("g", 1, timeout=30).committed)
        self.assertTrue(torch.equal(engine_w[:4], param.data))
        registered = param.data
        param.data = torch.full_like(param, 2.0)  # private memory the daemon was never handed
        with self.assertRaises(refit.StorageReplaced) as local:
            rank0.check_storage()
        self.assertIn("parameter 'w'", str(local.exception))
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("g", 2, timeout=30)
        self.assertEqual(e.exception.phase, "PREPARE", e.exception)
        self.assertEqual(e.exception.culprit, 'worker "g/rank0"', e.exception)
        self.assertIn("parameter 'w'", e.exception.reason)
        self.assertIn("replaced after registration", e.exception.reason)
        self.assertTrue(torch.equal(engine_w[:4], torch.ones(4, 4)))  # untouched: no stale round ran
        param.data = registered  # the registered memory again: rounds go on
        self.assertTrue(self.ctl.refit("g", 3, timeout=30).committed)

    def test_a_missing_trainer_rank_is_named(self):
        self.worker(0, "trainer", TRAINERS, "rank0")
        self.worker(1, "inference", ENGINE, "engine")
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("g", 1, timeout=30)
        self.assertTrue(e.exception.reason.startswith('trainer rank 1 ("g/rank1") is not registered'),
                        e.exception.reason)
        self.assertEqual(e.exception.culprit, 'worker "g/rank1"')
        with self.assertRaises(refit.RefitTimeout) as t:
            self.ctl.wait_ready("g", timeout=1)
        self.assertIn('trainer rank 1 ("g/rank1") is not registered', str(t.exception))

    def test_a_missing_engine_rank_is_named(self):
        self.trainers()
        self.worker(1, "inference", ENGINE_TP2, "engine-tp0")
        with self.assertRaises(refit.RefitTimeout) as t:
            self.ctl.wait_ready("g", timeout=1)
        self.assertIn('inference replica "dp0" rank 1 is not registered', str(t.exception))
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("g", 1, timeout=30)
        self.assertIn('inference replica "dp0" rank 1 is not registered', e.exception.reason)

    def test_rounds_lists_the_history(self):
        refuse = threading.Event()

        def prepare(version):
            if refuse.is_set():
                raise RuntimeError("not now")

        self.worker(0, "trainer", TRAINERS, "rank0", on_prepare=prepare)
        self.worker(0, "trainer", TRAINERS, "rank1")
        self.worker(1, "inference", ENGINE, "engine")
        self.ctl.wait_ready("g", timeout=20)
        first = self.ctl.refit("g", 1, timeout=30)
        refuse.set()
        with self.assertRaises(refit.RefitError):
            self.ctl.refit("g", 2, timeout=30)
        history = self.ctl.rounds("g")
        self.assertEqual([(r.version, r.state) for r in history], [(1, "COMMITTED"), (2, "ABORTED")])
        self.assertEqual(history[0].round_id, first.round_id)
        self.assertGreater(history[0].bytes, 0)
        self.assertIn("not now", history[1].reason)
        self.assertEqual([r.version for r in self.ctl.rounds("g", limit=1)], [2])
        self.assertEqual(self.ctl.rounds("other"), [])

    def test_serve_reports_where_the_time_went(self):
        def slow_prepare(version):
            time.sleep(0.2)  # the work being measured, not a wait for anything

        trainers = self.trainers(blocking=True, on_prepare=slow_prepare)
        self.worker(1, "inference", ENGINE, "engine")
        self.ctl.wait_ready("g", timeout=20)
        round_id = self.ctl.start_refit("g", 1)
        served = [None, None]

        def serve(i):
            served[i] = trainers[i].serve(timeout=10)

        threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for r in served:
            self.assertIsNotNone(r)
            self.assertTrue(r.committed, r)
            self.assertEqual(r.round_id, round_id)
            self.assertGreaterEqual(r.prepare_seconds, 0.2)
            self.assertGreater(r.transfer_seconds, 0.0)
            self.assertGreaterEqual(r.commit_seconds, 0.0)
            self.assertAlmostEqual(r.seconds, r.prepare_seconds + r.transfer_seconds + r.commit_seconds)
        with self.assertRaises(refit.StateError):
            self.workers[-1].serve(timeout=0)  # the engine is not blocking


    def test_a_round_whose_end_never_came_does_not_hold_up_the_next(self):
        """A PREPARE that overtook its own round's ABORT leaves the engine prepared for a round
        that is over; the next round's PREPARE must still be served (not after a 600 s wait)."""
        from refit._proto import refit_pb2
        prepared, aborted = [], []
        self.trainers()
        engine = self.worker(1, "inference", ENGINE, "engine", on_prepare=prepared.append,
                             on_abort=lambda reason, round_id: aborted.append((round_id, reason)))
        self.ctl.wait_ready("g", timeout=20)
        kinds = refit_pb2.RoundEvent

        def arrive(kind, round_id, version):  # as the session thread queues what the daemon sent
            engine._enqueue(refit_pb2.RoundEvent(kind=kind, round_id=round_id, version=version))

        arrive(kinds.ABORT, 900, 5)
        arrive(kinds.PREPARE, 900, 5)
        harness.wait_for(lambda: prepared == [5], 5, f"on_prepare(5): {prepared}")
        arrive(kinds.PREPARE, 901, 6)
        harness.wait_for(lambda: prepared == [5, 6], 5, f"on_prepare(6) after round 900 never ended: {prepared}")
        self.assertEqual([r for r, _ in aborted], [900, 900], aborted)
        self.assertIn("round 900 never ended here: round 901 began", aborted[1][1])
        self.assertTrue(engine.round_is_open(901))
        arrive(kinds.ABORT, 901, 6)
        harness.wait_for(lambda: len(aborted) == 3, 5, f"on_abort of round 901: {aborted}")
        # The daemon's next round is served as ever, and the engine holds its version.
        self.assertTrue(self.ctl.refit("g", 7, timeout=30).committed)
        harness.wait_for(lambda: engine.version == 7, 5, f"the engine at version 7: {engine.version}")
        self.assertEqual(prepared, [5, 6, 7])

    def test_open_watch_returns_once_open_and_sees_the_next_round_whole(self):
        self.trainers()
        self.worker(1, "inference", ENGINE, "engine")
        self.ctl.wait_ready("g", timeout=20)
        # The coordinator's own stream, then one that node 1 relays from it.
        for version, daemon in enumerate(self.cluster.daemons, start=1):
            ctl = refit.Controller(daemon.address)
            try:
                with ctl.open_watch("g", timeout=30) as watch:
                    round_id = self.ctl.start_refit("g", version)  # at once: no wait in between
                    states = []
                    for event in watch:
                        if event.round_id == round_id:
                            states.append(event.state)
                            if event.state in ("COMMITTED", "ABORTED"):
                                break
            finally:
                ctl.close()
            self.assertEqual(states, ["PREPARING", "TRANSFERRING", "COMMITTED"], f"node {daemon.node}")

    def test_open_watch_of_a_frozen_daemon_ends_at_the_controllers_timeout(self):
        node = self.cluster.daemons[1]
        ctl = refit.Controller(node.address, timeout=1)
        node.kill(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with self.assertRaises(refit.RefitTimeout) as e:
                ctl.open_watch("g", timeout=30)
            self.assertLess(time.monotonic() - t0, 5)
            self.assertIn("did not open the stream within 1 s", str(e.exception))
        finally:
            node.kill(signal.SIGCONT)
            ctl.close()


class AsyncController(unittest.TestCase):
    def test_refit_watch_and_rounds_are_awaitable(self):
        with harness.Cluster(nodes=2) as cluster:
            arena = refit.SharedArena(1 << 16)
            workers = [refit.Worker(cluster.daemons[0].worker_address, "g", refit.Role.TRAINER, TRAINERS,
                                    {"w": arena.empty((4, 4), "fp32")}, name=f"rank{r}") for r in range(2)]
            workers.append(refit.Worker(cluster.daemons[1].worker_address, "g", refit.Role.ENGINE, ENGINE,
                                        {"w": arena.empty((8, 4), "fp32")}))
            try:
                asyncio.run(self.drive(cluster.control))
            finally:
                for w in workers:
                    w.close()
                arena.close()

    async def drive(self, address):
        async with refit.aio.Controller(address) as ctl:
            status = await ctl.wait_ready("g", timeout=20)
            self.assertTrue(status["ready"])
            seen = []
            committed = asyncio.Event()

            async def watch():
                async for event in ctl.watch("g", timeout=60):
                    seen.append(event)
                    if event.committed:
                        committed.set()
                        return

            watcher = asyncio.create_task(watch())
            # The stream is open once the daemon sends on it: refit until the watcher sees a
            # round commit, at most a few times.
            results = {}
            for version in range(1, 6):
                result = await ctl.refit("g", version, timeout=30)
                self.assertIsInstance(result, refit.RoundResult)
                results[result.round_id] = result
                try:
                    await asyncio.wait_for(committed.wait(), timeout=2)
                    break
                except asyncio.TimeoutError:
                    continue
            await asyncio.wait_for(watcher, timeout=10)
            done = seen[-1]
            self.assertIn(done.round_id, results)
            self.assertEqual(done.version, results[done.round_id].version)
            history = await ctl.rounds("g")
            self.assertEqual(sorted(r.round_id for r in history), sorted(results))
            with self.assertRaises(refit.RefitError) as e:
                await ctl.refit("g", 1, timeout=30)
            self.assertIn("not newer", e.exception.reason)
            round_id = await ctl.start_refit("g", max(r.version for r in results.values()) + 1)
            self.assertGreater(round_id, max(results))
            with self.assertRaises(refit.RefitTimeout):
                await ctl.wait_ready("nobody", timeout=0.5)


if __name__ == "__main__":
    unittest.main()
