"""Helpers of the end-to-end tests: small real-model layouts from refit-layout, worker processes
(pattern_worker.py, sim-worker) started against a harness.Cluster, and their report files."""
import json
import os
import re
import subprocess
import sys

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402

WORKER = os.path.join(harness.HERE, "pattern_worker.py")
PYTHONPATH = os.path.dirname(os.path.dirname(os.path.abspath(refit.__file__)))


def layouts(cluster, tp_trainer=2, tp_engine=2):
    """A small Qwen2.5 (its structure: GQA, biases, tied embeddings off; widths / 64, 2 layers):
    a Megatron trainer on node 0, a vLLM engine on node 1."""
    cfg = harness.config_path("qwen2.5-7b.json")
    out = {}
    for side, tp, node in [("trainer", tp_trainer, 0), ("inference", tp_engine, 1)]:
        path = os.path.join(cluster.dir, f"{side}.json")
        subprocess.run([harness.binary("refit-layout"), "--config", cfg, "--side", side, "--tp", str(tp),
                        "--first-node", str(node), "--scale-down", "64", "--layers", "2", "-o", path],
                       check=True)
        out[side] = path
    return out


def names(path):
    with open(path) as f:
        return [w["name"] for w in json.load(f)["workers"]]


class Reports:
    def __init__(self, cluster):
        self.cluster = cluster

    def path(self, key):
        return os.path.join(self.cluster.dir, f"{key}.report")

    def lines(self, key):
        try:
            with open(self.path(key)) as f:
                return f.read().splitlines()
        except OSError:
            return []

    def wait(self, key, prefix, timeout=20):
        harness.wait_for(lambda: any(l.startswith(prefix) for l in self.lines(key)), timeout,
                         f"{key} to report {prefix!r}: {self.lines(key)[-3:]}\n{self.cluster.logs()}")


def start_python(cluster, key, node, role, layout, worker, *extra):
    env_args = [sys.executable, WORKER, "--daemon", cluster.daemons[node].worker_address, "--role", role,
                "--layout", layout, "--worker", worker, "--report", os.path.join(cluster.dir, f"{key}.report"), *extra]
    os.environ["PYTHONPATH"] = PYTHONPATH + os.pathsep + os.environ.get("PYTHONPATH", "")
    return cluster.spawn(env_args, key)


def start_sim(cluster, key, node, role, layout, worker):
    return cluster.spawn([harness.binary("sim-worker"), "--daemon", cluster.daemons[node].worker_address,
                          "--group", "policy", "--role", role, "--layout", layout, "--worker", worker,
                          "--report", os.path.join(cluster.dir, f"{key}.report")], key)


def start_policy_workers(cluster, reports, files):
    """Starts a pattern worker for every worker of `files` (layouts()): the trainers on node 0, the
    engines on node 1, each waited for until it reports "registered". Returns the engines' report
    keys."""
    engines = []
    for role, node in [("trainer", 0), ("inference", 1)]:
        for w in names(files[role]):
            key = f"{role}-{w}"
            start_python(cluster, key, node, role, files[role], w)
            reports.wait(key, "registered")
            if role == "inference":
                engines.append(key)
    return engines


def commit_checked(test, ctl, reports, engines, version):
    """Refits group "policy" to `version` and asserts that the round committed and that every
    engine of `engines` (report keys) checked every byte of it ("commit V ok ...")."""
    stats = ctl.refit("policy", version, timeout=60)
    test.assertTrue(stats.committed, stats)
    for key in engines:
        reports.wait(key, f"commit {version} ")
        last = [l for l in reports.lines(key) if l.startswith(f"commit {version} ")][-1]
        test.assertIn(" ok ", last, f"{key}: {last}")


def data_address(daemon):
    """The host data plane's address a harness.Daemon logged; None if it logged none."""
    with open(daemon.log, errors="replace") as f:
        found = re.findall(r"data plane (\S+) \(host\)", f.read())
    return found[-1] if found else None
