"""The fault matrix (fault_matrix_test.py) for an fp8 engine: its machinery, on a group whose engine
is block fp8 with blocks cut between the trainers' shards, so that the engine daemon gathers those
blocks' source bytes into the plan's scratch and quantizes them there (docs/PLANNING.md,
"Quantizing on the way").

The group "fp8": Llama-3-8B's structure (widths / 8, 2 layers), block fp8 128x128 from the
config's quantization_config (lm_head kept bf16), an FSDP1 trainer over 8 ranks (flat ranges: 14
cuts, each through blocks that then gather at the engine daemon) on nodes 0 and 1, a vLLM engine
TP1 DP2 on node 3 (the one daemon that gathers: all of the plan's 6 MiB of scratch is there). Its
vocabulary is made large (262144, / 8) so that the bf16 embeddings and lm_head carry most of the
bytes and a transfer lasts long enough to strike inside it, while the fp8 weights, whose check
quantizes them again on the CPU, stay small. Every worker is a sim-worker with --peer-layout: every
round carries new values, and every engine checks every fp8 code and scale against the CPU
reference quantizing each weight whole, at every COMMIT (no --same-data shortcut).

The cases go through FaultMatrixBase.matrix_case: the round ends within its bound, ABORTED, with
the culprit named and no innocent named; every surviving worker told ABORT or COMMIT, never both;
no engine holding a version it did not fully receive; every daemon but a killed one still running;
the killed process restarted and the next round committed at full speed and checked. The faults:
kill -9 of a trainer and of an engine worker during PREPARE (a sim-worker slow by
--prepare-delay-ms, struck inside it) and TRANSFER, kill -9 and SIGSTOP of the engine daemon during
TRANSFER, kill -9 of the coordinator during TRANSFER (last: it needs a new cluster). And the scratch:
rounds aborted mid-TRANSFER one after another, each re-resolving the engine daemon's buffers (an
engine restarted), leave no scratch behind (RssAnon, with glibc unmapping what is freed); with
glibc's defaults too (the host scratch is mapped memory, unmapped when the plan's buffers go).

Run alone (deadlines of seconds on 2 cores): bazel test //tests/integration:fp8_fault_matrix_test,
or with the binaries built: python3 tests/integration/fp8_fault_matrix_test.py [-k PATTERN], with
PYTHONPATH=client/python/tests:client/python:tests/integration.
"""
import fnmatch
import json
import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_matrix_test as fm  # noqa: E402
from fault_matrix_test import harness, refit  # noqa: E402

GROUP = "fp8"
BLOCK = 128
# Widths / 8, 2 layers; a vocabulary that makes the (bf16) embeddings and lm_head most of the bytes,
# so that a transfer lasts long enough to strike inside it (with the matrix's 4 KiB messages), while
# the fp8 weights, whose check quantizes them on the CPU, stay small.
SCALE, LAYERS, VOCAB = 8, 2, 262144
SIDES = [("trainer", ["--fsdp", "8", "--gpus-per-node", "4"]),
         ("inference", ["--tp", "1", "--dp", "2", "--gpus-per-node", "4", "--first-node", str(fm.NODE),
                        "--dtype", "fp8-block"])]
TRAINER = "fsdp-rank5"    # node 1
ENGINE = "vllm-dp1-tp0"   # node 3, the gathering daemon's
ABORTS = 6                # rounds aborted in a row by the scratch cases
# glibc with its mmap threshold pinned (no dynamic threshold): every allocation of 128 KiB or more
# is a mapping of its own, unmapped when freed, so RssAnon counts the memory the daemon holds,
# not what glibc keeps of what it freed.
PINNED_MALLOC = "glibc.malloc.mmap_threshold=131072"


def rss_anon(pid):
    """(RssAnon, Threads) of a process, from /proc: bytes and a count."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            fields[k] = v.split()
    return int(fields["RssAnon"][0]) * 1024, int(fields["Threads"][0])


# Found by these cases, and fixed: the host backend's scratch, a heap vector, stayed in glibc's
# arenas once freed (now mapped and unmapped: test_fp8_scratch_rss_bounded_with_default_malloc);
# a killed receiver was blamed on the sending node whose data plane noticed it first (the data
# plane's failures to reach a peer now name that peer: test_fp8_kill_daemon_in_transfer).


class Fp8Worker(fm.W):
    """A sim-worker checking fp8 against the CPU reference (--peer-layout). It is slow in PREPARE
    only by flag (--prepare-delay-ms): set_delay restarts a running worker whose delay differs."""

    def __init__(self, fleet, group, role, name, node, layout, peer):
        super().__init__(fleet, group, role, name, node, "cpp", layout)
        self.peer = peer
        self.delay_ms = self.running_delay_ms = 0

    def start(self, *extra):
        c = self.fleet.cluster
        args = [harness.binary("sim-worker"), "--daemon", c.daemons[self.node].worker_address, "--group", self.group,
                "--role", self.role, "--layout", self.layout, "--worker", self.name, "--report", self.report,
                "--peer-layout", self.peer]
        if self.delay_ms:
            args += ["--prepare-delay-ms", str(self.delay_ms)]
        self.running_delay_ms = self.delay_ms
        mark = len(self.lines())
        self.proc = c.spawn(args + list(extra), self.key)
        return mark

    def set_delay(self, prepare=0.0, commit=0.0):
        assert not commit, "sim-worker has no delay in COMMIT"
        self.delay_ms = int(prepare * 1000)
        if self.alive() and self.running_delay_ms != self.delay_ms:
            self.kill()
            mark = self.start()
            self.fleet.dirty[self.group] = True
            self.fleet.wait_line(self, lambda l: l.startswith("registered"), 20, mark, "registration")
            self.fleet.wait_ready(self.group)


class Fp8Fleet(fm.Fleet):
    """The matrix's four daemons (node 0 coordinates, node 3 is the victim daemon) with the one fp8
    group (see the module's docstring)."""

    def _start(self):
        self.version, self.dirty = {}, {}
        self.coordinator_restarted = False
        self.transfer_s = {}
        self.timed_groups = (GROUP,)
        self.workers = {}
        d = self.cluster.dir
        with open(harness.config_path("llama3-8b.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
                                      "modules_to_not_convert": ["lm_head"]}
        cfg["vocab_size"] = VOCAB
        cfg_path = self.cluster.write_json("llama-fp8.json", cfg)
        paths = {side: os.path.join(d, f"{GROUP}-{side}.json") for side, _ in SIDES}
        for side, args in SIDES:
            subprocess.run([harness.binary("refit-layout"), "--config", cfg_path, "--side", side, *args,
                            "--scale-down", str(SCALE), "--layers", str(LAYERS), "-o", paths[side]], check=True)
        # The plan must gather: blocks cut between the FSDP ranks go through the engine daemon's scratch.
        out = subprocess.run([harness.binary("refit-plan"), "--src", paths["trainer"], "--dst", paths["inference"],
                              "--json"], check=True, capture_output=True, text=True).stdout
        summary = json.loads(out)
        self.scratch_bytes = int(summary.get("scratch_bytes", 0))
        if not (self.scratch_bytes > 0 and int(summary.get("bytes_gathered", 0)) > 0):
            raise AssertionError(f"the fp8 plan gathers nothing into scratch: {summary}")
        added = []
        for side, _ in SIDES:
            peer = paths["inference" if side == "trainer" else "trainer"]
            with open(paths[side]) as fh:
                for w in json.load(fh)["workers"]:
                    wk = Fp8Worker(self, GROUP, side, w["name"], int(w.get("node", 0)), paths[side], peer)
                    self.workers[wk.key] = wk
                    added.append(wk)
        self.version[GROUP], self.dirty[GROUP] = 0, True
        marks = {w.key: w.start() for w in added}
        for w in added:
            self.wait_line(w, lambda l: l.startswith("registered"), 30, marks[w.key], "registration")

    def wait_ready(self, group, timeout=fm.READY_S):
        want = {w.id for w in self.group(group)}
        ctl = self.controller()
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    if {w["worker_id"] for w in ctl.workers(group)} >= want and (ctl.group(group) or {}).get("ready"):
                        return
                except refit.RefitError:
                    pass
                time.sleep(0.1)
        finally:
            ctl.close()
        raise AssertionError(f"{group} not ready {timeout:.0f} s after a worker's restart")


class Fp8FaultMatrix(fm.FaultMatrixBase):
    fleet_type = Fp8Fleet
    trainer_victim, engine_victim = TRAINER, ENGINE

    def wait_inside(self, group, slow, phase, v, marks, rnd):
        """sim-worker reports "preparing v" when PREPARE arrives, before its delay, and "prepare v"
        once it confirmed: `slow` is in its delay from the first line until the second."""
        assert phase == "PREPARE", phase
        deadline = time.monotonic() + 20
        while not any(l == f"preparing {v}" for l in slow.lines()[marks[slow.key]:]):
            if time.monotonic() > deadline:
                self.fail(f"round {v} never reached PREPARE: {rnd.describe()}\n{self.f.cluster.logs()}")
            time.sleep(0.02)
        time.sleep(fm.STRIKE_AFTER_S)  # the fault strikes this far into the delay, on purpose
        early = [l for l in slow.lines()[marks[slow.key]:] if l == f"prepare {v}"]
        if early:
            self.fail(f"{slow.key} confirmed PREPARE of round {v} before the strike (its delay did not hold)")

    def engine_daemon_malloc(self, tunables):
        """Restarts the engine daemon (node 3) with $GLIBC_TUNABLES `tunables` (None: glibc's
        defaults) unless it already runs so; its workers register again, and a checked round
        follows."""
        f = self.f
        d = f.daemon(fm.NODE)
        if getattr(d, "glibc_tunables", None) == tunables and d.proc.poll() is None:
            return
        d.stop()
        saved = os.environ.pop("GLIBC_TUNABLES", None)
        try:
            if tunables:
                os.environ["GLIBC_TUNABLES"] = tunables
            d.start()
        finally:
            os.environ.pop("GLIBC_TUNABLES", None)
            if saved is not None:
                os.environ["GLIBC_TUNABLES"] = saved
        d.glibc_tunables = tunables
        for other in f.version:
            f.dirty[other] = True
        self.reregister_or_restart()
        self.recovery_round(GROUP, "after the engine daemon's restart, the next round", full_speed=False)

    def scratch_case(self, bound_bytes, what, rounds=ABORTS):
        """Rounds aborted mid-TRANSFER, one after another (an engine of the gathering node killed and
        restarted at once: a new membership, so the engine daemon resolves its buffers and allocates
        the plan's scratch again), each followed by a checked round: each aborts naming the engine,
        none tells an engine COMMIT, the engine daemon keeps running, and its RssAnon after the last
        never (after any of them) more than `bound_bytes` above what it was before the first."""
        f = self.f
        w = f.worker(GROUP, ENGINE)
        daemon = f.daemon(fm.NODE)
        pid = daemon.proc.pid
        engines = [e for e in f.group(GROUP) if e.engine]
        samples = [rss_anon(pid)]
        for attempt in range(1, rounds + 1):
            v = f.next_version(GROUP)
            marks = {e.key: len(e.lines()) for e in engines}
            watch = fm.Watch(f.cluster.control, GROUP)
            rnd = fm.Round(self.ctl, GROUP, v)
            t_seen, _ = watch.wait(v, "TRANSFERRING", 20)
            watch.close()
            if t_seen is None:
                self.fail(f"attempt {attempt}: round {v} never reached TRANSFER (the watch saw "
                          f"{watch.seen(v) or 'nothing of it'}): {rnd.describe()}")
            time.sleep(0.03)  # the kill lands early in TRANSFER, on purpose
            t_strike = time.monotonic()
            w.proc.kill()
            w.proc.wait(timeout=10)
            mark = w.start()  # at once
            rnd.join(fm.bound("TRANSFER") + 30)
            ended = (rnd.t_end - t_strike) if rnd.t_end else None
            self.check(rnd.state == "ABORTED" and ended is not None and ended <= fm.bound("TRANSFER"),
                       f"attempt {attempt}: the round ended {ended} s after the kill: {rnd.describe()}")
            if rnd.error is not None:
                self.check(rnd.error.culprit == f'worker "{w.id}"',
                           f"attempt {attempt}: culprit {rnd.error.culprit}: {rnd.error.reason}")
            for e in engines:
                told = [l for l in e.lines()[marks[e.key]:] if l.startswith(f"commit {v} ")]
                self.check(not told, f"attempt {attempt}: {e.key} was told COMMIT of aborted version {v}: {told}")
            f.wait_line(w, lambda l: l.startswith("registered"), 20, mark, "registration")
            self.recovery_round(GROUP, f"attempt {attempt}: the round after the engine came back")
            if not self.check(daemon.proc.pid == pid and daemon.proc.poll() is None,
                              f"attempt {attempt}: the engine daemon exited: {daemon.tail(5)}"):
                break
            samples.append(rss_anon(pid))
        if len(samples) == rounds + 1:
            mib = [round(s[0] / 2**20, 2) for s in samples]
            growth = max(s[0] for s in samples) - samples[0][0]
            sys.stderr.write(f"[{what}: engine daemon RssAnon before and after each aborted round: {mib} MiB, threads "
                             f"{[s[1] for s in samples]}; the plan's scratch {f.scratch_bytes / 2**20:.2f} MiB] ")
            self.check(growth <= bound_bytes,
                       f"{what}: the engine daemon's RssAnon grew by up to {growth / 2**20:.2f} MiB over {rounds} rounds "
                       f"aborted mid-TRANSFER (bound {bound_bytes / 2**20:.2f} MiB; the plan's scratch "
                       f"{f.scratch_bytes / 2**20:.2f} MiB); before and after each: {mib} MiB")
        self.finish()

    def test_fp8_scratch_not_kept_by_aborted_rounds(self):
        """No aborted round keeps its scratch: with glibc unmapping what is freed (PINNED_MALLOC),
        the engine daemon's RssAnon during 6 aborted rounds (6 scratch allocations) stays within one
        plan's scratch of where it started (a scratch kept per round: 6 of them)."""
        self.engine_daemon_malloc(PINNED_MALLOC)
        self.scratch_case(self.f.scratch_bytes, "glibc's mmap threshold pinned")

    def test_fp8_scratch_rss_bounded_with_default_malloc(self):
        """Twelve such rounds with glibc's defaults: the engine daemon's RssAnon never grows by more
        than two plans' scratch."""
        self.engine_daemon_malloc(None)
        self.scratch_case(2 * self.f.scratch_bytes, "glibc's defaults", rounds=12)


# (fault, target, phase) -> what fails today ("": passes; a text: skipped with that reason).
MATRIX = {
    ("kill", "trainer", "PREPARE"): "",
    ("kill", "engine", "PREPARE"): "",
    ("kill", "trainer", "TRANSFER"): "",
    ("kill", "engine", "TRANSFER"): "",
    ("kill", "daemon", "TRANSFER"): "",
    ("stop", "daemon", "TRANSFER"): "",
    ("kill", "coordinator", "TRANSFER"): "",  # last: the cluster is new after it
}


def _add_case(fault, target, phase, skip):
    def case(self):
        self.matrix_case(fault, target, phase, group=GROUP)
    case.__name__ = f"test_fp8_{fault}_{target}_in_{phase.lower()}"
    case.__doc__ = f"{fault} the {target} during {phase}, in the fp8 group."
    if skip:
        case = unittest.skip(skip)(case)
    setattr(Fp8FaultMatrix, case.__name__, case)


for (_fault, _target, _phase), _skip in MATRIX.items():
    _add_case(_fault, _target, _phase, _skip)

ORDER = [f"test_fp8_{fa}_{ta}_in_{ph.lower()}" for (fa, ta, ph) in MATRIX if ta != "coordinator"]
ORDER += ["test_fp8_scratch_rss_bounded_with_default_malloc", "test_fp8_scratch_not_kept_by_aborted_rounds"]
ORDER += [f"test_fp8_{fa}_{ta}_in_{ph.lower()}" for (fa, ta, ph) in MATRIX if ta == "coordinator"]
assert sorted(ORDER) == sorted(n for n in dir(Fp8FaultMatrix) if n.startswith("test_")), "every case runs once"


def load_tests(loader, tests, pattern):
    suite = unittest.TestSuite()
    wanted = getattr(loader, "testNamePatterns", None)  # -k
    for name in ORDER:
        full = f"{Fp8FaultMatrix.__module__}.Fp8FaultMatrix.{name}"
        if not wanted or any(fnmatch.fnmatchcase(full, p) for p in wanted):
            suite.addTest(Fp8FaultMatrix(name))
    return suite


if __name__ == "__main__":
    unittest.main(verbosity=2)
