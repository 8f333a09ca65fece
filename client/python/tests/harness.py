"""Test harness: real refitd daemons on loopback (host backend), C++ sim-workers, the
layout tools, found in Bazel's runfiles (or $REFIT_BIN_DIR, or bazel-bin for manual runs)."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))

BINARIES = {
    "refitd": "daemon/refitd",
    "refit-layout": "client/tools/refit-layout",
    "refit-plan": "client/tools/refit-plan",
    "refitctl": "client/tools/refitctl",
    "sim-worker": "tests/workers/sim-worker",
}


def binary(name):
    rel = BINARIES[name]
    candidates = []
    if os.environ.get("REFIT_BIN_DIR"):
        candidates.append(os.path.join(os.environ["REFIT_BIN_DIR"], os.path.basename(rel)))
    if os.environ.get("TEST_SRCDIR"):
        candidates.append(os.path.join(os.environ["TEST_SRCDIR"], "refit", rel))
    candidates.append(os.path.join(REPO, "bazel-bin", rel))
    for c in candidates:
        if os.path.exists(c):
            return c
    raise FileNotFoundError(f"{name} not found (tried {candidates}); bazel build //{os.path.dirname(rel)}:{os.path.basename(rel)}")


def config_path(name):
    for base in [os.path.join(os.environ.get("TEST_SRCDIR", ""), "refit"), REPO]:
        p = os.path.join(base, "tests", "configs", name)
        if os.path.exists(p):
            return p
    raise FileNotFoundError(name)


def repo_file(rel):
    """A file of the repository, from Bazel's runfiles or the source tree."""
    for base in [os.path.join(os.environ.get("TEST_SRCDIR", ""), "refit"), REPO]:
        p = os.path.join(base, rel)
        if os.path.exists(p):
            return p
    raise FileNotFoundError(rel)


def tls_wanted():
    """$REFIT_TEST_TLS=1: every harness cluster runs with mutual TLS (the tests' `_tls` variants)."""
    return os.environ.get("REFIT_TEST_TLS", "") == "1"


def make_certs(directory, nodes=8):
    """The cluster's TLS material (tools/gen_certs.sh): node-N, refit-operator, refit-viewer,
    intruder (CA-signed, no role), refit-worker (workers over --worker-listen), and rogue/
    (another CA's)."""
    subprocess.run(["bash", repo_file("tools/gen_certs.sh"), directory, str(nodes), "intruder", "refit-worker"],
                   check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return directory


def tls_flags(certs, node):
    return ["--tls-cert", os.path.join(certs, f"node-{node}.pem"), "--tls-key", os.path.join(certs, f"node-{node}.key"),
            "--tls-ca", os.path.join(certs, "ca.pem")]


def scratch():
    base = os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="refit-py-", dir=base)


class Daemon:
    def __init__(self, cluster, node, coordinator, extra):
        self.cluster, self.node, self.coordinator_addr, self.extra = cluster, node, coordinator, extra
        self.proc = None
        self.address = None
        self.listen = "127.0.0.1:0"
        # Unix socket paths are short (108 bytes): under /tmp, not Bazel's deep test folder.
        self.socket = os.path.join(cluster.socket_dir, f"refitd-{node}.sock")
        self.log = os.path.join(cluster.dir, f"daemon{node}.log")

    def start(self, timeout=20):
        addr_file = os.path.join(self.cluster.dir, f"daemon{self.node}.addr")
        if os.path.exists(addr_file):
            os.unlink(addr_file)
        cmd = [binary("refitd"), "--node", str(self.node), "--listen", self.listen,
               "--data-listen", "127.0.0.1:0", "--worker-socket", self.socket,
               "--address-file", addr_file, "--heartbeat", "0.2", "--heartbeats-missed", "5",
               *self.cluster.daemon_flags, *self.extra]
        if self.cluster.certs:
            cmd += tls_flags(self.cluster.certs, self.node)
        if self.coordinator_addr:
            cmd += ["--coordinator", self.coordinator_addr]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(addr_file) and os.path.getsize(addr_file) > 0:
                with open(addr_file) as f:
                    self.address = f.read().split()[0]
                # Restarts keep the same address, as a daemon restarted by systemd or Kubernetes does.
                self.listen = self.address
                if self.cluster.certs and "TLS: certificate" not in self.tail(200):
                    raise RuntimeError(f"refitd {self.node} was given TLS flags but does not say it uses TLS")
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"refitd {self.node} exited: {self.tail()}")
            time.sleep(0.05)
        raise RuntimeError(f"refitd {self.node} did not start: {self.tail()}")

    @property
    def worker_address(self):
        return "unix:" + self.socket

    def kill(self, sig=signal.SIGKILL):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(timeout=10)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self, n=20):
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


class Cluster:
    """`nodes` daemons on loopback; node 0 coordinates. With `coordinator_file`, the others find
    it through a file (--coordinator file:PATH, `self.coordinator_file`), as when it may move."""

    def __init__(self, nodes=2, daemon_flags=(), coordinator_file=False, tls=None, certs=None):
        """`tls`: mutual TLS between daemons and for control calls (default: $REFIT_TEST_TLS=1),
        with certificates made here or `certs` (make_certs' folder, shared with daemons started
        by hand); this process (and what it starts) then calls as refit-operator ($REFIT_TLS_*)."""
        self.dir = scratch()
        self.certs = certs
        if certs is None and (tls if tls is not None else tls_wanted()):
            self.certs = make_certs(os.path.join(self.dir, "certs"))
        if self.certs:
            self.use_identity("refit-operator")
        self.socket_dir = tempfile.mkdtemp(prefix="refit-", dir="/tmp")
        self.daemon_flags = list(daemon_flags)
        self.daemons = []
        self.procs = []
        self.coordinator_file = os.path.join(self.dir, "coordinator.addr") if coordinator_file else None
        for n in range(nodes):
            coord = self.daemons[0].address if n else None
            if n and self.coordinator_file:
                self.name_coordinator(coord)
                coord = "file:" + self.coordinator_file
            self.daemons.append(Daemon(self, n, coord, []).start())

    def use_identity(self, name):
        """Control calls from this process (refit.Controller, refitctl) as certificate `name`."""
        os.environ["REFIT_TLS_CERT"] = os.path.join(self.certs, f"{name}.pem")
        os.environ["REFIT_TLS_KEY"] = os.path.join(self.certs, f"{name}.key")
        os.environ["REFIT_TLS_CA"] = os.path.join(self.certs, "ca.pem")

    def name_coordinator(self, address):
        """Rewrites the coordinator file atomically (as a Kubernetes ConfigMap update does)."""
        tmp = self.coordinator_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(address + "\n")
        os.replace(tmp, self.coordinator_file)

    @property
    def control(self):
        return self.daemons[0].address

    def spawn(self, args, name):
        """Starts a helper process (a Python worker script, a sim-worker) logging to the cluster dir."""
        path = os.path.join(self.dir, f"{name}.log")
        with open(path, "ab") as log:
            p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        p.log_path = path
        self.procs.append(p)
        return p

    def write_json(self, name, obj):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            json.dump(obj, f)
        return path

    def close(self):
        if self.certs:
            for name in ("REFIT_TLS_CERT", "REFIT_TLS_KEY", "REFIT_TLS_CA"):
                os.environ.pop(name, None)
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for d in self.daemons:
            d.stop()
        import shutil
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    def logs(self):
        out = []
        for d in self.daemons:
            out.append(f"--- daemon {d.node}\n{d.tail(30)}")
        for p in self.procs:
            try:
                with open(p.log_path, errors="replace") as f:
                    out.append(f"--- {p.log_path}\n" + "".join(f.readlines()[-30:]))
            except OSError:
                pass
        return "\n".join(out)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def python():
    return sys.executable


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
