"""wait_group_version_above: woken by the round's COMMITTED event, not a poll; a commit that lands
before the stream is open is seen at once; falls back to reading the version when the daemon
refuses the watch; names the group when nothing came."""
import threading
import time
import unittest

from refit.errors import Error
from refit.integrations._common import IntegrationError, wait_group_version_above


class _Event:
    def __init__(self, version, committed=True):
        self.version, self.committed = version, committed


class FakeController:
    """The two calls wait_group_version_above makes: group() and watch()."""

    def __init__(self):
        self.version = 0
        self.events = []          # what the next watch() yields, then it ends
        self.refuse_watch = False
        self.watches = 0
        self.lock = threading.Lock()

    def group(self, name):
        with self.lock:
            return {"name": name, "version": self.version}

    def watch(self, group, timeout=None):
        with self.lock:
            self.watches += 1
            if self.refuse_watch:
                raise Error("RESOURCE_EXHAUSTED: at most 8 WatchRounds streams per caller")
            events, self.events = self.events, []
        yield from events
        time.sleep(timeout or 0)  # the stream: open and silent until its deadline


class RacingController(FakeController):
    """A round commits just as a watch stream is requested, before the daemon has it open: the
    stream never reports it. watch() requests its stream at the first iteration, as
    refit.Controller.watch does; open_watch() at once, as refit.Controller.open_watch does."""

    def _requested(self):
        with self.lock:
            self.watches += 1
            self.version = 5  # committed meanwhile; no event for it

    def watch(self, group, timeout=None):
        self._requested()
        time.sleep(timeout or 0)  # the stream: nothing more happens until its deadline
        yield from ()

    def open_watch(self, group, timeout=None):
        self._requested()
        return _Stream(timeout)


class _Stream:
    def __init__(self, timeout):
        self.timeout = timeout

    def __iter__(self):
        time.sleep(self.timeout or 0)  # the stream: nothing more happens until its deadline
        return iter(())

    def close(self):
        pass


class WaitVersionTest(unittest.TestCase):
    def test_a_commit_before_the_stream_is_open_is_seen_without_a_recheck(self):
        c = RacingController()
        t0 = time.monotonic()
        self.assertEqual(wait_group_version_above(c, "policy", 4, timeout=20, recheck_s=10), 5)
        self.assertLess(time.monotonic() - t0, 5)  # not after recheck_s (10 s)
        self.assertEqual(c.watches, 1)


    def test_committed_event_returns_its_version(self):
        c = FakeController()
        c.events = [_Event(3, committed=False), _Event(4)]
        t0 = time.monotonic()
        self.assertEqual(wait_group_version_above(c, "policy", 3, timeout=5), 4)
        self.assertLess(time.monotonic() - t0, 0.4)  # not after a recheck period

    def test_an_older_commit_is_not_enough(self):
        c = FakeController()
        c.events = [_Event(2)]
        threading.Timer(0.3, lambda: setattr(c, "version", 5)).start()
        self.assertEqual(wait_group_version_above(c, "policy", 3, timeout=5, recheck_s=0.1), 5)

    def test_a_refused_watch_falls_back_to_reading_the_version(self):
        c = FakeController()
        c.refuse_watch = True
        threading.Timer(0.2, lambda: setattr(c, "version", 7)).start()
        self.assertEqual(wait_group_version_above(c, "policy", 6, timeout=5), 7)
        self.assertGreater(c.watches, 1)

    def test_nothing_committed_names_the_group(self):
        c = FakeController()
        with self.assertRaisesRegex(IntegrationError, "'policy' committed no version above 1 within 0.3 s"):
            wait_group_version_above(c, "policy", 1, timeout=0.3, recheck_s=0.1)


if __name__ == "__main__":
    unittest.main()
