"""Metrics as Prometheus itself sees them. Two real daemons on loopback (host backend)
serve /metrics (--metrics-listen); Python pattern workers (a trainer on node 0, an engine on node
1) go through ROUNDS committed rounds and one refused call; Debian's real `prometheus` server,
on a free loopback port with its own storage, scrapes both daemons every second; the test asks
Prometheus' HTTP query API (/api/v1/query) that the rounds moved the counters and histograms
they should, on the node that should have them.

Needs /usr/bin/prometheus (Debian's prometheus package, installed by tools/setup.sh): without it
the test fails, saying so.

Run: bazel test //tests/integration:metrics_test, or with the binaries built:
PYTHONPATH=client/python/tests:client/python /usr/bin/python3 tests/integration/metrics_test.py
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import unittest
import urllib.parse
import urllib.request

import grpc

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402
from e2e_lib import Reports, layouts, names, start_python  # noqa: E402

ROUNDS = 3


def prometheus_binary():
    return shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_address(daemon):
    """Where the daemon serves /metrics (it was given port 0): the address its start-up line names."""
    found = []

    def logged():
        with open(daemon.log, errors="replace") as f:
            m = re.search(r"metrics at http://(\S+)/metrics", f.read())
        if m:
            found.append(m.group(1))
        return bool(found)

    harness.wait_for(logged, 10, f"daemon {daemon.node} to log its metrics address")
    return found[0]


class Prometheus:
    """Debian's prometheus on loopback, scraping `targets` ({node: "host:port"}) every second."""

    def __init__(self, binary, targets, workdir):
        self.port = free_port()
        config = os.path.join(workdir, "prometheus.yml")
        scrape = {
            "job_name": "refitd",
            "scrape_interval": "1s",
            "scrape_timeout": "900ms",
            "static_configs": [{"targets": [addr], "labels": {"node": str(node)}} for node, addr in targets.items()],
        }
        with open(config, "w") as f:  # JSON is YAML
            json.dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                       "scrape_configs": [scrape]}, f)
        self.log = os.path.join(workdir, "prometheus.log")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT)
        harness.wait_for(self.ready, 30, f"prometheus to be ready: {self.tail()}")

    def ready(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, q):
        """The instant vector of `q`: [(labels, value)]."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise AssertionError(f"{q}: {body}")
        return [(s["metric"], float(s["value"][1])) for s in body["data"]["result"]]

    def tail(self, n=20):
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class MetricsThroughPrometheus(unittest.TestCase):
    def setUp(self):
        self.binary = prometheus_binary()
        if self.binary is None:
            self.fail("Debian's `prometheus` server is not installed: run tools/setup.sh (it installs prometheus "
                      "and prometheus-cpp-dev)")
        self.cluster = harness.Cluster(nodes=2, daemon_flags=["--metrics-listen", "127.0.0.1:0"])
        self.prometheus = None
        self.ctl = refit.Controller(self.cluster.control)

    def tearDown(self):
        self.ctl.close()
        if self.prometheus is not None:
            self.prometheus.stop()
        self.cluster.close()

    def eventually(self, q, check, what, timeout=30):
        """Polls Prometheus until `check(result)` holds; fails with the last answer otherwise."""
        deadline = time.monotonic() + timeout
        result = None
        while time.monotonic() < deadline:
            result = self.prometheus.query(q)
            if check(result):
                return result
            time.sleep(0.5)  # the poll interval: Prometheus scrapes once a second
        self.fail(f"{what}: Prometheus answered {q} with {result}\n{self.prometheus.tail()}\n{self.cluster.logs()}")

    def value_is(self, q, expected, what):
        self.eventually(q, lambda r: len(r) == 1 and r[0][1] == expected, f"{what}: expected {expected}")

    def positive(self, q, what):
        self.eventually(q, lambda r: len(r) == 1 and r[0][1] > 0, f"{what}: expected > 0")

    def test_rounds_move_counters_and_histograms(self):
        files = layouts(self.cluster)
        reports = Reports(self.cluster)
        keys = []
        trainers, engines = names(files["trainer"]), names(files["inference"])
        for w in trainers:
            start_python(self.cluster, f"t-{w}", 0, "trainer", files["trainer"], w)
            keys.append(f"t-{w}")
        for w in engines:
            start_python(self.cluster, f"e-{w}", 1, "inference", files["inference"], w)
            keys.append(f"e-{w}")
        for k in keys:
            reports.wait(k, "registered")
        self.ctl.wait_ready("policy", timeout=20)
        for v in range(1, ROUNDS + 1):
            self.assertTrue(self.ctl.refit("policy", v, timeout=60).committed)
        # A refused call: a version already committed (FAILED_PRECONDITION, through ToGrpc).
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("policy", 1, timeout=30)
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)

        targets = {d.node: metrics_address(d) for d in self.cluster.daemons}
        self.prometheus = Prometheus(self.binary, targets, self.cluster.dir)
        p = 'job="refitd"'
        for node in targets:
            self.value_is(f'up{{{p},node="{node}"}}', 1, f"node {node} scraped")

        # Rounds: the coordinator's (node 0), fed by its RoundLog.
        c = f'{p},node="0",group="policy"'
        self.value_is(f'refit_rounds_total{{{c},outcome="committed"}}', ROUNDS, "committed rounds")
        self.assertEqual(self.prometheus.query(f'refit_rounds_total{{{c},outcome="aborted"}}'), [],
                         "no round aborted (the refused call began none)")
        self.value_is(f'refit_round_duration_seconds_count{{{c},outcome="committed"}}', ROUNDS,
                      "round duration histogram count")
        self.value_is(f'refit_round_duration_seconds_bucket{{{c},outcome="committed",le="+Inf"}}', ROUNDS,
                      "round duration histogram +Inf bucket")
        self.positive(f'refit_round_duration_seconds_sum{{{c},outcome="committed"}}', "round duration sum")
        self.positive(f'histogram_quantile(0.5, refit_round_duration_seconds_bucket{{{c},outcome="committed"}})',
                      "median round duration from the buckets")
        for phase in ("prepare", "transfer", "commit"):
            self.value_is(f'refit_round_phase_duration_seconds_count{{{c},phase="{phase}"}}', ROUNDS,
                          f"{phase} phase histogram count")
        self.positive(f'refit_round_bytes_total{{{c},outcome="committed"}}', "bytes the rounds moved")
        self.assertEqual(self.prometheus.query(f'refit_rounds_total{{{p},node="1"}}'), [],
                         "rounds are counted by the coordinator only")

        # Each node's transfers, through its backend: one per round on both nodes; the trainer's
        # node sends over the network, the engine's node receives.
        for node in targets:
            n = f'{p},node="{node}",group="policy"'
            self.value_is(f'refit_transfers_total{{{n},outcome="ok"}}', ROUNDS, f"node {node}'s transfers")
            self.value_is(f'refit_transfer_duration_seconds_count{{{n}}}', ROUNDS, f"node {node}'s data-plane time count")
            self.positive(f'refit_transfer_wire_bytes_per_second{{{n}}}', f"node {node}'s wire rate")
        self.positive(f'refit_transfer_bytes_total{{{p},node="0",link="network",direction="sent"}}',
                      "bytes node 0 sent")
        self.positive(f'refit_transfer_bytes_total{{{p},node="1",link="network",direction="received"}}',
                      "bytes node 1 received")
        # The coordinator's bytes of a round are what the nodes received plus what they copied
        # locally (RoundStats.bytes): the nodes' own counters add up to the same.
        self.eventually(f'sum(refit_transfer_bytes_total{{{p},direction=~"received|copied"}}) - '
                        f'sum(refit_round_bytes_total{{{c},outcome="committed"}})',
                        lambda r: [v for _, v in r] == [0], "the nodes' bytes add up to the rounds' bytes")

        # Read at scrape time from the coordinator's membership and planner.
        self.value_is(f'refit_workers{{{c},role="trainer"}}', len(trainers), "trainers")
        self.value_is(f'refit_workers{{{c},role="inference"}}', len(engines), "inference workers")
        self.value_is(f'refit_group_ready{{{c}}}', 1, "group ready")
        plan = self.prometheus.query(f'refit_group_plan_epoch{{{c}}} - refit_group_membership_epoch{{{c}}}')
        self.assertEqual([v for _, v in plan], [0], "the plan is of the current epoch")
        self.positive(f'refit_plannings_total{{{p},node="0"}}', "plannings")
        self.positive(f'refit_group_planning_seconds{{{c}}}', "planning time")

        # Errors and failures.
        self.eventually(f'refit_rpc_errors_total{{{p},node="0",code="FAILED_PRECONDITION"}}',
                        lambda r: len(r) == 1 and r[0][1] >= 1, "the refused call counted by code")
        self.value_is(f'refit_nodes_declared_dead_total{{{p},node="0"}}', 0, "no node declared dead")


if __name__ == "__main__":
    unittest.main(verbosity=2)
