"""The default mode (no TLS) on a shared host: loopback is every local user's, so a process of
another uid, which cannot open the worker socket, must not reach what moves or steers weights
through the daemons' TCP ports either. Two daemons without TLS, a trainer and an engine (Python
pattern workers that check every destination byte at every commit); then a process running as
uid 65534 (nobody) tries the control port (Status, Refit), the peer service (Join, RunPhase) and
the data plane (a frame, and a listener on a dead node's data port is not tried here: the sender's
check is covered by daemon/security/loopback_owner_test). Each is refused, naming the uid; the daemons log
it; the legitimate rounds keep committing byte-exact. And a user that --worker-uids lets onto the
worker socket takes only its own share of the WatchRounds slots there: other users still watch.
Needs root (to become another uid)."""
import contextlib
import functools
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402

from e2e_lib import Reports, commit_checked, data_address, layouts, start_policy_workers  # noqa: E402

NOBODY = 65534

# Run as nobody: every call it makes, and what came of it, as one JSON object on stdout.
HOSTILE = r"""
import json, socket, sys
sys.path.insert(0, sys.argv[1])
import grpc
from refit import _rpc
from refit._proto import refit_pb2
control, data = sys.argv[2], sys.argv[3]
out = {}
def code(fn):
    try:
        fn()
        return "OK"
    except grpc.RpcError as e:
        return "%s: %s" % (e.code().name, e.details())
channel = grpc.insecure_channel(control)
ctl = _rpc.Stub(channel, "RefitControl")
peer = _rpc.Stub(channel, "RefitPeer")
out["Status"] = code(lambda: ctl.Status(refit_pb2.StatusRequest(), timeout=10))
out["Refit"] = code(lambda: ctl.Refit(refit_pb2.RefitRequest(group="policy", version=10**6), timeout=20))
out["Join"] = code(lambda: peer.Join(refit_pb2.JoinRequest(node=7, control_address="127.0.0.1:9",
                                                          data_address="127.0.0.1:9"), timeout=10))
out["RunPhase"] = code(lambda: peer.RunPhase(refit_pb2.PhaseRequest(group="policy"), timeout=10))
host, port = data.rsplit(":", 1)
def send_frame(source):
    # From loopback, and from this host's own routable address (still this host's user).
    s = socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0) if source else None)
    try:
        s.sendall(b"RFD1" + bytes(28) + b"policy" + b"\xff" * 4096)
        s.settimeout(5)
        try:
            rest = s.recv(1)
            return "closed" if rest == b"" else "answered %r" % rest
        except ConnectionResetError:
            return "closed"
        except socket.timeout:
            return "held open"
    finally:
        s.close()
if sys.argv[4]:  # first: the daemon's first refusal is the one it logs at once
    out["data_from_routable"] = send_frame(sys.argv[4])
out["data"] = send_frame(None)
print(json.dumps(out))
"""


# Run as nobody on the worker socket: holds every WatchRounds stream one caller may, asks for one
# more, prints what came of it, and holds them until told (a line on stdin).
WATCHER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import grpc
from refit import _rpc
from refit._proto import refit_pb2
ctl = _rpc.Stub(grpc.insecure_channel(sys.argv[2]), "RefitControl")
held = [ctl.WatchRounds(refit_pb2.WatchRoundsRequest(), timeout=120) for _ in range(int(sys.argv[3]))]
for h in held:
    h.initial_metadata()  # sent once the daemon holds the stream open
extra = ctl.WatchRounds(refit_pb2.WatchRoundsRequest(), timeout=30)
try:
    extra.initial_metadata()
    next(extra)
    got = "OK"
except grpc.RpcError as e:
    got = "%s: %s" % (e.code().name, e.details())
print(json.dumps({"one_more": got}), flush=True)
sys.stdin.readline()
"""

# Run as nobody: opens argv[2] connections to unix socket argv[1], each sending half of HTTP/2's
# preface (gRPC holds such a connection until its keepalive gives up), waits, and says how many
# the daemon closed.
HOLDER = r"""
import json, resource, socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(b"PRI * HTTP/2.0")
    socks.append(s)
time.sleep(3)
closed = 0
for s in socks:
    try:
        while True:
            if s.recv(65536, socket.MSG_DONTWAIT) == b"":
                closed += 1
                break
    except BlockingIOError:
        pass  # open: what the daemon sent is read
    except ConnectionResetError:
        closed += 1
print(json.dumps({"closed": closed}), flush=True)
sys.stdin.readline()
"""

MAX_WATCHES_PER_CALLER = 8  # daemon/services.h, kMaxWatchesPerCaller


def public_package():
    """A copy of the refit package that nobody can read (the test's own files are under root's home)."""
    public = tempfile.mkdtemp(prefix="refit-shared-host-", dir="/tmp")
    shutil.copytree(os.path.dirname(refit.__file__), os.path.join(public, "refit"))
    for root, dirs, files in os.walk(public):
        for n in dirs + files:
            os.chmod(os.path.join(root, n), 0o755)
    os.chmod(public, 0o755)
    return public


def become(uid):
    os.setgid(uid)
    os.setuid(uid)


def drop_to_nobody():
    become(NOBODY)


@contextlib.contextmanager
def held_by_users(uids, program, *args):
    """Runs the Python `program` once as each of `uids`, from a directory every user may read,
    each holding what it opened until its stdin gets a line: at the end of the block, whatever the
    block did (a program that ended already has nothing to hear)."""
    procs = []
    try:
        for uid in uids:
            procs.append(subprocess.Popen([sys.executable, "-c", program, *args],
                                          preexec_fn=functools.partial(become, uid), stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/tmp"))
        yield procs
    finally:
        for p in procs:
            try:
                p.stdin.write("\n")
                p.stdin.close()
            except OSError:
                pass
            p.wait(timeout=30)
            p.stdout.close()
            p.stderr.close()


def first_line(test, proc, who):
    """The first line `proc` prints; the test fails with its stderr if it ended without one."""
    line = proc.stdout.readline()
    test.assertTrue(line, f"{who} ended: {proc.stderr.read() if proc.poll() is not None else ''}")
    return json.loads(line)


def routable_address():
    """An IPv4 address of this host that is not loopback ("" if none)."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
    except OSError:
        return ""
    return next((a for a in out if "." in a and not a.startswith("127.")), "")


@unittest.skipUnless(os.geteuid() == 0, "becoming another uid needs root")
class SharedHostSuite(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = harness.Cluster(nodes=2, tls=False)
        cls.reports = Reports(cls.cluster)
        cls.files = layouts(cls.cluster)
        cls.engines = start_policy_workers(cls.cluster, cls.reports, cls.files)
        cls.ctl = refit.Controller(cls.cluster.control)
        cls.ctl.wait_ready("policy", timeout=30)
        cls.version = 0
        cls.public = public_package()

    @classmethod
    def tearDownClass(cls):
        cls.ctl.close()
        cls.cluster.close()
        shutil.rmtree(cls.public, ignore_errors=True)

    def refit_still_works(self):
        type(self).version += 1
        commit_checked(self, self.ctl, self.reports, self.engines, self.version)

    def data_address(self, node):
        address = data_address(self.cluster.daemons[node])
        self.assertIsNotNone(address, "the daemon logs its data plane address")
        return address

    def as_nobody(self, control, data):
        p = subprocess.run([sys.executable, "-c", HOSTILE, self.public, control, data, routable_address()],
                           preexec_fn=drop_to_nobody,
                           capture_output=True, text=True, timeout=120, cwd="/tmp")
        self.assertEqual(p.returncode, 0, p.stderr)
        return json.loads(p.stdout.strip().splitlines()[-1])

    def test_another_user_reaches_nothing(self):
        self.refit_still_works()
        for node in (0, 1):
            got = self.as_nobody(self.cluster.daemons[node].address, self.data_address(node))
            for call in ("Status", "Refit", "Join", "RunPhase"):
                self.assertTrue(got[call].startswith("PERMISSION_DENIED"), f"node {node} {call}: {got[call]}")
                self.assertIn(f"uid {NOBODY}", got[call])
            self.assertEqual(got["data"], "closed", f"node {node}'s data plane")
            if "data_from_routable" in got:
                self.assertEqual(got["data_from_routable"], "closed", f"node {node}'s data plane, from {routable_address()}")
            with open(self.cluster.daemons[node].log, errors="replace") as f:
                log = f.read()
            self.assertIn(f"belongs to uid {NOBODY}", log, f"node {node} logs the refused data connection")
            # (Refusals are logged at a bounded rate: the first one of the burst is the routable one.)
            if "data_from_routable" in got:  # refused as the user it is, not read as a malformed frame
                self.assertTrue(any(routable_address() in l and f"belongs to uid {NOBODY}" in l for l in log.splitlines()),
                                f"node {node} names the user behind {routable_address()}")
        self.refit_still_works()
        # The same calls from this uid are answered: the refusal is the user's, not the call's.
        status = self.ctl.status()
        self.assertIn("policy", json.dumps(status, default=str), status)


@unittest.skipUnless(os.geteuid() == 0, "becoming another uid needs root")
class WorkerSocketShareSuite(unittest.TestCase):
    """The worker socket's WatchRounds slots are shared out per user (the daemon reads each
    connection's uid), not one share for every user let onto the socket."""

    @classmethod
    def setUpClass(cls):
        cls.cluster = harness.Cluster(nodes=1, tls=False, daemon_flags=["--worker-uids", f"0,{NOBODY}"])
        os.chmod(cls.cluster.socket_dir, 0o711)  # the socket's own ACL says who may connect
        cls.public = public_package()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.close()
        shutil.rmtree(cls.public, ignore_errors=True)

    def test_one_user_cannot_take_every_watch_on_the_worker_socket(self):
        target = self.cluster.daemons[0].worker_address
        with held_by_users([NOBODY], WATCHER, self.public, target, str(MAX_WATCHES_PER_CALLER)) as (nobody,):
            got = first_line(self, nobody, "nobody's watcher")["one_more"]
            self.assertTrue(got.startswith("RESOURCE_EXHAUSTED"), got)
            self.assertIn(f"uid {NOBODY} on the worker socket", got)
            # This uid, on the same socket, while nobody holds its whole share: still watches.
            ctl = refit.Controller(target, timeout=10)
            try:
                with ctl.open_watch():
                    pass
            finally:
                ctl.close()

    def test_one_user_cannot_hold_every_descriptor_of_the_daemon(self):
        """Connections that are served (they spoke) and then go quiet hold a descriptor each until
        gRPC's keepalive closes them; one user holds at most an eighth of the daemon's descriptor
        limit (up to 1024): past that a new connection is closed at once, and other users still
        get through. Before, 20,000 such connections took the daemon to its descriptor limit."""
        daemon = self.cluster.daemons[0]
        with open(f"/proc/{daemon.proc.pid}/limits") as f:
            soft = next(int(line.split()[3]) for line in f if line.startswith("Max open files"))
        per_user = max(64, min(1024, soft // 8))
        extra = 100
        if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < per_user + extra + 64:
            self.skipTest("this machine's hard descriptor limit is below what the test opens")
        path = daemon.worker_address[len("unix:"):]
        with held_by_users([NOBODY], HOLDER, path, str(per_user + extra)) as (nobody,):
            closed = first_line(self, nobody, "the holder")["closed"]
            # Its connections past its share, and none of the rest (nothing else closes them in 3 s).
            self.assertGreaterEqual(closed, extra)
            self.assertLess(closed, extra + 16)
            # This uid, while nobody holds its whole share, still gets through.
            ctl = refit.Controller(daemon.worker_address, timeout=10)
            try:
                ctl.status()
            finally:
                ctl.close()


class ForwardedWatchSuite(unittest.TestCase):
    """A node's watchers reach the coordinator on one stream: eight users of a node's worker
    socket, each holding its whole share of watches there, took every slot of the coordinator
    when each watch was forwarded as a stream of its own, and no one else could watch."""

    USERS = [NOBODY] + list(range(2001, 2008))

    @classmethod
    def setUpClass(cls):
        uids = ",".join(str(u) for u in [0] + cls.USERS)
        cls.cluster = harness.Cluster(nodes=2, tls=False, daemon_flags=["--worker-uids", uids])
        os.chmod(cls.cluster.socket_dir, 0o711)
        cls.public = public_package()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.close()
        shutil.rmtree(cls.public, ignore_errors=True)

    def test_one_nodes_watchers_do_not_take_the_coordinators_slots(self):
        node = self.cluster.daemons[1].worker_address
        with held_by_users(self.USERS, WATCHER, self.public, node, str(MAX_WATCHES_PER_CALLER)) as watchers:
            for w in watchers:
                first_line(self, w, "a watcher")
            # 64 watches held on the node; the coordinator still serves this user.
            ctl = refit.Controller(self.cluster.daemons[0].worker_address, timeout=10)
            try:
                with ctl.open_watch():
                    pass
            finally:
                ctl.close()


class SilentConnectionSuite(unittest.TestCase):
    """A connection that goes silent before it has said anything gRPC can serve (here: half of
    HTTP/2's preface) is closed by the daemon's keepalive, on the worker socket (whose connections
    the daemon hands to gRPC itself, with no handshake deadline) and on the control port; callers
    that speak gRPC answer the pings and are kept.

    An idle gRPC C-core caller (Python's, C++'s) reads its connection only when its backup poller
    runs, every 5 s: it answers a ping within 5 s, so a keepalive shorter than that closes idle
    callers' connections (and a call sent as one closes fails). Hence 8 s here, not 1 s."""

    KEEPALIVE_S = 8.0

    @classmethod
    def setUpClass(cls):
        cls.cluster = harness.Cluster(nodes=1, tls=False, daemon_flags=["--rpc-keepalive", str(cls.KEEPALIVE_S)])

    @classmethod
    def tearDownClass(cls):
        cls.cluster.close()

    def closed_within(self, s, seconds):
        s.settimeout(seconds)
        try:
            while True:
                if s.recv(4096) == b"":  # the daemon's settings and pings, then the end
                    return True
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True

    def test_half_a_preface_is_closed_by_the_keepalive(self):
        d = self.cluster.daemons[0]
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.connect(d.socket)
        host, port = d.address.rsplit(":", 1)
        tcp = socket.create_connection((host, int(port)), timeout=5)
        for s in (unix, tcp):
            s.sendall(b"PRI * HTTP/2.0\r\n")  # and nothing more
        ctl = refit.Controller(d.worker_address, timeout=10)
        try:
            ctl.status()
            for name, s in (("worker socket", unix), ("control port", tcp)):
                self.assertTrue(self.closed_within(s, 2 * self.KEEPALIVE_S + 5),
                                f"a silent connection on the {name} was still open {2 * self.KEEPALIVE_S + 5:.0f} s on")
                s.close()
            # A gRPC caller quiet for longer than the keepalive answered its pings: its channel
            # still serves, and the daemon still accepts.
            self.assertIsNotNone(ctl.status())
        finally:
            ctl.close()
        ctl = refit.Controller(d.worker_address, timeout=10)
        try:
            self.assertIsNotNone(ctl.status())
        finally:
            ctl.close()


if __name__ == "__main__":
    unittest.main()
