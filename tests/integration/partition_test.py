"""Network partitions between the coordinator and one node, struck at each phase of a round,
through a pausable TCP proxy (pausable_proxy.py): real refitd daemons on loopback, host backend.

The cluster: four daemons. Node 0 coordinates and holds no worker, so that the data plane never
crosses the partition (it is a control-plane partition: what a coordinator on another host than
its nodes sees). Group "policy": Python workers (pattern_worker.py: an engine poisons its buffers
at PREPARE and checks every byte at COMMIT), a small Qwen2.5, a Megatron trainer TP2 on node 1 and
a vLLM engine TP2 x DP2: replica dp0 on node 2 (the node cut off), dp1 on node 3.

How the proxy sits: the coordinator and node 2 are started with `grpc_proxy` naming the proxy, so
their gRPC channels go through it (HTTP CONNECT); the proxy tells the coordinator's calls to node
2 (their target is node 2's address) from node 2's calls to the coordinator (heartbeats, worker
syncs: their target is the coordinator's). A partition is struck at the moment the coordinator's
call of a phase (PREPARE, TRANSFER or COMMIT) for the group reaches the proxy on its way to node
2: the proxy holds that request and, by kind:
- "calls": every byte of the coordinator's calls to node 2 (an asymmetric partition as the
  coordinator sees it: node 2's heartbeats arrive and are answered, its phase calls do not);
- "one_way": every byte from the coordinator to node 2 (the calls and the heartbeats' answers);
- "full": every byte between them, both ways.
The partition heals after the round ended and node 2's leases had time to run out: the held
bytes then go through, late (as TCP delivers a retransmission), stale requests included.

What each case asserts (what an operator relies on):
- the round ends within its phase's deadline, and either COMMITTED with every replica confirmed,
  or ABORTED naming node 2, or COMMITTED with node 2's replica in `unconfirmed_replicas` and the
  commit note naming node 2; a partition struck before COMMIT can only abort;
- Status, read from the round's end until after the next round, never shows a replica at a
  version that its engines do not hold (their report files say what they hold);
- node 2's engines that were told PREPARE drop to "no version" (ABORT) within their lease of the
  round's end, not at the next round; no worker is told both COMMIT and ABORT of one round;
- after the partition heals, the next round commits and every engine checks every byte.

Run: bazel test //tests/integration:partition_test, or with the binaries built (bazel-bin):
PYTHONPATH=client/python/tests:client/python python3 tests/integration/partition_test.py [-k PATTERN]
"""
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import unittest
from typing import Dict, List, Optional, Tuple

import harness

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402
from e2e_lib import Reports, start_python  # noqa: E402
from pausable_proxy import BOTH, Direction, PausableProxy  # noqa: E402
from refit._proto import refit_pb2  # noqa: E402

GROUP = "policy"
CUT_NODE = 2
PREPARE_S = TRANSFER_S = COMMIT_S = 2.0
PEER_S = 1.0
DAEMON_FLAGS = ["--prepare-timeout", "2", "--transfer-timeout", "2", "--commit-timeout", "2", "--peer-timeout", "1"]
LEASE_S = 0.2 * 5  # the harness's --heartbeat 0.2 x --heartbeats-missed 5: a round's lease on a node
SLACK_S = 1.5      # process scheduling on a loaded 2-core machine
# The longest a round may take once the partition struck: the phase's deadline and the control
# call's allowance, then, for an aborted round, the ABORT to a node that does not answer (the
# driver waits 2 x --peer-timeout for it before it reports the round over), scheduling slack.
ROUND_END_S = max(PREPARE_S, TRANSFER_S, COMMIT_S) + PEER_S + 2 * PEER_S + SLACK_S
# How long the partition lasts past the round's end: past node 2's lease, so that only the lease
# can have told its engines the round ended.
HOLD_AFTER_END_S = LEASE_S + 1.0
READY_S = 20.0

# The proxy's rules per kind: (whose connections, which direction) -> held.
KINDS = {
    "calls": [("node", {Direction.TO_TARGET})],
    "one_way": [("node", {Direction.TO_TARGET}), ("coordinator", {Direction.TO_CLIENT})],
    "full": [("node", BOTH), ("coordinator", BOTH)],
}
PHASES = {"PREPARE": refit_pb2.PhaseRequest.PREPARE, "TRANSFER": refit_pb2.PhaseRequest.TRANSFER,
          "COMMIT": refit_pb2.PhaseRequest.COMMIT}


def phase_call(phase: str, version: int) -> "re.Pattern[bytes]":
    """The coordinator's PhaseRequest of `phase` for GROUP at `version`, as it goes on the wire:
    a gRPC message is the serialized proto, its fields in number order (phase, group, round_id,
    version); the round id, unknown here, is any varint."""
    head = refit_pb2.PhaseRequest(phase=PHASES[phase], group=GROUP).SerializeToString()
    tail = refit_pb2.PhaseRequest(version=version).SerializeToString()
    return re.compile(re.escape(head) + rb"\x18[\x80-\xff]{0,9}[\x00-\x7f]" + re.escape(tail), re.DOTALL)


@contextlib.contextmanager
def through_proxy(proxy: PausableProxy):
    """Processes started inside send their gRPC channels through `proxy` (gRPC's grpc_proxy)."""
    saved = {k: os.environ.get(k) for k in ("grpc_proxy", "no_grpc_proxy", "no_proxy")}
    os.environ["grpc_proxy"] = "http://" + proxy.address
    os.environ.pop("no_grpc_proxy", None)
    os.environ.pop("no_proxy", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def held_version(lines: List[str]) -> int:
    """The version an engine's buffers hold, from its report: the last checked COMMIT's, or 0
    after a PREPARE (poisoned), an ABORT, a lost session or a failed check."""
    for line in reversed(lines):
        words = line.split()
        if not words:
            continue
        if words[0] == "commit":
            return int(words[1]) if len(words) > 2 and words[2] == "ok" else 0
        if words[0] in ("prepare", "abort", "disconnected"):
            return 0
    return 0


class RoundCall:
    """One Refit call on a thread: its RoundResult or RefitError, and when it returned."""

    def __init__(self, ctl: refit.Controller, version: int):
        self.result: Optional[refit.controller.RoundResult] = None
        self.error: Optional[Exception] = None
        self.t_end: Optional[float] = None
        self._thread = threading.Thread(target=self._run, args=(ctl, version), daemon=True)
        self._thread.start()

    def _run(self, ctl: refit.Controller, version: int) -> None:
        try:
            self.result = ctl.refit(GROUP, version, timeout=60)
        except Exception as e:  # noqa: BLE001 - a RefitError, or any failure: the case reports it
            self.error = e
        self.t_end = time.monotonic()

    def join(self, timeout: float) -> bool:
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    def describe(self) -> str:
        if self.result is not None:
            p = self.result.proto
            return (f"{self.result!r} unconfirmed {list(p.unconfirmed_replicas)} "
                    f"note {p.commit_note!r}")
        return f"{type(self.error).__name__}: {self.error}" if self.error else "no answer yet"


class PartitionTest(unittest.TestCase):
    cluster: harness.Cluster
    proxy: PausableProxy

    @classmethod
    def setUpClass(cls):
        cls.proxy = PausableProxy()
        with through_proxy(cls.proxy):
            cls.cluster = harness.Cluster(nodes=1, daemon_flags=DAEMON_FLAGS)
        try:
            cls._start_nodes()
            cls._start_workers()
        except BaseException:
            cls.cluster.close()
            cls.proxy.close()
            raise
        cls.version = 0

    @classmethod
    def _start_nodes(cls):
        c = cls.cluster
        for n in range(1, 4):
            d = harness.Daemon(c, n, c.daemons[0].address, [])
            c.daemons.append(d)
            with through_proxy(cls.proxy) if n == CUT_NODE else contextlib.nullcontext():
                d.start()
        cls.coordinator_address = c.daemons[0].address
        cls.node_address = c.daemons[CUT_NODE].address

    @classmethod
    def _start_workers(cls):
        c = cls.cluster
        cfg = harness.config_path("qwen2.5-7b.json")
        sides = {"trainer": ["--tp", "2", "--gpus-per-node", "2", "--first-node", "1"],
                 "inference": ["--tp", "2", "--dp", "2", "--gpus-per-node", "2", "--first-node", str(CUT_NODE)]}
        cls.workers: Dict[str, dict] = {}  # name -> its layout entry (node, replica)
        cls.reports = Reports(c)
        for side, args in sides.items():
            path = os.path.join(c.dir, f"{side}.json")
            subprocess.run([harness.binary("refit-layout"), "--config", cfg, "--side", side, *args,
                            "--scale-down", "64", "--layers", "2", "-o", path], check=True)
            with open(path) as f:
                for w in json.load(f)["workers"]:
                    cls.workers[w["name"]] = dict(w, role=side)
                    start_python(c, w["name"], int(w["node"]), side, path, w["name"])
        for name in cls.workers:
            cls.reports.wait(name, "registered", timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.cluster.close()
        cls.proxy.close()

    def setUp(self):
        self.ctl = refit.Controller(self.cluster.control, timeout=5.0)
        self.problems: List[str] = []
        self.seen: List[str] = []  # what the case measured, printed with its result

    def tearDown(self):
        self.proxy.cancel_triggers()
        self.proxy.resume()
        self.ctl.close()

    # -- helpers -------------------------------------------------------------------------------

    def engines(self, node: Optional[int] = None) -> List[str]:
        return [n for n, w in self.workers.items()
                if w["role"] == "inference" and (node is None or int(w["node"]) == node)]

    def cut_replica(self) -> str:
        names = {self.workers[n]["replica"] for n in self.engines(CUT_NODE)}
        assert len(names) == 1, names
        return names.pop()

    def check(self, ok: bool, text: str) -> bool:
        if not ok:
            self.problems.append(text)
        return ok

    def finish(self):
        sys.stderr.write(f"\n  [{self._testMethodName}] " + "; ".join(self.seen) + "\n")
        if self.problems:
            tails = "\n".join(f"--- daemon {d.node}:\n{d.tail(40 if d.node == CUT_NODE else 20)}"
                              for d in self.cluster.daemons)
            tails += "".join(f"\n--- {key}'s report:\n" + "\n".join(self.reports.lines(key)[-12:])
                             for key in self.engines(CUT_NODE))
            self.fail("\n  - " + "\n  - ".join(self.problems) + "\n" + tails)

    def status_lies(self) -> List[str]:
        """Replicas that Status shows at a version some engine of theirs does not hold (read after
        Status, so that what an engine learns meanwhile can only make it agree)."""
        group = self.ctl.group(GROUP) or {}
        lies = []
        for r in group.get("replicas", []):
            version = int(r.get("version", 0))
            if not version:
                continue
            for w in r.get("workers", []):
                held = held_version(self.reports.lines(w))
                if held != version:
                    lies.append(f'Status shows replica "{r["name"]}" at version {version}, but {w} holds '
                                f'{held or "no version"} (its last lines: {self.reports.lines(w)[-2:]})')
        return lies

    def watch_status(self, seconds: float, what: str) -> None:
        """Checks Status against the engines every 100 ms for `seconds` (no round running)."""
        deadline = time.monotonic() + seconds
        seen = set()
        while True:
            for lie in self.status_lies():
                if lie not in seen:
                    seen.add(lie)
                    self.problems.append(f"{what}: {lie}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def first_line_time(self, key: str, since: int, prefix: str, timeout: float) -> Optional[float]:
        """When a line starting with `prefix` was first seen in `key`'s report after line `since`."""
        deadline = time.monotonic() + timeout
        while True:
            if any(l.startswith(prefix) for l in self.reports.lines(key)[since:]):
                return time.monotonic()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def verified_round(self, what: str) -> bool:
        """The next round commits with every replica confirmed, every engine checking every byte,
        and Status then shows every replica at that version."""
        try:
            self.ctl.wait_ready(GROUP, timeout=READY_S)
        except refit.RefitError as e:
            return self.check(False, f"{what}: the group is not ready {READY_S:.0f} s after the heal: {e}")
        type(self).version += 1
        v = self.version
        marks = {k: len(self.reports.lines(k)) for k in self.workers}
        try:
            stats = self.ctl.refit(GROUP, v, timeout=60)
        except refit.RefitError as e:
            return self.check(False, f"{what} (version {v}) did not commit: {e}")
        ok = self.check(stats.committed and not stats.proto.unconfirmed_replicas,
                        f"{what} (version {v}): {stats!r}, unconfirmed {list(stats.proto.unconfirmed_replicas)}")
        for key in self.engines():
            if self.first_line_time(key, marks[key], f"commit {v} ", 10) is None:
                ok = self.check(False, f"{what}: {key} never got COMMIT {v}: {self.reports.lines(key)[-3:]}")
                continue
            last = [l for l in self.reports.lines(key)[marks[key]:] if l.startswith(f"commit {v} ")][-1]
            ok = self.check(" ok " in last, f"{what}: {key} did not receive version {v} exactly: {last}") and ok
        replicas = {r["name"]: int(r.get("version", 0)) for r in (self.ctl.group(GROUP) or {}).get("replicas", [])}
        return self.check(replicas and all(x == v for x in replicas.values()),
                          f"{what}: Status shows the replicas at {replicas}, not all at {v}") and ok

    # -- one case ------------------------------------------------------------------------------

    def partition_case(self, kind: str, phase: str) -> None:
        if self.version == 0 or self.status_lies():
            self.assertTrue(self.verified_round("the round before the partition"), "; ".join(self.problems))
        rules = [(self.node_address if whose == "node" else self.coordinator_address, dirs)
                 for whose, dirs in KINDS[kind]]
        type(self).version += 1
        v = self.version
        trigger = self.proxy.pause_on(phase_call(phase, v), Direction.TO_TARGET, target=self.node_address, rules=rules)
        marks = {k: len(self.reports.lines(k)) for k in self.workers}
        call = RoundCall(self.ctl, v)
        if not trigger.fired.wait(20):
            call.join(60)
            self.fail(f"the coordinator's {phase} call to node {CUT_NODE} never passed the proxy: {call.describe()}")
        call.join(ROUND_END_S + 30)
        ended = call.t_end - trigger.fired_at if call.t_end else None
        self.check(ended is not None and ended <= ROUND_END_S,
                   f"the round ended {'%.2f s' % ended if ended is not None else 'not at all'} after the partition "
                   f"(limit {ROUND_END_S:.1f} s): {call.describe()}")
        self.check_outcome(call, phase)
        self.seen.append(f"round {call.describe()}, ended {ended:.2f} s after the partition" if ended is not None
                         else f"round {call.describe()}")
        # While the partition lasts: node 2's prepared engines drop to no version within their
        # lease of the round's end; Status stays truthful.
        t_end = call.t_end or time.monotonic()
        self.check_cut_engines(marks, v, t_end)
        self.watch_status(max(0.0, t_end + HOLD_AFTER_END_S - time.monotonic()),
                          f"during the {kind} partition, after the round")
        self.check_no_split(marks, v)
        # Heal: the held bytes go through (stale requests included), then the next round.
        self.proxy.resume()
        self.watch_status(LEASE_S + 0.5, "after the partition healed")
        self.verified_round("after the partition healed, the next round")
        self.finish()

    def check_outcome(self, call: RoundCall, phase: str) -> None:
        node = f"node {CUT_NODE}"
        if call.result is not None and call.result.committed:
            p = call.result.proto
            self.check(phase == "COMMIT", f"the round COMMITTED though node {CUT_NODE} never got its {phase} call: "
                                          f"{call.describe()}")
            if list(p.unconfirmed_replicas):
                self.check(list(p.unconfirmed_replicas) == [self.cut_replica()],
                           f"unconfirmed replicas {list(p.unconfirmed_replicas)}, not [{self.cut_replica()}]: "
                           f"{call.describe()}")
                self.check(node in p.commit_note, f"the commit note does not name {node}: {p.commit_note!r}")
            else:
                self.check(False, f"the round COMMITTED with every replica confirmed, though node {CUT_NODE} never "
                                  f"got COMMIT: {call.describe()}")
            return
        error = call.error
        self.check(isinstance(error, refit.RefitError) and error.code.name == "ABORTED",
                   f"the round was neither COMMITTED nor ABORTED: {call.describe()}")
        if phase == "COMMIT":
            self.check(False, f"a round past its commit point was not reported COMMITTED: {call.describe()}")
        culprit = getattr(error, "culprit", None)
        self.check(culprit == node, f"the aborted round names {culprit}, not {node}: {call.describe()}")

    def check_cut_engines(self, marks: Dict[str, int], v: int, t_end: float) -> None:
        """Node 2's engines told PREPARE of round v end it (ABORT: no version) within their lease
        of the round's end, unless they were told COMMIT."""
        limit = LEASE_S + SLACK_S
        for key in self.engines(CUT_NODE):
            since = self.reports.lines(key)[marks[key]:]
            if not any(l == f"prepare {v}" for l in since):
                self.seen.append(f"{key}: never prepared")
                continue  # it holds what it held
            if any(l.startswith(f"commit {v} ") for l in since):
                self.seen.append(f"{key}: committed")
                continue
            seen = self.first_line_time(key, marks[key], "abort", max(0.0, t_end + limit - time.monotonic()))
            if seen is not None:
                self.seen.append(f"{key}: ABORT (no version) by {seen - t_end:+.2f} s from the round's end")
            self.check(seen is not None,
                       f"{key} (node {CUT_NODE}) was prepared for version {v} and still holds it paused "
                       f"{limit:.1f} s after the round ended (its lease is {LEASE_S:.1f} s): "
                       f"{self.reports.lines(key)[marks[key]:][-3:]}")

    def check_no_split(self, marks: Dict[str, int], v: int) -> None:
        for key in self.workers:
            since = self.reports.lines(key)[marks[key]:]
            told = {l.split()[0] for l in since if l.startswith((f"commit {v}", "abort"))}
            self.check(len(told) < 2, f"{key} was told both COMMIT and ABORT of version {v}: {since}")


def _add_case(kind: str, phase: str) -> None:
    def case(self):
        self.partition_case(kind, phase)
    case.__name__ = f"test_{kind}_partition_at_{phase.lower()}"
    case.__doc__ = f"A {kind} partition of node {CUT_NODE}, struck by the coordinator's {phase} call."
    setattr(PartitionTest, case.__name__, case)


for _kind in KINDS:
    for _phase in PHASES:
        _add_case(_kind, _phase)


if __name__ == "__main__":
    unittest.main(verbosity=2)
