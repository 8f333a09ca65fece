"""The engine's update window (refit.integrations._common.EngineWindow) and the worker's round
ids: a PREPARE that waited for the window while its round aborted is never taken by the next
update, and an older round's ABORT never becomes a newer update's outcome. Unit tests of the
window (its callbacks called as the worker calls them) and one race through real daemons."""
import os
import sys
import threading
import time
import unittest

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402
from refit.integrations._common import EngineWindow, IntegrationError, RoundAborted  # noqa: E402
from refit.worker import takes_round_id  # noqa: E402
from sdk_cluster import ArenaCluster  # noqa: E402

WAIT_S = 20.0  # every wait's deadline: far above what a loaded machine needs


def wait_until(predicate, timeout=WAIT_S):
    """Whether `predicate()` held before `timeout` s (checked every millisecond)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


class Call:
    """fn(*args, **kw) on a thread of its own: what it returned or raised, once done."""

    def __init__(self, fn, *args, **kw):
        self.result, self.error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn, args, kw), daemon=True)
        self._thread.start()

    def _run(self, fn, args, kw):
        try:
            self.result = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 (reported by join)
            self.error = e

    def join(self, timeout=WAIT_S):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"still running after {timeout:g} s")
        return self


class Window(unittest.TestCase):
    """The window's callbacks, called in the order a worker calls them."""

    def test_a_prepare_waiting_for_the_window_gives_up_when_its_round_ends(self):
        w = EngineWindow(prepare_wait_s=600)
        waiting = Call(w.on_prepare, 1, round_id=7)
        w.on_round_end(7)  # the worker received round 7's ABORT
        self.assertIsInstance(waiting.join().error, RuntimeError)  # within WAIT_S, not 600 s
        self.assertIn("round 7", str(waiting.error))
        w.on_abort("trainer refused", round_id=7)
        # The next update: round 7 is none of its business.
        w.enter()
        run = Call(w.on_prepare, 2, round_id=8)
        self.assertEqual(w.wait_prepared(WAIT_S), 2)
        self.assertIsNone(run.join().error)
        w.on_round_end(8)
        w.on_commit(2, round_id=8)
        w.wait_outcome(2, WAIT_S)
        self.assertEqual(w.committed_version, 2)

    def test_a_round_that_ended_before_the_update_is_refused_when_the_window_opens(self):
        # Its end is known (on_round_end) before the update opens the window, its on_prepare
        # only wakes after: the update must not take it.
        w = EngineWindow(prepare_wait_s=600)
        w.on_round_end(7)
        w.enter()
        self.assertIsInstance(Call(w.on_prepare, 1, round_id=7).join().error, RuntimeError)
        w.on_abort("trainer refused", round_id=7)  # dispatched after the update began
        w.on_prepare(2, round_id=8)
        self.assertEqual(w.wait_prepared(WAIT_S), 2)
        w.on_commit(2, round_id=8)
        w.wait_outcome(2, WAIT_S)

    def test_an_abort_of_a_round_over_before_the_update_is_not_its_outcome(self):
        # Round 8's PREPARE was dropped by the worker (its ABORT came first): only the ABORT is
        # delivered, after the update began. Round 9 is the update's.
        w = EngineWindow(prepare_wait_s=600)
        w.on_round_end(7)
        w.on_round_end(8)
        w.enter()
        w.on_abort("round 7 refused", round_id=7)
        w.on_abort("round 8 refused", round_id=8)
        w.on_prepare(3, round_id=9)
        self.assertEqual(w.wait_prepared(WAIT_S), 3)
        w.on_commit(3, round_id=9)
        w.wait_outcome(3, WAIT_S)

    def test_the_updates_round_aborting_before_it_prepared_this_engine_ends_the_update(self):
        w = EngineWindow(prepare_wait_s=600)
        w.enter()
        w.on_round_end(9)  # over after the update began: the update's round
        w.on_abort("engine dp1 refused", round_id=9)
        with self.assertRaises(RoundAborted) as e:
            w.wait_prepared(WAIT_S)
        self.assertEqual(e.exception.reason, "engine dp1 refused")

    def test_only_the_prepared_rounds_end_is_the_outcome(self):
        w = EngineWindow(prepare_wait_s=600)
        w.enter()
        w.on_prepare(1, round_id=7)
        w.on_abort("late", round_id=6)  # an older round's, arriving late
        w.on_commit(5, round_id=5)
        w.on_commit(1, round_id=7)
        w.wait_outcome(1, WAIT_S)
        w.leave()
        # A next update; the previous round's events arriving again do not end it.
        w.enter()
        w.on_abort("stale", round_id=7)
        w.on_prepare(2, round_id=8)
        w.on_abort("its own", round_id=8)
        with self.assertRaises(RoundAborted) as e:
            w.wait_outcome(2, WAIT_S)
        self.assertEqual(e.exception.reason, "its own")

    def test_a_closed_window_refuses_after_prepare_wait_s(self):
        w = EngineWindow(prepare_wait_s=0.05)
        self.assertIn("not inside a weight update", str(Call(w.on_prepare, 1, round_id=7).join().error))
        w.enter()
        w.on_abort("refused here", round_id=7)  # the refused round's ABORT, after the next enter()
        with self.assertRaises(IntegrationError) as e:
            w.wait_prepared(0.05)
        self.assertNotIsInstance(e.exception, RoundAborted)

    def test_an_update_whose_round_aborted_before_the_window_opened_learns_it_by_round_id(self):
        # The trainer started round 9, then the update; round 9 aborted in between (its PREPARE
        # here was refused). Whether it is the update's own, only its round id tells.
        w = EngineWindow(prepare_wait_s=600)
        waiting = Call(w.on_prepare, 4, round_id=9)
        w.on_round_end(9)
        self.assertIsInstance(waiting.join().error, RuntimeError)
        w.on_abort("trainer refused", round_id=9)
        w.enter()
        self.assertIsNone(w.wait_prepared(WAIT_S, unless_last_aborted=True))
        with self.assertRaises(RoundAborted) as e:
            w.wait_round(9, 4, WAIT_S)
        self.assertEqual(e.exception.reason, "trainer refused")
        # An older round: the update's own comes after, and it is the one waited for.
        w.leave()
        w.enter()
        self.assertIsNone(w.wait_prepared(WAIT_S, unless_last_aborted=True))
        w.on_prepare(4, round_id=10)
        w.on_round_end(10)
        w.on_commit(4, round_id=10)
        w.wait_round(10, 4, WAIT_S)
        self.assertEqual(w.committed_version, 4)

    def test_after_a_committed_round_the_update_waits_for_its_prepare(self):
        w = EngineWindow(prepare_wait_s=600)
        w.enter()
        w.on_prepare(1, round_id=7)
        w.on_round_end(7)
        w.on_commit(1, round_id=7)
        w.leave()
        w.enter()
        late = Call(w.wait_prepared, WAIT_S, unless_last_aborted=True)
        w.on_prepare(2, round_id=8)  # this update's PREPARE, after the window opened
        self.assertEqual(late.join().result, 2)

    def test_without_round_ids_every_event_counts_as_before(self):
        w = EngineWindow(prepare_wait_s=600)
        w.enter()
        w.on_prepare(1)
        w.on_abort("aborted")
        with self.assertRaises(RoundAborted):
            w.wait_outcome(1, WAIT_S)
        w.enter()
        w.on_prepare(2)
        w.on_commit(2)
        w.wait_outcome(2, WAIT_S)

    def test_which_callbacks_are_passed_the_round_id(self):
        def plain(version):
            pass

        def keyword(version, *, round_id):
            pass

        def forwards(*args, **kwargs):
            pass

        self.assertFalse(takes_round_id(plain))
        self.assertFalse(takes_round_id(forwards))  # **kwargs alone does not ask for it
        self.assertFalse(takes_round_id(print))
        self.assertFalse(takes_round_id(None))
        self.assertTrue(takes_round_id(keyword))
        self.assertTrue(takes_round_id(lambda version, round_id=None: None))
        w = EngineWindow(1.0)
        self.assertTrue(all(takes_round_id(fn) for fn in w.worker_callbacks().values()))


def layout(workers):
    return {"tensors": [{"name": "w", "shape": [8, 4], "dtype": "fp32"}], "workers": workers}


def rows(first, count):
    return {"name": "w", "dtype": "fp32", "shape": [count, 4],
            "pieces": [{"tensor": "w", "tensorBox": {"origin": [first, 0], "shape": [count, 4]}}]}


TRAINERS = layout([{"name": f"rank{r}", "node": 0, "gpu": r, "buffers": [rows(4 * r, 4)]} for r in range(2)])
ENGINE = layout([{"name": "engine", "node": 1, "gpu": 0, "buffers": [rows(0, 8)]}])


class ThroughDaemons(ArenaCluster):
    """Two trainer ranks on node 0, an engine on node 1 behind an EngineWindow (closed between
    updates; prepare_wait_s below refitd's --prepare-timeout)."""

    def setUp(self):
        super().setUp()
        self.window = EngineWindow(prepare_wait_s=8.0)
        self.refuse = threading.Event()
        self.worker(0, "trainer", TRAINERS, "rank0", on_prepare=self.trainer_prepare)
        self.worker(0, "trainer", TRAINERS, "rank1")
        self.engine = self.worker(1, "engine", ENGINE, "engine", **self.window.worker_callbacks())
        self.ctl.wait_ready("g", timeout=WAIT_S)

    def worker(self, node, role, lay, name, **kw):
        return self.register(node, role, lay, name, self.arena_tensor(lay, name, "fp32"), **kw)

    def trainer_prepare(self, version):
        # While refusing: once the engine took this round's PREPARE (and waits for its window).
        if self.refuse.is_set():
            if not wait_until(lambda: self.engine.version == 0):
                raise RuntimeError("the engine never received the PREPARE")
            raise RuntimeError("optimizer step in progress")

    def update(self, version):
        """An update: the window opens, the round prepares the engine and commits."""
        self.window.enter()
        try:
            run = Call(self.ctl.refit, "g", version, timeout=WAIT_S)
            self.assertEqual(self.window.wait_prepared(WAIT_S), version)
            self.window.wait_outcome(version, WAIT_S)
        finally:
            self.window.leave()
        self.assertTrue(run.join().result.committed)
        self.assertTrue(self.engine.wait_version(version, WAIT_S))

    def aborted_while_closed(self, version):
        """A round that starts while the window is closed and aborts: the engine's PREPARE of it
        waits for the window while its ABORT arrives. Returns the round's id once the engine's
        session received the ABORT."""
        self.refuse.set()
        try:
            with self.assertRaises(refit.RefitError) as e:
                self.ctl.refit("g", version, timeout=WAIT_S)
        finally:
            self.refuse.clear()
        self.assertIn("optimizer step in progress", e.exception.reason)
        round_id = next(r.round_id for r in self.ctl.rounds("g", limit=16) if r.version == version)
        # The worker clears its round in flight then (no public state says so before the
        # callbacks run).
        self.assertTrue(wait_until(lambda: self.engine._in_round != round_id), "the engine never received the ABORT")
        return round_id

    def test_a_round_aborted_while_the_window_was_closed_is_not_the_next_updates(self):
        window, engine = self.window, self.engine
        self.update(1)
        self.aborted_while_closed(2)

        # The next update, as vLLM's send_weights() runs it: the round starts, then the window
        # opens. The engine must be prepared for round 3 (not the dead round 2), and commit it.
        round3 = Call(self.ctl.refit, "g", 3, timeout=WAIT_S)
        window.enter()
        try:
            self.assertEqual(window.wait_prepared(WAIT_S), 3)
            window.wait_outcome(3, WAIT_S)
        finally:
            window.leave()
        self.assertIsNone(round3.join().error)
        self.assertTrue(round3.result.committed)
        self.assertTrue(engine.wait_version(3, WAIT_S))
        self.assertEqual(window.committed_version, 3)

    def test_an_update_whose_own_round_aborted_before_its_window_opened_fails_at_once(self):
        # As vLLM's send_weights() runs it: the round starts (and here aborts), then the update.
        self.update(1)
        round_id = self.aborted_while_closed(2)
        started = time.monotonic()
        self.window.enter()
        try:
            self.assertIsNone(self.window.wait_prepared(WAIT_S, unless_last_aborted=True))
            with self.assertRaises(RoundAborted) as e:
                self.window.wait_round(round_id, 2, WAIT_S)
        finally:
            self.window.leave()
        self.assertIn("optimizer step in progress", e.exception.reason)
        self.assertLess(time.monotonic() - started, 5.0, "the update waited for a round that was over")
        self.update(3)


if __name__ == "__main__":
    unittest.main()
