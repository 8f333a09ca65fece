#!/usr/bin/python3
"""Scale harness: N refitd daemons on loopback (node 0 coordinates), about half of them "training
nodes" and half "inference nodes", each holding sim-worker processes of a model's layouts (the
full tensor and piece structure of DeepSeek-V3 or Kimi-K2, widths divided so that the bytes fit one
machine). Per N it measures, as one JSON object:

- setup: daemons started and joined, workers registered; seconds from the last registration to the
  group being ready (refitctl status: ready, every replica complete) and to the first committed
  round; each node's plan install (its "installed a plan" log line against the round's start) and
  its CPU over the first round (/proc/PID/stat utime + stime); the coordinator's CPU and RSS;
- rounds: K rounds after the first (RoundStats from `refitctl -o json refit`: prepare, transfer,
  commit seconds), every inference sim-worker checking every byte (its report: "commit V ok");
  every daemon's RSS before and after them (growth);
- faults (an inference node, the last by default): SIGSTOP and SIGKILL of its daemon inside PREPARE
  (one of its workers restarted with --prepare-delay-ms so that PREPARE lasts): seconds from the
  signal to the round ending ABORTED, and whether RoundStats.culprit names that node; after the
  kill, the daemon restarted on its address with fresh workers: seconds to ready again and to the
  next committed round.

    bazel build //daemon:refitd //client/tools:refitctl //client/tools:refit-layout //tests/workers:sim-worker
    /usr/bin/python3 tests/scale/scale_bench.py --nodes 4,8,16 --model small --rounds 5 --out /tmp/scale.json
    /usr/bin/python3 tests/scale/plot_scale.py /tmp/scale.json --out-dir docs/img

Binaries: --bin DIR, else $REFIT_BIN_DIR, Bazel's runfiles ($TEST_SRCDIR) or bazel-bin; they are
copied to a private folder first, so that a rebuild meanwhile does not change them under a run.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
BINARIES = {
    "refitd": "daemon/refitd",
    "refitctl": "client/tools/refitctl",
    "refit-layout": "client/tools/refit-layout",
    "sim-worker": "tests/workers/sim-worker",
}
# --model: a config of tests/configs, its width divisor and layers kept (0: all).
MODELS = {
    "deepseek-v3": {"config": "deepseek-v3.json", "scale_down": 64, "layers": 0},
    "kimi-k2": {"config": "kimi-k2.json", "scale_down": 64, "layers": 0},
    # CI: Qwen3-30B-A3B's structure (128 experts, GQA) on 2 layers, widths / 32.
    "small": {"config": "qwen3-30b-a3b.json", "scale_down": 32, "layers": 2},
}
GROUP = "policy"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


class HarnessError(Exception):
    pass


def log(msg):
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Binaries, configs


def find_binary(name, bin_dir):
    rel = BINARIES[name]
    if bin_dir:
        # A flat folder, or a Bazel output tree (bazel-bin, or --symlink_prefix's DIR-bin). Never
        # anything else: falling back to the workspace's bazel-bin would measure other binaries
        # (the shared fastbuild ones) than the ones asked for.
        cands = [os.path.join(bin_dir, os.path.basename(rel)), os.path.join(bin_dir, rel)]
        for c in cands:
            if os.path.exists(c):
                return c
        raise HarnessError(f"--bin {bin_dir}: no {name} (tried {cands})")
    cands = []
    if os.environ.get("REFIT_BIN_DIR"):
        cands.append(os.path.join(os.environ["REFIT_BIN_DIR"], os.path.basename(rel)))
    if os.environ.get("TEST_SRCDIR"):
        cands.append(os.path.join(os.environ["TEST_SRCDIR"], "refit", rel))
    cands.append(os.path.join(REPO, "bazel-bin", rel))
    for c in cands:
        if os.path.exists(c):
            return c
    raise HarnessError(f"{name} not found (tried {cands}); bazel build //{os.path.dirname(rel)}:{os.path.basename(rel)}")


def find_config(name):
    if os.path.exists(name):
        return os.path.abspath(name)
    for base in [os.path.join(os.environ.get("TEST_SRCDIR", ""), "refit"), REPO]:
        p = os.path.join(base, "tests", "configs", name)
        if os.path.exists(p):
            return p
    raise HarnessError(f"config {name} not found")


# ---------------------------------------------------------------------------------------------
# /proc


def proc_cpu_s(pid):
    """utime + stime of a process, seconds (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def proc_rss_mb(pid):
    """(RSS, its anonymous part: heap and stacks, without the workers' shared memory the daemon
    maps), MiB."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssShmem"):
                    out[k] = int(v.split()[0]) / 1024
    except (OSError, IndexError, ValueError):
        return None, None
    return out.get("VmRSS"), out.get("RssAnon")


def host_busy_jiffies():
    """(busy, total) jiffies of the whole machine since boot (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


def load_average():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def mx(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def rnd(x, n=4):
    return None if x is None else round(x, n)


LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z\]")


def log_time(line):
    m = LOG_TIME.match(line)
    if not m:
        return None
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f").replace(
        tzinfo=datetime.timezone.utc).timestamp()


# ---------------------------------------------------------------------------------------------
# Processes


class Daemon:
    def __init__(self, run, node):
        self.run, self.node = run, node
        self.proc = None
        self.address = None
        self.listen = "127.0.0.1:0"
        self.data_listen = "127.0.0.1:0"
        self.socket = os.path.join(run.sock_dir, f"d{node}.sock")
        self.log = os.path.join(run.dir, f"daemon{node}.log")
        self.addr_file = os.path.join(run.dir, f"daemon{node}.addr")

    def start(self):
        if os.path.exists(self.addr_file):
            os.unlink(self.addr_file)
        a = self.run.args
        cmd = [self.run.bins["refitd"], "--node", str(self.node), "--listen", self.listen,
               "--data-listen", self.data_listen, "--worker-socket", self.socket,
               "--address-file", self.addr_file, "--heartbeat", str(a.heartbeat),
               "--heartbeats-missed", str(a.heartbeats_missed),
               "--prepare-timeout", str(a.prepare_timeout), "--transfer-timeout", str(a.transfer_timeout),
               "--commit-timeout", str(a.commit_timeout), "--peer-timeout", str(a.peer_timeout),
               "--join-timeout", "0", "--state-file", os.path.join(self.run.dir, f"state{self.node}")]
        if self.node != 0:
            cmd += ["--coordinator", self.run.daemons[0].address]
        cmd += a.daemon_flag
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        self.started = time.time()
        return self

    def wait_address(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(self.addr_file) and os.path.getsize(self.addr_file) > 0:
                with open(self.addr_file) as f:
                    self.address = f.read().split()[0]
                self.listen = self.address  # a restart keeps the address, as systemd's would
                return self.address
            if self.proc.poll() is not None:
                raise HarnessError(f"refitd {self.node} exited {self.proc.returncode}: {self.tail()}")
            time.sleep(0.05)
        raise HarnessError(f"refitd {self.node} did not serve within {timeout} s: {self.tail()}")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self):
        return self.proc.pid

    def tail(self, n=8):
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def lines(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read().splitlines()
        except OSError:
            return []

    def stop(self):
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Worker:
    def __init__(self, run, name, node, role, layout):
        self.run, self.name, self.node, self.role, self.layout = run, name, node, role, layout
        self.report = os.path.join(run.dir, "reports", f"{name}.report")
        self.log = os.path.join(run.dir, "reports", f"{name}.log")
        self.proc = None

    def start(self, *extra):
        """Starts the process; returns how many report lines came before it."""
        self.extra = extra
        mark = len(self.lines())
        d = self.run.daemons[self.node]
        cmd = [self.run.bins["sim-worker"], "--daemon", "unix:" + d.socket, "--group", GROUP,
               "--role", self.role, "--layout", self.layout, "--worker", self.name, "--report", self.report,
               "--same-data", "--register-timeout", str(self.run.args.register_timeout), *extra]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        self.mark = mark
        return mark

    def lines(self):
        try:
            with open(self.report) as f:
                return f.read().splitlines()
        except OSError:
            return []

    def registered_at(self):
        """Wall time of its registration since the last start (the report's mtime when its last
        line is the registration), or None."""
        lines = self.lines()[self.mark:]
        if not any(l.startswith("registered") for l in lines):
            return None
        return os.path.getmtime(self.report) if lines and lines[-1].startswith("registered") else time.time()

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self):
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass

    def tail(self, n=3):
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


# ---------------------------------------------------------------------------------------------
# Layouts


def pick_parallelism(model_cfg, args, t_nodes, i_nodes):
    """Trainer Megatron (tp, pp, ep, dp) over t_nodes * G ranks; engine vLLM (tp, dp, ep) over
    i_nodes * G ranks. Flags override."""
    g = args.gpus_per_node
    layers = model_cfg["layers"]
    experts = model_cfg["experts"]
    tr = t_nodes * g
    tp = args.trainer_tp or 1
    if tr % tp:
        raise HarnessError(f"trainer tp {tp} does not divide {tr} ranks")
    pp = args.trainer_pp
    if not pp:
        pp = 1
        for c in (8, 4, 2):
            if (tr // tp) % c == 0 and c <= layers:
                pp = c
                break
    dp = tr // (tp * pp)
    if dp * tp * pp != tr:
        raise HarnessError(f"trainer tp {tp} x pp {pp} does not divide {tr} ranks")
    ep = args.trainer_ep
    if not ep:
        ep = 1
        if experts:
            for c in (64, 32, 16, 8, 4, 2):
                if dp % c == 0 and experts % c == 0:
                    ep = c
                    break
    ir = i_nodes * g
    etp = args.engine_tp or g
    if ir % etp:
        raise HarnessError(f"engine tp {etp} does not divide {ir} ranks")
    edp = ir // etp
    # vLLM's FusedMoE splits the experts' width over dp * tp ranks unless they are expert-parallel;
    # scaled-down widths rarely divide by that: expert parallelism when the experts divide.
    eep = bool(experts) and (args.engine_ep == "on" or (args.engine_ep == "auto" and experts % ir == 0))
    return {"trainer": {"tp": tp, "pp": pp, "ep": ep, "dp": dp, "ranks": tr},
            "engine": {"tp": etp, "dp": edp, "expert_parallel": eep, "ranks": ir}}


def model_info(config_path):
    with open(config_path) as f:
        c = json.load(f)
    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0
    return {"layers": int(c.get("num_hidden_layers", 0)), "experts": int(experts)}


def make_layouts(run, par, t_nodes):
    a = run.args
    g = a.gpus_per_node
    common = ["--config", run.config, "--scale-down", str(run.scale_down), "--gpus-per-node", str(g)]
    if run.layers:
        common += ["--layers", str(run.layers)]
    t, e = par["trainer"], par["engine"]
    tpath = os.path.join(run.dir, "trainer.json")
    epath = os.path.join(run.dir, "engine.json")
    cmds = [
        [run.bins["refit-layout"], *common, "--side", "trainer", "--tp", str(t["tp"]), "--pp", str(t["pp"]),
         "--ep", str(t["ep"]), "--dp", str(t["dp"]), "-o", tpath],
        [run.bins["refit-layout"], *common, "--side", "inference", "--tp", str(e["tp"]), "--dp", str(e["dp"]),
         "--first-node", str(t_nodes), *(["--expert-parallel"] if e["expert_parallel"] else []), "-o", epath],
    ]
    for c in cmds:
        r = subprocess.run(c, capture_output=True, text=True)
        if r.returncode != 0:
            raise HarnessError(f"refit-layout failed: {' '.join(c)}: {r.stderr.strip()}")
    workers = []
    sizes = {}
    for role, path in (("trainer", tpath), ("inference", epath)):
        sizes[role] = os.path.getsize(path)
        with open(path) as f:
            side = json.load(f)
        listed = side["workers"]
        for w in listed:
            wpath = path
            if a.split_layouts:
                # One file per worker (every tensor, its own buffers): each sim-worker parses its
                # part only, not the whole side's pieces.
                wpath = os.path.join(run.dir, "layouts", f"{w['name']}.json")
                one = dict(side)
                one["workers"] = [w]
                with open(wpath, "w") as f:
                    json.dump(one, f, separators=(",", ":"))
            workers.append(Worker(run, w["name"], int(w.get("node", 0)), role, wpath))
        del side
    return workers, sizes


# ---------------------------------------------------------------------------------------------
# The cluster of one N


class Run:
    def __init__(self, args, bins, n, model):
        self.args, self.bins, self.n = args, bins, n
        base = args.work_dir or os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
        self.dir = tempfile.mkdtemp(prefix=f"scale-n{n}-", dir=base)
        self.sock_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # unix socket paths are short
        os.makedirs(os.path.join(self.dir, "reports"))
        os.makedirs(os.path.join(self.dir, "layouts"))
        spec = MODELS.get(model, {"config": model, "scale_down": 1, "layers": 0})
        self.config = find_config(spec["config"])
        self.scale_down = args.scale_down or spec["scale_down"]
        self.layers = args.layers if args.layers is not None else spec["layers"]
        self.daemons = []
        self.workers = []
        self.version = 0
        self.relaunched = {}
        self.relaunch_reasons = []

    # -- control ------------------------------------------------------------------------------
    def ctl(self, *cmd, timeout=None, check=True):
        t = timeout or self.args.ctl_timeout
        full = [self.bins["refitctl"], "--daemon", self.daemons[0].address, "-o", "json", "--timeout", str(t), *cmd]
        r = subprocess.run(full, capture_output=True, text=True, timeout=t + 30)
        if check and r.returncode != 0:
            raise HarnessError(f"refitctl {' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def status(self):
        r = self.ctl("status", timeout=self.args.status_timeout, check=False)
        if r.returncode != 0:
            return None
        try:
            return json.loads(r.stdout)
        except ValueError:
            return None

    def group_status(self, st):
        for g in (st or {}).get("groups", []):
            if g.get("name") == GROUP:
                return g
        return None

    def fully_ready(self, st):
        """Ready with every worker of both layouts in, every replica complete, every node alive."""
        g = self.group_status(st)
        if not g or not g.get("ready"):
            return False
        trainers = sum(1 for w in self.workers if w.role == "trainer")
        engines = len(self.workers) - trainers
        if g.get("trainers") != trainers or g.get("inference_workers") != engines:
            return False
        reps = g.get("replicas", [])
        if not reps or not all(r.get("complete") for r in reps):
            return False
        nodes = {int(x.get("node", 0)): x.get("alive", False) for x in st.get("nodes", [])}
        return all(nodes.get(n) for n in range(self.n))

    def wait_ready(self, timeout, what):
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            st = self.status()
            if st is not None and self.fully_ready(st):
                return time.time(), st
            last = st
            time.sleep(self.args.poll)
        g = self.group_status(last)
        raise HarnessError(f"{what}: the group was not ready within {timeout} s: "
                           f"{(g or {}).get('not_ready_reason', last and 'no group' or 'no status')}")

    def refit(self, timeout=None):
        """One round to the next version: (RoundStats dict or None, error text, wall seconds)."""
        self.version += 1
        v = self.version
        t0 = time.time()
        r = self.ctl("refit", GROUP, str(v), timeout=timeout or self.args.round_timeout, check=False)
        wall = time.time() - t0
        if r.returncode == 0:
            return json.loads(r.stdout), "", wall
        return self.round_stats(v), r.stderr.strip(), wall

    def round_stats(self, version):
        r = self.ctl("rounds", GROUP, "--limit", "20", check=False)
        if r.returncode != 0:
            return None
        for s in reversed(json.loads(r.stdout).get("rounds", [])):
            if int(s.get("version", 0)) == version:
                return s
        return None

    def check_commit(self, version, timeout=None):
        """Every live inference worker reports "commit V ok" (every byte checked), every trainer
        "commit V". Returns a list of problems."""
        deadline = time.time() + (timeout or self.args.commit_timeout + 10)
        problems = []
        pending = list(self.workers)
        while pending and time.time() < deadline:
            still = []
            for w in pending:
                lines = [l for l in w.lines() if l.startswith(f"commit {version} ")]
                if not lines and f"commit {version}" not in w.lines():
                    still.append(w)
                elif w.role == "inference" and not any(" ok " in l for l in lines):
                    problems.append(f"{w.name}: {lines[-1] if lines else 'no commit line'}")
            pending = still
            if pending:
                time.sleep(0.05)
        problems += [f"{w.name}: no commit {version} report: {w.lines()[-1:]}" for w in pending]
        return problems

    def snapshot(self):
        out = {}
        for d in self.daemons:
            if d.alive():
                rss, anon = proc_rss_mb(d.pid)
                out[d.node] = {"cpu_s": proc_cpu_s(d.pid), "rss_mb": rss, "anon_mb": anon}
        return out

    def cpu_snapshot(self):
        """CPU seconds of every live daemon ("d", node) and worker ("w", name), with the wall time
        and the machine's busy jiffies."""
        cpu = {}
        for d in self.daemons:
            if d.alive():
                cpu[("d", d.node)] = proc_cpu_s(d.pid)
        for w in self.workers:
            if w.alive():
                cpu[("w", w.name)] = proc_cpu_s(w.proc.pid)
        return {"t": time.time(), "cpu": cpu, "jiffies": host_busy_jiffies()}

    def close(self):
        for w in self.workers:
            if w.alive():
                w.proc.send_signal(signal.SIGCONT)
                w.proc.kill()
        for w in self.workers:
            if w.proc is not None:
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for d in self.daemons:
            if d.alive():
                d.proc.send_signal(signal.SIGCONT)
                d.proc.terminate()
        for d in self.daemons:
            if d.proc is not None:
                try:
                    d.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
                    d.proc.wait()
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def installs_after(run, t_start, epoch_min=None):
    """Per node: seconds from t_start to its first "installed a plan" line of GROUP after t_start."""
    out = {}
    pat = re.compile(r'group "' + GROUP + r'" epoch (\d+): installed a plan of (\d+) messages')
    for d in run.daemons:
        for line in d.lines():
            m = pat.search(line)
            if not m:
                continue
            t = log_time(line)
            if t is None or t < t_start - 0.002:
                continue
            out[d.node] = t - t_start
            break
    return out


def dead_verdicts(run):
    """The coordinator's "node N (...) is dead: why" lines so far: [(node, why)]."""
    out = []
    for line in run.daemons[0].lines() if run.daemons else []:
        m = re.search(r"node (\d+) \(([^)]*)\) is dead: (.*)$", line)
        if m:
            out.append((int(m.group(1)), m.group(3)))
    return out


def launch_workers(run, workers, extra=None):
    marks = {}
    for w in workers:
        marks[w.name] = w.start(*((extra or {}).get(w.name, [])))
    return marks


# A first registration the coordinator did not take (its node was declared dead meanwhile and not
# yet rejoined): WorkerClient::Connect tries again until the sim-worker's register timeout, then
# the sim-worker exits 1 with this. The harness starts it again and counts it (run.relaunched).
RETRYABLE = ("the coordinator did not take the worker", "is not alive", "UNAVAILABLE")


def wait_registered(run, workers, timeout):
    deadline = time.time() + timeout
    when = {}
    while time.time() < deadline:
        for w in workers:
            if w.name in when:
                continue
            t = w.registered_at()
            if t is not None:
                when[w.name] = t
            elif not w.alive():
                why = w.tail(2)
                if any(r in why for r in RETRYABLE) and run.relaunched.get(w.name, 0) < run.args.relaunches:
                    run.relaunched[w.name] = run.relaunched.get(w.name, 0) + 1
                    run.relaunch_reasons.append(f"{w.name}: {why.strip().splitlines()[-1] if why.strip() else ''}")
                    w.start(*w.extra)
                    continue
                raise HarnessError(f"worker {w.name} exited {w.proc.returncode}: {why}")
        if len(when) == len(workers):
            return when
        time.sleep(0.05)
    missing = [w.name for w in workers if w.name not in when]
    raise HarnessError(f"{len(missing)} workers did not register within {timeout} s, e.g. "
                       f"{missing[:3]}: {run.workers and [w.tail() for w in workers if w.name in missing[:1]]}")


def fanout_ms(stats):
    """The TRANSFER fan-out as the coordinator timed it (its clock, RoundStats.nodes): ms from its
    first call to its last (what a node's call waits behind the others'), and from the first call to
    the last answer. None for a round without the nodes' times."""
    sent, got = [], []
    for n in (stats or {}).get("nodes") or []:
        a, b = int(n.get("request_sent_unix_us", 0)), int(n.get("answer_received_unix_us", 0))
        if a > 0 and b > 0:
            sent.append(a)
            got.append(b)
    if not sent:
        return None, None
    return rnd((max(sent) - min(sent)) / 1e3, 3), rnd((max(got) - min(sent)) / 1e3, 3)


def round_record(stats, err, wall):
    s = stats or {}
    c = s.get("culprit") or {}
    calls_ms, answered_ms = fanout_ms(stats)
    return {"version": int(s.get("version", 0)) if s else None, "state": s.get("state"),
            "seconds": s.get("seconds"), "prepare_s": s.get("prepare_seconds"),
            "transfer_s": s.get("transfer_seconds"), "commit_s": s.get("commit_seconds"),
            "bytes": int(s.get("bytes", 0)) if s else None, "wall_s": rnd(wall),
            "culprit": {"kind": c.get("kind"), "node": c.get("node"), "worker_id": c.get("worker_id"),
                        "phase": c.get("phase")} if c.get("kind") not in (None, "KIND_UNSPECIFIED") else None,
            "reason": s.get("reason") or err or "", "commit_note": s.get("commit_note", ""),
            "transfer_calls_ms": calls_ms, "transfer_answered_ms": answered_ms}


def fault_round(run, victim, sig, delay_worker, res_key, res):
    """A round whose PREPARE a delayed worker on `victim` holds open; `sig` to the victim daemon
    STRIKE_S after the other workers reported PREPARE. Records the abort time and the culprit."""
    a = run.args
    v = run.version + 1
    run.version = v
    out = {"signal": signal.Signals(sig).name, "victim_node": victim.node, "version": v}
    done = {}

    def go():
        r = run.ctl("refit", GROUP, str(v), timeout=a.round_timeout, check=False)
        done["t"] = time.monotonic()
        done["rc"], done["err"] = r.returncode, r.stderr.strip()
        done["out"] = r.stdout

    th = threading.Thread(target=go, daemon=True)
    t_issue = time.monotonic()
    th.start()
    # PREPARE is under way once a worker elsewhere reports it (the delayed worker holds it open).
    others = [w for w in run.workers if w.node != victim.node and w.alive()][:8]
    deadline = time.monotonic() + a.round_timeout
    seen = None
    while time.monotonic() < deadline and "t" not in done:
        if any(f"prepare {v}" in w.lines() for w in others):
            seen = time.monotonic()
            break
        time.sleep(0.01)
    if seen is None:
        th.join(a.round_timeout)
        out["error"] = f"PREPARE of version {v} never reached the workers: {done.get('err')}"
        res[res_key] = out
        return out
    out["prepare_seen_after_s"] = rnd(seen - t_issue)
    time.sleep(a.strike_after)
    t_strike = time.monotonic()
    victim.proc.send_signal(sig)
    if sig == signal.SIGKILL:
        victim.proc.wait(timeout=10)
    th.join(a.round_timeout + 60)
    if "t" not in done:
        out["error"] = "the refit call did not return"
        res[res_key] = out
        return out
    out["abort_s"] = rnd(done["t"] - t_strike)
    out["rc"] = done["rc"]
    stats = json.loads(done["out"]) if done["rc"] == 0 and done["out"].strip() else run.round_stats(v)
    rec = round_record(stats, done["err"], done["t"] - t_issue)
    out["round"] = rec
    out["state"] = rec["state"]
    c = rec["culprit"] or {}
    out["culprit_names_victim"] = bool(c.get("kind") == "NODE" and int(c.get("node") or 0) == victim.node)
    out["reason_names_victim"] = f"node {victim.node}" in rec["reason"]
    out["deadline_s"] = {"prepare": a.prepare_timeout, "verdict": a.heartbeat * a.heartbeats_missed,
                         "peer": a.peer_timeout}
    res[res_key] = out
    log(f"  {out['signal']} node {victim.node}: {rec['state']} after {out['abort_s']} s, culprit {c}")
    return out


def round_cpu(idle0, idle1, cpu0, cpu1, rounds, n):
    """Each process's CPU per round (ms), raw and net of its CPU at rest (idle0 -> idle1, scaled
    to the rounds' wall time): the coordinator's, the median non-coordinator daemon's and the
    median worker's; the machine's busy share over the rounds."""
    rest_s = max(1e-9, idle1["t"] - idle0["t"])
    wall = cpu1["t"] - cpu0["t"]
    raw, net = {}, {}
    for k, c1 in cpu1["cpu"].items():
        c0 = cpu0["cpu"].get(k)
        if c0 is None or c1 is None:
            continue
        i0, i1 = idle0["cpu"].get(k), idle1["cpu"].get(k)
        rest_rate = (i1 - i0) / rest_s if i0 is not None and i1 is not None and idle1["t"] > idle0["t"] else 0.0
        raw[k] = (c1 - c0) / max(1, rounds) * 1e3
        net[k] = (c1 - c0 - rest_rate * wall) / max(1, rounds) * 1e3
    daemons = [k for k in raw if k[0] == "d" and k[1] != 0]
    workers = [k for k in raw if k[0] == "w"]
    busy = cpu1["jiffies"][0] - cpu0["jiffies"][0]
    total = cpu1["jiffies"][1] - cpu0["jiffies"][1]
    rest_rates = {k: ((idle1["cpu"][k] - idle0["cpu"][k]) / rest_s * 1e3)
                  for k in idle1["cpu"] if k in idle0["cpu"] and idle1["cpu"][k] is not None
                  and idle0["cpu"][k] is not None} if idle1["t"] > idle0["t"] else {}
    return {
        "rounds": rounds, "wall_per_round_s": rnd(wall / max(1, rounds), 4),
        "rest_window_s": rnd(idle1["t"] - idle0["t"], 2),
        "coordinator_ms": rnd(raw.get(("d", 0)), 3), "coordinator_net_ms": rnd(net.get(("d", 0)), 3),
        "coordinator_net_per_node_ms": rnd(net[("d", 0)] / n, 3) if ("d", 0) in net else None,
        "daemon_median_ms": rnd(med(raw[k] for k in daemons), 3),
        "daemon_net_median_ms": rnd(med(net[k] for k in daemons), 3),
        "worker_median_ms": rnd(med(raw[k] for k in workers), 3),
        "worker_net_median_ms": rnd(med(net[k] for k in workers), 3),
        "rest_ms_per_s": {"coordinator": rnd(rest_rates.get(("d", 0)), 3),
                          "daemon_median": rnd(med(v for k, v in rest_rates.items() if k[0] == "d" and k[1] != 0), 3),
                          "worker_median": rnd(med(v for k, v in rest_rates.items() if k[0] == "w"), 3)},
        "machine_busy": rnd(busy / total, 3) if total > 0 else None,
    }


def run_one(args, bins, n):
    res = {"nodes": n, "model": args.model, "errors": [], "load_before": os.getloadavg()}
    run = Run(args, bins, n, args.model)
    res["run_dir"] = run.dir
    try:
        _run_one(run, res)
    except (HarnessError, subprocess.TimeoutExpired, OSError, ValueError) as e:
        res["errors"].append(f"{type(e).__name__}: {e}")
        log(f"N={n}: ERROR {e}")
    finally:
        res["load_after"] = os.getloadavg()
        run.close()
    return res


def _run_one(run, res):
    a, n = run.args, run.n
    t_nodes = a.train_nodes or max(1, int(round(n * a.train_fraction)))
    if t_nodes >= n:
        t_nodes = n - 1
    i_nodes = n - t_nodes
    minfo = model_info(run.config)
    if run.layers:
        minfo["layers"] = min(minfo["layers"], run.layers)
    par = pick_parallelism(minfo, a, t_nodes, i_nodes)
    res.update({"train_nodes": t_nodes, "inference_nodes": i_nodes, "gpus_per_node": a.gpus_per_node,
                "scale_down": run.scale_down, "layers": run.layers or minfo["layers"], "config": os.path.basename(run.config),
                "parallelism": par})
    log(f"N={n}: {t_nodes} training + {i_nodes} inference nodes, {a.gpus_per_node} workers each, {par}")

    # Layouts
    t0 = time.time()
    run.workers, sizes = make_layouts(run, par, t_nodes)
    res["layout_s"] = rnd(time.time() - t0)
    res["layout_bytes"] = sizes
    res["workers"] = len(run.workers)

    # Daemons: the coordinator first, then the others at once.
    t0 = time.time()
    run.daemons = [Daemon(run, i) for i in range(n)]
    run.daemons[0].start().wait_address(a.start_timeout)
    for d in run.daemons[1:]:
        d.start()
    for d in run.daemons[1:]:
        d.wait_address(a.start_timeout)
    # Joined: every node alive in the coordinator's status.
    deadline = time.time() + a.start_timeout
    while time.time() < deadline:
        st = run.status()
        alive = {int(x.get("node", 0)) for x in (st or {}).get("nodes", []) if x.get("alive")}
        if len(alive) >= n:
            break
        time.sleep(a.poll)
    else:
        raise HarnessError(f"only {len(alive)} of {n} daemons joined within {a.start_timeout} s")
    res["daemons_joined_s"] = rnd(time.time() - t0)
    coord = run.daemons[0]
    base = run.snapshot()

    # Workers
    t0 = time.time()
    launch_workers(run, run.workers)
    when = wait_registered(run, run.workers, a.register_wait)
    t_last_reg = max(when.values())
    res["registration_span_s"] = rnd(t_last_reg - t0)
    res["registration_relaunches"] = sum(run.relaunched.values())
    res["registration_relaunch_reasons"] = run.relaunch_reasons[:5]
    res["nodes_declared_dead_in_setup"] = len(dead_verdicts(run))
    log(f"  {len(run.workers)} workers registered in {res['registration_span_s']} s")

    # Ready: status plans the group when asked (only once everyone is in: no plan per arrival).
    t_ready, st = run.wait_ready(a.ready_timeout, "after registration")
    res["ready_after_last_registration_s"] = rnd(t_ready - t_last_reg)
    plan = json.loads(run.ctl("plan", GROUP).stdout)
    res["plan"] = {k: plan.get(k) for k in ("tensors", "pieces", "transfers", "messages", "descriptors",
                                            "bytes_total", "bytes_network", "planning_seconds")}
    log(f"  ready {res['ready_after_last_registration_s']} s after the last registration; plan "
        f"{res['plan']['pieces']} pieces, {res['plan']['messages']} messages, {res['plan']['bytes_total']} bytes")

    # The first round: every node installs the plan.
    before = run.snapshot()
    t_issue = time.time()
    stats, err, wall = run.refit()
    after = run.snapshot()
    first = round_record(stats, err, wall)
    res["first_round"] = first
    if first["state"] != "COMMITTED":
        raise HarnessError(f"the first round did not commit: {first['reason']}")
    res["first_commit_after_last_registration_s"] = rnd(time.time() - t_last_reg)
    problems = run.check_commit(run.version)
    first["verified"] = not problems
    if problems:
        res["errors"].append(f"version {run.version}: {problems[:3]}")
    inst = installs_after(run, t_issue)
    cpu = {nd: (after[nd]["cpu_s"] or 0) - (before[nd]["cpu_s"] or 0) for nd in after if nd in before}
    res["install"] = {
        "per_node_s": {str(k): rnd(v, 3) for k, v in sorted(inst.items())},
        "nodes_installed": len(inst), "max_s": rnd(mx(inst.values()), 3), "median_s": rnd(med(inst.values()), 3),
        "first_round_cpu_per_node_s": {str(k): rnd(v, 3) for k, v in sorted(cpu.items())},
        "cpu_max_s": rnd(mx(cpu.values()), 3), "cpu_median_s": rnd(med(cpu.values()), 3),
        "cpu_total_s": rnd(sum(cpu.values()), 3),
    }
    res["coordinator"] = {"cpu_setup_s": rnd(before[0]["cpu_s"] - base[0]["cpu_s"], 3),
                          "cpu_first_round_s": rnd(cpu.get(0), 3), "rss_after_first_round_mb": rnd(after[0]["rss_mb"], 1),
                          "anon_after_first_round_mb": rnd(after[0]["anon_mb"], 1)}
    log(f"  first round {first['state']} in {first['seconds']} s (wall {first['wall_s']}); installs max "
        f"{res['install']['max_s']} s; first commit {res['first_commit_after_last_registration_s']} s after the last registration")

    # CPU at rest (heartbeats, keepalives, polls), so that the rounds' own CPU can be told apart.
    idle0 = run.cpu_snapshot()
    if a.idle_cpu_window > 0:
        time.sleep(a.idle_cpu_window)  # a measuring window, not a wait for anything
    idle1 = run.cpu_snapshot()

    # K rounds: control overhead and RSS growth.
    load_before = load_average()
    cpu0 = run.cpu_snapshot()
    snap0 = run.snapshot()
    rounds = []
    trace = []  # the coordinator's anonymous RSS after each round, MiB
    for _ in range(a.rounds):
        stats, err, wall = run.refit()
        rec = round_record(stats, err, wall)
        rounds.append(rec)
        trace.append(rnd(proc_rss_mb(coord.pid)[1], 1))
        if rec["state"] != "COMMITTED":
            res["errors"].append(f"round to version {run.version}: {rec['state']}: {rec['reason']}")
            continue
        problems = run.check_commit(run.version)
        rec["verified"] = not problems
        if problems:
            res["errors"].append(f"version {run.version}: {problems[:3]}")
    snap1 = run.snapshot()
    cpu1 = run.cpu_snapshot()
    ok = [r for r in rounds if r["state"] == "COMMITTED"]
    res["round_cpu"] = round_cpu(idle0, idle1, cpu0, cpu1, len(rounds), n)
    res["round_cpu"]["load_before"] = load_before
    res["round_cpu"]["load_after"] = load_average()
    log(f"  round CPU (net of rest): coordinator {res['round_cpu']['coordinator_net_ms']} ms "
        f"({res['round_cpu']['coordinator_net_per_node_ms']} ms a node), a node daemon "
        f"{res['round_cpu']['daemon_net_median_ms']} ms, a worker {res['round_cpu']['worker_net_median_ms']} ms; "
        f"machine {res['round_cpu']['machine_busy']} busy, load {load_before}")
    growth = {nd: snap1[nd]["rss_mb"] - snap0[nd]["rss_mb"] for nd in snap1 if nd in snap0}
    agrowth = {nd: snap1[nd]["anon_mb"] - snap0[nd]["anon_mb"] for nd in snap1 if nd in snap0}
    res["rounds"] = {
        "count": len(rounds), "committed": len(ok), "verified": sum(1 for r in ok if r.get("verified")),
        "seconds_median": rnd(med(r["seconds"] for r in ok)), "prepare_s_median": rnd(med(r["prepare_s"] for r in ok)),
        "transfer_s_median": rnd(med(r["transfer_s"] for r in ok)), "commit_s_median": rnd(med(r["commit_s"] for r in ok)),
        "control_s_median": rnd(med((r["prepare_s"] or 0) + (r["commit_s"] or 0) for r in ok)),
        "wall_s_median": rnd(med(r["wall_s"] for r in ok)), "bytes": ok[0]["bytes"] if ok else None,
        # The coordinator's TRANSFER calls to every node, first to last: the fan-out's serial part.
        "transfer_calls_ms_median": rnd(med(r["transfer_calls_ms"] for r in ok), 3),
        "transfer_answered_ms_median": rnd(med(r["transfer_answered_ms"] for r in ok), 3),
        "each": rounds if a.verbose_rounds else None,
    }
    rss0 = [v["rss_mb"] for v in snap0.values()]
    rss1 = [v["rss_mb"] for v in snap1.values()]
    res["rss"] = {
        "before_rounds_max_mb": rnd(mx(rss0), 1), "before_rounds_median_mb": rnd(med(rss0), 1),
        "after_rounds_max_mb": rnd(mx(rss1), 1), "after_rounds_median_mb": rnd(med(rss1), 1),
        "coordinator_before_mb": rnd(snap0[0]["rss_mb"], 1), "coordinator_after_mb": rnd(snap1[0]["rss_mb"], 1),
        "growth_max_mb": rnd(mx(growth.values()), 2), "growth_median_mb": rnd(med(growth.values()), 2),
        "growth_coordinator_mb": rnd(growth.get(0), 2), "rounds": len(rounds),
        "anon_before_max_mb": rnd(mx(v["anon_mb"] for v in snap0.values()), 1),
        "anon_after_max_mb": rnd(mx(v["anon_mb"] for v in snap1.values()), 1),
        "anon_after_median_mb": rnd(med(v["anon_mb"] for v in snap1.values()), 1),
        "anon_growth_max_mb": rnd(mx(agrowth.values()), 2), "anon_growth_median_mb": rnd(med(agrowth.values()), 2),
        "anon_growth_coordinator_mb": rnd(agrowth.get(0), 2),
        "per_node_after_mb": {str(k): rnd(v["rss_mb"], 1) for k, v in sorted(snap1.items())},
        "coordinator_anon_per_round_mb": trace,
    }
    res["coordinator"]["cpu_per_round_s"] = rnd((snap1[0]["cpu_s"] - snap0[0]["cpu_s"]) / max(1, len(rounds)), 4)
    res["coordinator"]["rss_mb"] = rnd(snap1[0]["rss_mb"], 1)
    res["coordinator"]["anon_mb"] = rnd(snap1[0]["anon_mb"], 1)
    log(f"  {len(ok)}/{len(rounds)} rounds committed: median {res['rounds']['seconds_median']} s (prepare "
        f"{res['rounds']['prepare_s_median']}, transfer {res['rounds']['transfer_s_median']}, commit "
        f"{res['rounds']['commit_s_median']}; TRANSFER's calls first to last "
        f"{res['rounds']['transfer_calls_ms_median']} ms, to the last answer {res['rounds']['transfer_answered_ms_median']} ms)"
        f"; RSS max {res['rss']['after_rounds_max_mb']} MB, growth max "
        f"{res['rss']['growth_max_mb']} MB (anonymous: {res['rss']['anon_growth_max_mb']} MB)")

    if not a.faults:
        return
    victim_node = a.victim_node if a.victim_node >= 0 else n - 1
    if victim_node == 0 or victim_node >= n:
        raise HarnessError("--victim-node must be a node other than the coordinator")
    victim = run.daemons[victim_node]
    mine = [w for w in run.workers if w.node == victim_node]
    if not mine:
        raise HarnessError(f"node {victim_node} holds no worker")
    delayed = mine[0]
    delay = ["--prepare-delay-ms", str(int(a.prepare_delay * 1000))]

    # One of the victim's workers restarted slow to confirm PREPARE: the next rounds' PREPARE lasts.
    delayed.kill()
    launch_workers(run, [delayed], {delayed.name: delay})
    wait_registered(run, [delayed], a.register_wait)
    run.wait_ready(a.ready_timeout, "after restarting a worker")
    t0 = time.time()
    stats, err, wall = run.refit()
    rec = round_record(stats, err, wall)
    res["replan_after_worker_restart"] = {"round": rec, "install_max_s": rnd(mx(installs_after(run, t0).values()), 3)}
    if rec["state"] != "COMMITTED":
        raise HarnessError(f"the round after a worker's restart did not commit: {rec['reason']}")

    if "stop" in a.faults:
        st_case = fault_round(run, victim, signal.SIGSTOP, delayed, "abort_sigstop", res)
        if "error" in st_case:
            res["errors"].append(f"SIGSTOP case: {st_case['error']}")
        time.sleep(a.stopped_for)
        t_cont = time.time()
        victim.proc.send_signal(signal.SIGCONT)
        # Its workers may have lost their sessions (keepalive) and register again by themselves.
        t_ready, _ = run.wait_ready(a.ready_timeout, "after SIGCONT")
        stats, err, wall = run.refit()
        rec = round_record(stats, err, wall)
        res["abort_sigstop"]["ready_after_sigcont_s"] = rnd(t_ready - t_cont)
        res["abort_sigstop"]["next_round"] = rec
        if rec["state"] != "COMMITTED":
            # A daemon thawed after being declared dead: the node resyncs; try once more.
            run.wait_ready(a.ready_timeout, "after SIGCONT (retry)")
            stats, err, wall = run.refit()
            rec = round_record(stats, err, wall)
            res["abort_sigstop"]["next_round_retry"] = rec
        if rec["state"] == "COMMITTED":
            problems = run.check_commit(run.version)
            rec["verified"] = not problems
            if problems:
                res["errors"].append(f"after SIGSTOP, version {run.version}: {problems[:3]}")
        else:
            res["errors"].append(f"after SIGSTOP + SIGCONT, no round committed: {rec['reason']}")

    if "kill" in a.faults:
        k = fault_round(run, victim, signal.SIGKILL, delayed, "abort_sigkill", res)
        if "error" in k:
            res["errors"].append(f"SIGKILL case: {k['error']}")
        # The node comes back: its daemon on the same address and socket, fresh workers. (If the
        # case could not strike, the daemon is killed here, so that no second one is started.)
        if victim.alive():
            victim.proc.send_signal(signal.SIGCONT)
            victim.proc.kill()
            victim.proc.wait(timeout=15)
        for w in mine:
            w.kill()
        t_restart = time.time()
        victim.start().wait_address(a.start_timeout)
        launch_workers(run, mine)
        when = wait_registered(run, mine, a.register_wait)
        t_ready, _ = run.wait_ready(a.ready_timeout, "after the node's restart")
        t_before_round = time.time()
        stats, err, wall = run.refit()
        rec = round_record(stats, err, wall)
        inst = installs_after(run, t_before_round)
        res["rejoin"] = {
            "node": victim_node, "registered_after_restart_s": rnd(max(when.values()) - t_restart),
            "ready_after_restart_s": rnd(t_ready - t_restart),
            "commit_after_restart_s": rnd(time.time() - t_restart), "round": rec,
            "install_max_s": rnd(mx(inst.values()), 3), "nodes_installed": len(inst),
        }
        if rec["state"] == "COMMITTED":
            problems = run.check_commit(run.version)
            rec["verified"] = not problems
            if problems:
                res["errors"].append(f"after the restart, version {run.version}: {problems[:3]}")
        else:
            res["errors"].append(f"after the node's restart the round did not commit: {rec['reason']}")
        log(f"  rejoin: ready {res['rejoin']['ready_after_restart_s']} s, committed "
            f"{res['rejoin']['commit_after_restart_s']} s after the restart")

    res["nodes_declared_dead_total"] = len(dead_verdicts(run))
    res["dead_verdicts"] = [f"node {nd}: {why}" for nd, why in dead_verdicts(run)][:20]
    final = run.snapshot()
    res["coordinator"]["cpu_total_s"] = rnd(final[0]["cpu_s"], 3)
    res["coordinator"]["rss_final_mb"] = rnd(final[0]["rss_mb"], 1)
    res["coordinator"]["anon_final_mb"] = rnd(final[0]["anon_mb"], 1)
    res["rss"]["final_max_mb"] = rnd(mx(v["rss_mb"] for v in final.values()), 1)
    res["rss"]["final_median_mb"] = rnd(med(v["rss_mb"] for v in final.values()), 1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nodes", default="4,8,16", help="comma-separated N: daemons per run (node 0 coordinates)")
    p.add_argument("--model", default="small", help="deepseek-v3, kimi-k2, small, or a config.json path")
    p.add_argument("--scale-down", type=int, default=0, help="divide every width by this (0: the model's default)")
    p.add_argument("--layers", type=int, default=None, help="keep this many layers (0: all; default: the model's)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="workers (sim-worker processes) per node")
    p.add_argument("--train-fraction", type=float, default=0.5, help="share of the nodes that train")
    p.add_argument("--train-nodes", type=int, default=0, help="training nodes (overrides --train-fraction)")
    p.add_argument("--trainer-tp", type=int, default=0)
    p.add_argument("--trainer-pp", type=int, default=0, help="0: the largest of 8, 4, 2 that divides")
    p.add_argument("--trainer-ep", type=int, default=0, help="0: the largest power of 2 dividing dp and the experts")
    p.add_argument("--engine-tp", type=int, default=0, help="0: --gpus-per-node (one replica per node)")
    p.add_argument("--engine-ep", choices=["auto", "on", "off"], default="auto",
                   help="vLLM expert parallelism (auto: when the experts divide over the engine's ranks)")
    p.add_argument("--rounds", type=int, default=5, help="K rounds after the first (overhead, RSS growth)")
    p.add_argument("--faults", default="stop,kill", help="fault experiments: stop, kill (empty: none)")
    p.add_argument("--victim-node", type=int, default=-1, help="the daemon struck (default: the last node)")
    p.add_argument("--prepare-delay", type=float, default=3.0, help="the victim's slow worker's PREPARE (s)")
    p.add_argument("--strike-after", type=float, default=0.3, help="seconds into PREPARE the signal lands")
    p.add_argument("--stopped-for", type=float, default=0.0, help="extra seconds the SIGSTOPped daemon stays stopped after the abort")
    p.add_argument("--heartbeat", type=float, default=0.5, help="refitd --heartbeat (its default)")
    p.add_argument("--heartbeats-missed", type=int, default=4, help="refitd --heartbeats-missed (its default)")
    p.add_argument("--relaunches", type=int, default=3, help="times a worker whose first registration was "
                   "refused as UNAVAILABLE is started again")
    p.add_argument("--prepare-timeout", type=float, default=20.0)
    p.add_argument("--transfer-timeout", type=float, default=60.0)
    p.add_argument("--commit-timeout", type=float, default=60.0)
    p.add_argument("--peer-timeout", type=float, default=5.0, help="refitd --peer-timeout (install deadline: 4x this + 4x planning)")
    p.add_argument("--daemon-flag", action="append", default=[], help="extra refitd flag (repeat; --daemon-flag=--x=1)")
    p.add_argument("--register-timeout", type=float, default=120.0, help="sim-worker --register-timeout")
    p.add_argument("--register-wait", type=float, default=600.0, help="seconds to wait for every registration")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--round-timeout", type=float, default=900.0)
    p.add_argument("--ctl-timeout", type=float, default=300.0)
    p.add_argument("--status-timeout", type=float, default=600.0, help="refitctl status (it plans when needed)")
    p.add_argument("--poll", type=float, default=0.1, help="seconds between status polls")
    p.add_argument("--split-layouts", action=argparse.BooleanOptionalAction, default=True,
                   help="one layout file per worker (each sim-worker parses its own part only)")
    p.add_argument("--bin", default="", help="folder with refitd, refitctl, refit-layout, sim-worker, or a Bazel "
                   "output tree holding them (daemon/refitd...); nothing else is looked at then")
    p.add_argument("--work-dir", default="", help="where run folders go (default: $TEST_TMPDIR or /tmp)")
    p.add_argument("--keep", action="store_true", help="keep each run's folder (logs, reports)")
    p.add_argument("--idle-cpu-window", type=float, default=2.0,
                   help="seconds of rest before the K rounds, to take each process's CPU at rest out of "
                   "its CPU per round (0: not measured)")
    p.add_argument("--verbose-rounds", action="store_true", help="every round's record in the JSON")
    p.add_argument("--out", default="", help="JSON output (default: stdout)")
    a = p.parse_args(argv)
    a.faults = [f for f in a.faults.split(",") if f]
    a.node_counts = [int(x) for x in a.nodes.split(",") if x]
    if any(x < 2 for x in a.node_counts):
        p.error("--nodes: at least 2 per run")
    return a


def private_binaries(args):
    d = tempfile.mkdtemp(prefix="scale-bin-", dir=args.work_dir or os.environ.get("TEST_TMPDIR") or None)
    bins = {}
    for name in BINARIES:
        src = find_binary(name, args.bin)
        dst = os.path.join(d, name)
        shutil.copy2(src, dst)
        bins[name] = dst
    return d, bins


def main(argv=None):
    args = parse_args(argv)
    bin_dir, bins = private_binaries(args)
    results = []
    out = {"machine": {"cpus": os.cpu_count(), "mem_gb": round(os.sysconf("SC_PHYS_PAGES") * PAGE / 2**30, 1)},
           "args": {k: v for k, v in vars(args).items() if k not in ("node_counts",)}, "results": results}

    def dump():
        text = json.dumps(out, indent=1)
        if args.out:
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, args.out)
        return text

    try:
        for n in args.node_counts:
            t0 = time.time()
            r = run_one(args, bins, n)
            r["total_s"] = rnd(time.time() - t0, 1)
            results.append(r)
            dump()  # after every N, so that a long sweep leaves what it measured
    finally:
        shutil.rmtree(bin_dir, ignore_errors=True)
    text = dump()
    if not args.out:
        print(text)
    return out


if __name__ == "__main__":
    res = main()
    sys.exit(1 if any(r["errors"] for r in res["results"]) else 0)
