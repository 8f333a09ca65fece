"""The attack suite: every attack a security review reported, performed against a TLS-configured
cluster on loopback (three daemons, host backend, certificates made at test time with openssl by
tools/gen_certs.sh), each asserted to fail with the right error, while the legitimate trainer and
engine (Python pattern workers that check every destination byte at every commit) keep refitting.

The attacker holds what a hostile process on the node or the network could get: a plaintext
channel, a certificate of another CA, a certificate of the cluster's CA without a role (intruder),
a viewer's, an operator's, another daemon's, even the coordinator's own (a stolen key without the
incarnation), the worker socket, the data plane's port, /dev/shm and its own memfds."""
import fcntl
import os
import re
import socket
import subprocess
import sys
import time
import unittest
from math import prod

import grpc

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402
from refit import _rpc, handles, layout_io  # noqa: E402
from refit.dtypes import ELEMENT_BYTES  # noqa: E402
from refit._proto import layout_pb2, refit_pb2  # noqa: E402
from refit.tls import TlsFiles  # noqa: E402

from e2e_lib import Reports, commit_checked, data_address, layouts, names, start_policy_workers  # noqa: E402

F_GET_SEALS = 1034
F_SEAL_SHRINK = 0x0002

# One fp32 [8, 4] tensor, one buffer: what a hand-made registration declares.
SMALL = {
    "tensors": [{"name": "w", "shape": [8, 4], "dtype": "fp32"}],
    "workers": [{"name": "rank0", "node": 0, "gpu": 0, "buffers": [
        {"name": "w", "dtype": "fp32", "shape": [8, 4],
         "pieces": [{"tensor": "w", "tensorBox": {"origin": [0, 0], "shape": [8, 4]}}]}]}],
}
SMALL_BYTES = 8 * 4 * 4


def code_of(fn):
    """The gRPC code `fn` fails with (OK if it does not fail)."""
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


class AttackSuite(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # Certificates are read again every second (--tls-reload-interval): the rotation case.
        # --health-listen: the plaintext health port probes use.
        # --max-group-workers 8: the group-limit case (the policy group holds 4); --worker-listen:
        # workers over TCP, only with a --tls-workers certificate.
        cls.cluster = harness.Cluster(nodes=3, tls=True, daemon_flags=["--tls-reload-interval", "1",
                                                                       "--health-listen", "127.0.0.1:0",
                                                                       "--max-group-workers", "8",
                                                                       "--worker-listen", "127.0.0.1:0"])
        cls.certs = cls.cluster.certs
        cls.reports = Reports(cls.cluster)
        cls.files = layouts(cls.cluster)
        cls.engines = start_policy_workers(cls.cluster, cls.reports, cls.files)
        cls.trainer_ids = [f"policy/{w}" for w in names(cls.files["trainer"])]
        cls.ctl = refit.Controller(cls.cluster.control, tls=cls.tls("refit-operator"))
        cls.ctl.wait_ready("policy", timeout=30)
        cls.version = 0
        cls.channels = []

    @classmethod
    def tearDownClass(cls):
        cls.ctl.close()
        for c in cls.channels:
            c.close()
        cls.cluster.close()

    # ---------------------------------------------------------------------------------------
    @classmethod
    def tls(cls, name, rogue=False):
        d = os.path.join(cls.certs, "rogue") if rogue else cls.certs
        base = name if not name.startswith("refit-node-") else f"node-{name[len('refit-node-'):]}"
        return TlsFiles(os.path.join(d, f"{base}.pem"), os.path.join(d, f"{base}.key"),
                        os.path.join(cls.certs, "ca.pem"))

    def stub(self, address, service, identity=None, rogue=False, plaintext=False):
        if plaintext or address.startswith("unix:"):
            channel = grpc.insecure_channel(address)
        else:
            channel = refit.tls.channel(address, self.tls(identity, rogue))
        self.channels.append(channel)
        return _rpc.Stub(channel, service)

    def refit_still_works(self):
        """A legitimate round commits and every engine checked every byte of it."""
        type(self).version += 1
        commit_checked(self, self.ctl, self.reports, self.engines, self.version)

    def daemon(self, node):
        return self.cluster.daemons[node]

    def worker_socket(self, node):
        return self.daemon(node).worker_address

    def data_address(self, node):
        address = data_address(self.daemon(node))
        self.assertIsNotNone(address, "the daemon logs its data plane address")
        return address

    def register_by_hand(self, node, group, name, role=refit_pb2.TRAINER, fds=None, shm=None, worker=None,
                         tensors=None):
        """A registration made byte by byte, as a hostile local process would (not the library)."""
        layout = layout_pb2.Layout()
        from google.protobuf import json_format
        json_format.ParseDict(SMALL, layout)
        request = refit_pb2.RegisterWorkerRequest(group=group, role=role)
        request.worker.CopyFrom(worker if worker is not None else layout.workers[0])
        request.worker.name = name
        request.tensors.extend(tensors if tensors is not None else layout.tensors)
        request.memory.append(refit_pb2.BufferMemory(shm=shm))
        path = handles.handle_socket_path(self.worker_socket(node))
        request.fd_token = handles.deliver(path, fds or [])
        stub = self.stub(self.worker_socket(node), "RefitWorker")
        return stub.Register(request, timeout=10)

    # ---------------------------------------------------------------------------------------
    # Control: who may steer and look.

    def test_control_needs_a_certificate_of_the_cluster(self):
        control = self.cluster.control
        status = refit_pb2.StatusRequest()
        refit_request = refit_pb2.RefitRequest(group="policy", version=1 << 40)
        plain = self.stub(control, "RefitControl", plaintext=True)
        self.assertEqual(code_of(lambda: plain.Status(status, timeout=5)), grpc.StatusCode.UNAVAILABLE)
        # A server-authenticated channel without a client certificate: the handshake fails.
        with open(os.path.join(self.certs, "ca.pem"), "rb") as f:
            anonymous = grpc.secure_channel(control, grpc.ssl_channel_credentials(f.read()),
                                            options=[("grpc.ssl_target_name_override", "refitd")])
        self.channels.append(anonymous)
        self.assertEqual(code_of(lambda: _rpc.Stub(anonymous, "RefitControl").Status(status, timeout=5)),
                         grpc.StatusCode.UNAVAILABLE)
        # refitctl without a certificate says why the daemon hung up, not only "Socket closed".
        bare = {k: v for k, v in os.environ.items() if not k.startswith("REFIT_TLS_")}
        out = subprocess.run([harness.binary("refitctl"), "--daemon", control, "status"], capture_output=True,
                             text=True, timeout=60, env=bare)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("give --tls-cert, --tls-key and --tls-ca", out.stderr)
        rogue = self.stub(control, "RefitControl", "refit-operator", rogue=True)
        self.assertEqual(code_of(lambda: rogue.Refit(refit_request, timeout=5)), grpc.StatusCode.UNAVAILABLE)
        intruder = self.stub(control, "RefitControl", "intruder")
        self.assertEqual(code_of(lambda: intruder.Status(status, timeout=5)), grpc.StatusCode.PERMISSION_DENIED)
        self.assertEqual(code_of(lambda: intruder.Refit(refit_request, timeout=5)), grpc.StatusCode.PERMISSION_DENIED)
        self.refit_still_works()

    def test_viewers_look_but_do_not_steer(self):
        for node in (0, 1):  # the coordinator, and a node that would forward to it
            viewer = self.stub(self.daemon(node).address, "RefitControl", "refit-viewer")
            self.assertEqual(code_of(lambda: viewer.Status(refit_pb2.StatusRequest(), timeout=5)), grpc.StatusCode.OK)
            try:
                viewer.Refit(refit_pb2.RefitRequest(group="policy", version=1 << 40), timeout=5)
                self.fail("a viewer started a refit")
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.PERMISSION_DENIED)
                self.assertIn("refit-viewer", e.details())
            self.assertEqual(code_of(lambda: viewer.StartRefit(refit_pb2.RefitRequest(group="policy", version=1 << 40),
                                                               timeout=5)), grpc.StatusCode.PERMISSION_DENIED)
        self.refit_still_works()

    def test_the_plaintext_health_port_answers_health_only(self):
        text = open(self.daemon(1).log, errors="replace").read()
        found = re.findall(r"health \(plaintext, grpc.health.v1 only\) at (\S+)", text)
        self.assertTrue(found, "the daemon logs its health address")
        channel = grpc.insecure_channel(found[-1])
        self.channels.append(channel)
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
        self.assertEqual(check(b"", timeout=5), b"\x08\x01")  # status: SERVING
        service = b"refit.v1.RefitPeer"
        self.assertEqual(check(b"\x0a" + bytes([len(service)]) + service, timeout=5), b"\x08\x01")
        control = _rpc.Stub(channel, "RefitControl")
        self.assertEqual(code_of(lambda: control.Status(refit_pb2.StatusRequest(), timeout=5)),
                         grpc.StatusCode.UNIMPLEMENTED)
        self.assertEqual(code_of(lambda: control.Refit(refit_pb2.RefitRequest(group="policy", version=1 << 40),
                                                       timeout=5)), grpc.StatusCode.UNIMPLEMENTED)
        peer = _rpc.Stub(channel, "RefitPeer")
        self.assertEqual(code_of(lambda: peer.Join(refit_pb2.JoinRequest(node=1), timeout=5)),
                         grpc.StatusCode.UNIMPLEMENTED)

    def test_worker_socket_serves_no_peer_calls_and_no_steering(self):
        local_peer = self.stub(self.worker_socket(1), "RefitPeer")
        commit = refit_pb2.PhaseRequest(phase=refit_pb2.PhaseRequest.COMMIT, group="policy", round_id=1, version=1000)
        self.assertEqual(code_of(lambda: local_peer.RunPhase(commit, timeout=5)), grpc.StatusCode.UNIMPLEMENTED)
        local_control = self.stub(self.worker_socket(1), "RefitControl")
        self.assertEqual(code_of(lambda: local_control.Refit(refit_pb2.RefitRequest(group="policy", version=1 << 40),
                                                             timeout=5)), grpc.StatusCode.PERMISSION_DENIED)
        self.assertEqual(code_of(lambda: local_control.Status(refit_pb2.StatusRequest(), timeout=5)),
                         grpc.StatusCode.OK)
        # And the TCP port serves no workers: an operator's certificate cannot register one there.
        remote_worker = self.stub(self.daemon(1).address, "RefitWorker", "refit-operator")
        self.assertEqual(code_of(lambda: remote_worker.Register(refit_pb2.RegisterWorkerRequest(group="policy"),
                                                                timeout=5)), grpc.StatusCode.UNIMPLEMENTED)
        self.refit_still_works()

    def test_rotated_ca_files_take_effect_without_a_restart(self):
        """The CA bundle is replaced (a Kubernetes Secret updated): a certificate of the added CA
        is accepted within seconds, and refused again once that CA is taken out."""
        ca = os.path.join(self.certs, "ca.pem")
        with open(ca, "rb") as f:
            original = f.read()
        with open(os.path.join(self.certs, "rogue", "ca.pem"), "rb") as f:
            added = f.read()
        status = refit_pb2.StatusRequest()

        def rogue_status():
            return code_of(lambda: self.stub(self.cluster.control, "RefitControl", "refit-operator",
                                             rogue=True).Status(status, timeout=3))

        def replace(content):  # atomically, as the kubelet swaps a Secret's files
            with open(ca + ".tmp", "wb") as f:
                f.write(content)
            os.replace(ca + ".tmp", ca)

        self.assertEqual(rogue_status(), grpc.StatusCode.UNAVAILABLE)
        try:
            replace(original + added)
            harness.wait_for(lambda: rogue_status() == grpc.StatusCode.OK, 15,
                             "the added CA to be trusted without a restart")
        finally:
            replace(original)
        harness.wait_for(lambda: rogue_status() == grpc.StatusCode.UNAVAILABLE, 15,
                         "the removed CA to be distrusted again")
        self.refit_still_works()

    def test_watchers_that_leave_hold_no_threads(self):
        """WatchRounds through a node and on the worker socket, opened and dropped: the node's
        watches share one stream from the coordinator, so the coordinator holds no thread per
        watch; neither daemon keeps a thread once they leave; one caller gets at most 8 at once
        (64 on a daemon in all), the rest are RESOURCE_EXHAUSTED."""
        def threads(node):
            with open(f"/proc/{self.daemon(node).proc.pid}/status") as f:
                return int(next(l for l in f if l.startswith("Threads:")).split()[1])

        before = {n: threads(n) for n in (0, 1)}
        calls = []
        for i in range(40):
            address = self.worker_socket(1) if i % 2 else self.daemon(1).address
            stub = self.stub(address, "RefitControl", None if i % 2 else "refit-viewer")
            calls.append(stub.WatchRounds(refit_pb2.WatchRoundsRequest(group="policy"), timeout=60))
        # Open before they are dropped: node 1 has refused those past each caller's 8 and holds a
        # thread for each of the others. Node 0 serves them all through one stream: a few threads
        # at most (the stream and gRPC's pollers), never one per watch.
        held = 2 * 8

        def open_on_node():
            return sum(c.done() for c in calls) >= len(calls) - held and threads(1) >= before[1] + held
        try:
            harness.wait_for(open_on_node, 15, f"{held} watches to be open on node 1, the rest refused")
            time.sleep(1)  # let any per-watch work reach the coordinator
            self.assertLessEqual(threads(0), before[0] + 4, "the coordinator holds a thread per forwarded watch")
        except AssertionError as e:
            raise AssertionError(f"{e}: {sum(c.done() for c in calls)} of {len(calls)} ended; threads "
                                 f"{ {n: threads(n) for n in (0, 1)} }, before {before}") from None
        for c in calls:
            c.cancel()
        harness.wait_for(lambda: all(threads(n) <= before[n] + 8 for n in (0, 1)), 15,
                         f"the watchers' threads to end (before {before})")
        # The caps: one caller (here the refit-viewer certificate) at most 8 open at once; the
        # rest refused RESOURCE_EXHAUSTED.
        stub = self.stub(self.daemon(1).address, "RefitControl", "refit-viewer")
        opened = [stub.WatchRounds(refit_pb2.WatchRoundsRequest(group="policy"), timeout=60) for _ in range(80)]
        harness.wait_for(lambda: sum(c.done() for c in opened) >= 72, 15, "the watches past 8 to be refused")
        refused = [c for c in opened if c.done()]
        self.assertLessEqual(len(opened) - len(refused), 8)
        codes = [c.code() for c in refused]
        self.assertIn(grpc.StatusCode.RESOURCE_EXHAUSTED, codes)
        # Under load a few past the cap have ended CANCELLED instead (seen in CI, not understood
        # yet); none may have been served (OK) or refused otherwise.
        self.assertFalse([c for c in codes if c not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)],
                         codes)
        for c in opened:
            c.cancel()
        self.refit_still_works()

    def test_workers_over_tcp_need_a_worker_certificate(self):
        text = open(self.daemon(1).log, errors="replace").read()
        found = re.findall(r"workers are also served over TCP at (\S+) ", text)
        self.assertTrue(found, "the daemon logs its --worker-listen address")
        request = refit_pb2.RegisterWorkerRequest(group="policy", role=refit_pb2.INFERENCE)
        request.worker.name = "spy"  # refused before it could join the policy group
        for identity in ("intruder", "refit-viewer", "refit-operator"):
            remote = self.stub(found[-1], "RefitWorker", identity)
            try:
                remote.Register(request, timeout=5)
                self.fail(f"{identity} registered a worker over TCP")
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.PERMISSION_DENIED, (identity, e.details()))
                self.assertIn("--tls-workers", e.details())
        # A worker certificate passes the role check (in a group of its own, unregistered at once).
        worker = self.stub(found[-1], "RefitWorker", "refit-worker")
        request.group = "tcp-workers"
        try:
            response = worker.Register(request, timeout=5)
            worker.Unregister(refit_pb2.UnregisterWorkerRequest(worker_id=response.worker_id,
                                                                session_key=response.session_key), timeout=5)
        except grpc.RpcError as e:
            self.assertNotEqual(e.code(), grpc.StatusCode.PERMISSION_DENIED, e.details())
        self.refit_still_works()

    # ---------------------------------------------------------------------------------------
    # Peers: only the coordinator steers a node, only a node speaks for itself.

    def test_phases_straight_to_a_node_are_refused(self):
        target = self.daemon(1).address
        commit = refit_pb2.PhaseRequest(phase=refit_pb2.PhaseRequest.COMMIT, group="policy", round_id=1 << 40,
                                        version=1000)
        for identity in ("refit-operator", "refit-node-1", "refit-node-2"):
            peer = self.stub(target, "RefitPeer", identity)
            self.assertEqual(code_of(lambda: peer.RunPhase(commit, timeout=5)), grpc.StatusCode.PERMISSION_DENIED,
                             identity)
        # The coordinator's own certificate, stolen, without its incarnation.
        stolen = self.stub(target, "RefitPeer", "refit-node-0")
        self.assertEqual(code_of(lambda: stolen.RunPhase(commit, timeout=5)), grpc.StatusCode.FAILED_PRECONDITION)
        # The coordinator takes no phases over the network at all.
        at_coordinator = self.stub(self.cluster.control, "RefitPeer", "refit-node-1")
        self.assertEqual(code_of(lambda: at_coordinator.RunPhase(commit, timeout=5)),
                         grpc.StatusCode.PERMISSION_DENIED)
        self.refit_still_works()
        for key in self.engines:
            self.assertFalse([l for l in self.reports.lines(key) if l.startswith("commit 1000 ")],
                             f"{key} was told it holds version 1000")
        self.assertEqual(int(self.ctl.group("policy")["version"]), self.version)

    def test_a_plan_to_the_attackers_listener_is_refused(self):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.settimeout(0.1)
        try:
            status = self.ctl.status()
            plan = refit_pb2.InstallPlanRequest(group="policy", epoch=1 << 40)
            plan.nodes.add(node=1, data_address="127.0.0.1:%d" % listener.getsockname()[1])
            for identity in ("refit-operator", "refit-node-2"):
                peer = self.stub(self.daemon(1).address, "RefitPeer", identity)
                self.assertEqual(code_of(lambda: peer.InstallPlan(plan, timeout=5)),
                                 grpc.StatusCode.PERMISSION_DENIED, identity)
                transfer = refit_pb2.PhaseRequest(phase=refit_pb2.PhaseRequest.TRANSFER, group="policy",
                                                  round_id=1 << 40, epoch=1 << 40, timeout_ms=2000)
                self.assertEqual(code_of(lambda: peer.RunPhase(transfer, timeout=5)),
                                 grpc.StatusCode.PERMISSION_DENIED, identity)
            with self.assertRaises(socket.timeout):
                listener.accept()  # nobody sent the attacker anything
            self.assertTrue(status["nodes"])
        finally:
            listener.close()
        self.refit_still_works()

    def test_forged_joins_do_not_drop_a_nodes_workers(self):
        join = refit_pb2.JoinRequest(node=1, control_address="127.0.0.1:9", data_address="127.0.0.1:9",
                                     incarnation=12345)
        for identity in ("refit-node-2", "refit-operator", "intruder"):
            peer = self.stub(self.cluster.control, "RefitPeer", identity)
            for _ in range(5):
                self.assertEqual(code_of(lambda: peer.Join(join, timeout=5)), grpc.StatusCode.PERMISSION_DENIED,
                                 identity)
            sync = refit_pb2.SyncWorkersRequest(node=1, incarnation=12345)
            self.assertEqual(code_of(lambda: peer.SyncWorkers(sync, timeout=5)), grpc.StatusCode.PERMISSION_DENIED)
        # A node's own certificate cannot slip in workers of another node, or hostile names.
        node2 = self.stub(self.cluster.control, "RefitPeer", "refit-node-2")
        for node, name in ((1, "elsewhere"), (2, "bad\0name")):
            sync = refit_pb2.SyncWorkersRequest(node=2, incarnation=12345)
            w = sync.workers.add(group="policy", role=refit_pb2.INFERENCE)
            w.worker.name, w.worker.node = name, node
            self.assertEqual(code_of(lambda: node2.SyncWorkers(sync, timeout=5)), grpc.StatusCode.INVALID_ARGUMENT,
                             name)
        workers = {w["worker_id"] for w in self.ctl.workers("policy")}
        for key in self.engines:
            self.assertIn("policy/" + key[len("inference-"):], workers)
        self.refit_still_works()

    # ---------------------------------------------------------------------------------------
    # Workers: names belong to their sessions, memory goes by sealed descriptor.

    def test_an_impostor_cannot_take_a_trainers_name(self):
        local = self.stub(self.worker_socket(0), "RefitWorker")
        victim = self.trainer_ids[0]
        for key in ("", "0" * 32):
            try:
                local.Unregister(refit_pb2.UnregisterWorkerRequest(worker_id=victim, session_key=key), timeout=5)
                self.fail("a worker was unregistered without its session's key")
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.PERMISSION_DENIED, e.details())
        # The impostor declares exactly the victim's part of the layout, with memory of its own.
        worker, specs = layout_io.one_worker(self.files["trainer"], victim.split("/", 1)[1])
        sizes = [ELEMENT_BYTES[b.dtype] * prod(b.shape) for b in worker.buffers]
        fd = os.memfd_create("impostor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, sum(sizes))
            request = refit_pb2.RegisterWorkerRequest(group="policy", role=refit_pb2.TRAINER)
            request.worker.CopyFrom(worker)
            request.tensors.extend(specs)
            offset = 0
            for size in sizes:
                request.memory.append(refit_pb2.BufferMemory(shm=refit_pb2.SharedMemory(fd=1, offset=offset,
                                                                                        size=sum(sizes))))
                offset += size
            request.fd_token = handles.deliver(handles.handle_socket_path(self.worker_socket(0)), [fd])
            try:
                local.Register(request, timeout=10)
                self.fail("an impostor registered under a live trainer's name")
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.ALREADY_EXISTS, e.details())
        finally:
            os.close(fd)
        self.assertIn(victim, {w["worker_id"] for w in self.ctl.workers("policy")})
        self.refit_still_works()

    def test_memory_by_name_is_never_opened(self):
        name = f"/refit-victim-{os.getpid()}"
        path = "/dev/shm" + name
        secret = bytes(range(256)) * (SMALL_BYTES // 256 + 1)
        with open(path, "wb") as f:
            f.write(secret[:SMALL_BYTES])
        try:
            shm = refit_pb2.SharedMemory(name=name, offset=0, size=SMALL_BYTES)
            try:
                self.register_by_hand(1, "scratch", "reader", role=refit_pb2.INFERENCE, shm=shm)
                self.fail("a registration naming someone else's shared memory was accepted")
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.INVALID_ARGUMENT, e.details())
            with open(path, "rb") as f:
                self.assertEqual(f.read(), secret[:SMALL_BYTES])
        finally:
            os.unlink(path)
        self.refit_still_works()

    def test_a_registered_memfd_cannot_be_truncated_under_the_daemon(self):
        fd = os.memfd_create("shrinker", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)  # not sealed by us
        try:
            os.ftruncate(fd, SMALL_BYTES)
            shm = refit_pb2.SharedMemory(fd=1, offset=0, size=SMALL_BYTES)
            response = self.register_by_hand(1, "scratch", "shrinker", role=refit_pb2.INFERENCE, fds=[fd], shm=shm)
            self.assertTrue(fcntl.fcntl(fd, F_GET_SEALS) & F_SEAL_SHRINK, "the daemon sealed it against shrinking")
            with self.assertRaises(PermissionError):
                os.ftruncate(fd, 0)
            local = self.stub(self.worker_socket(1), "RefitWorker")
            local.Unregister(refit_pb2.UnregisterWorkerRequest(worker_id=response.worker_id,
                                                               session_key=response.session_key), timeout=5)
        finally:
            os.close(fd)
        # A descriptor that cannot be sealed (no MFD_ALLOW_SEALING) is refused outright.
        fd = os.memfd_create("unsealable", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, SMALL_BYTES)
            shm = refit_pb2.SharedMemory(fd=1, offset=0, size=SMALL_BYTES)
            try:
                self.register_by_hand(1, "scratch", "unsealable", role=refit_pb2.INFERENCE, fds=[fd], shm=shm)
                self.fail("an unsealable descriptor was accepted")
            except grpc.RpcError as e:
                self.assertEqual(e.code(), grpc.StatusCode.INVALID_ARGUMENT, e.details())
        finally:
            os.close(fd)
        self.assertIsNone(self.daemon(1).proc.poll(), "the daemon is alive")
        self.refit_still_works()

    def test_hostile_names_and_sizes(self):
        fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, SMALL_BYTES)
            for name in ("a\0b", "x" * 257, "bad\nname", ""):
                shm = refit_pb2.SharedMemory(fd=1, offset=0, size=SMALL_BYTES)
                try:
                    self.register_by_hand(1, "scratch", name, role=refit_pb2.INFERENCE, fds=[fd], shm=shm)
                    self.fail(f"name {name!r} was accepted")
                except grpc.RpcError as e:
                    self.assertEqual(e.code(), grpc.StatusCode.INVALID_ARGUMENT, (name, e.details()))
            for size in (-(1 << 63), (1 << 63) - 1):
                shm = refit_pb2.SharedMemory(fd=1, offset=0, size=size)
                try:
                    self.register_by_hand(1, "scratch", "sizes", role=refit_pb2.INFERENCE, fds=[fd], shm=shm)
                    self.fail(f"size {size} was accepted")
                except grpc.RpcError as e:
                    self.assertEqual(e.code(), grpc.StatusCode.INVALID_ARGUMENT, (size, e.details()))
        finally:
            os.close(fd)
        self.assertIsNone(self.daemon(1).proc.poll(), "the daemon is alive")
        self.refit_still_works()

    def test_a_registration_is_checked_before_it_is_decoded(self):
        """Register takes its request as bytes: what is not a RegisterWorkerRequest is refused
        naming it (gRPC's own answer was UNIMPLEMENTED with no message), and one that would decode
        into many times its size is refused before it is decoded. 32 MB of empty tensor entries
        took the node 1.4 GB, decoded by gRPC before any limit was looked at."""
        channel = grpc.insecure_channel(self.worker_socket(1), options=[("grpc.max_send_message_length", -1)])
        self.channels.append(channel)
        register = channel.unary_unary("/refit.v1.RefitWorker/Register")
        unregister = channel.unary_unary("/refit.v1.RefitWorker/Unregister")

        def refused(call, request):
            try:
                call(request, timeout=60)
            except grpc.RpcError as e:
                return e.code(), e.details()
            self.fail("accepted")

        for garbage in (b"\x0a\xff\xff\xff\xff\x0f", b"\x00", b"\xff" * 11, b"\x1a\x05\x0a"):
            self.assertEqual(refused(register, garbage),
                             (grpc.StatusCode.INVALID_ARGUMENT,
                              "register: the request is not a valid RegisterWorkerRequest encoding"), garbage)
        self.assertEqual(refused(unregister, b"\x0a\x09abc"),
                         (grpc.StatusCode.INVALID_ARGUMENT,
                          "unregister: the request is not a valid UnregisterWorkerRequest encoding"))

        pid = self.daemon(1).proc.pid

        def peak_above_now(request):
            """What sending `request` adds to the node's peak resident memory."""
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # the peak (VmHWM) starts again from the resident size now
            with open(f"/proc/{pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
            answer = refused(register, request)
            with open(f"/proc/{pid}/status") as f:
                hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
            return answer, hwm - rss

        empty_tensor = b"\x22\x00"
        many = empty_tensor * (16 << 20)  # 32 MB: 16M entries, past --max-registration-tensors
        (code, details), peak = peak_above_now(many)
        self.assertEqual(code, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
        self.assertIn("--max-registration-tensors", details)
        self.assertLess(peak, 4 * len(many) + (64 << 20), f"{peak / 1e6:.0f} MB above its size before")
        fewer = empty_tensor * 500000  # within every count: 1 MB that would decode into 50
        (code, details), peak = peak_above_now(fewer)
        self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, details)
        self.assertIn("most of it in tensors (500000 entries", details)
        self.assertIsNone(self.daemon(1).proc.poll(), "the daemon is alive")
        self.refit_still_works()

    def test_a_group_cannot_grow_past_its_limits(self):
        """Registrations on a node that is not the coordinator, past the coordinator's
        --max-group-workers: RESOURCE_EXHAUSTED naming the flag; the others keep working."""
        fds, registered = [], []
        try:
            for i in range(9):
                fd = os.memfd_create(f"crowd{i}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                fds.append(fd)
                os.ftruncate(fd, SMALL_BYTES)
                shm = refit_pb2.SharedMemory(fd=1, offset=0, size=SMALL_BYTES)
                try:
                    registered.append(self.register_by_hand(1, "crowd", f"w{i}", role=refit_pb2.INFERENCE, fds=[fd],
                                                            shm=shm))
                except grpc.RpcError as e:
                    self.assertEqual(i, 8, f"refused early: {e.details()}")
                    self.assertEqual(e.code(), grpc.StatusCode.RESOURCE_EXHAUSTED, e.details())
                    self.assertIn("--max-group-workers", e.details())
                    break
            else:
                self.fail("a ninth worker joined a group limited to 8")
        finally:
            local = self.stub(self.worker_socket(1), "RefitWorker")
            for r in registered:
                local.Unregister(refit_pb2.UnregisterWorkerRequest(worker_id=r.worker_id, session_key=r.session_key),
                                 timeout=5)
            for fd in fds:
                os.close(fd)
        self.refit_still_works()

    def test_another_uid_cannot_register(self):
        if os.getuid() == 0:
            # A process of another user (nobody) on the node: the socket's mode or --worker-uids stops it.
            script = (
                "import os, sys, grpc\n"
                "sys.path[:0] = %r\n"
                "from refit import handles, _rpc\n"
                "from refit._proto import refit_pb2\n"
                "os.setgid(65534); os.setuid(65534)\n"
                "try:\n"
                "    token = handles.deliver(%r, [])\n"
                "except Exception as e:\n"
                "    print('HANDLES', type(e).__name__, e); sys.exit(0)\n"
                "stub = _rpc.Stub(grpc.insecure_channel(%r), 'RefitWorker')\n"
                "try:\n"
                "    stub.Register(refit_pb2.RegisterWorkerRequest(group='policy', fd_token=token), timeout=5)\n"
                "    print('REGISTERED')\n"
                "except grpc.RpcError as e:\n"
                "    print('REFUSED', e.code().name, e.details())\n"
            ) % (sys.path, handles.handle_socket_path(self.worker_socket(1)), self.worker_socket(1))
            out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
            self.assertNotIn("REGISTERED", out.stdout, out.stdout + out.stderr)
            self.assertTrue(out.stdout.startswith("HANDLES") or "PERMISSION_DENIED" in out.stdout,
                            out.stdout + out.stderr)
        else:
            # Not root: a daemon that admits only another uid refuses this one.
            strict = harness.Daemon(self.cluster, 2, self.cluster.control, ["--worker-uids", "65534"])
            self.daemon(2).stop()
            strict.start()
            self.cluster.daemons[2] = strict
            fd = os.memfd_create("w", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, SMALL_BYTES)
                shm = refit_pb2.SharedMemory(fd=1, offset=0, size=SMALL_BYTES)
                try:
                    self.register_by_hand(2, "scratch", "other", role=refit_pb2.INFERENCE, fds=[fd], shm=shm)
                    self.fail("a uid not in --worker-uids registered")
                except grpc.RpcError as e:
                    self.assertEqual(e.code(), grpc.StatusCode.PERMISSION_DENIED, e.details())
            finally:
                os.close(fd)
        self.refit_still_works()

    # ---------------------------------------------------------------------------------------
    # The data plane: nothing lands from a connection that is not a daemon's.

    def test_forged_data_connections_land_nothing(self):
        host, port = self.data_address(1).rsplit(":", 1)
        frame = b"RFD1" + bytes(28) + b"policy" + b"\xff" * 4096  # a header, a group, garbage
        for _ in range(3):
            s = socket.create_connection((host, int(port)), timeout=5)
            try:
                s.sendall(frame)
                s.settimeout(5)
                try:
                    rest = s.recv(1)  # the daemon drops it: EOF, or a TLS alert
                except (ConnectionResetError, socket.timeout):
                    rest = b""
                self.assertNotEqual(rest, b"\x01")  # never the TLS server's "accepted" byte
            finally:
                s.close()
        self.refit_still_works()


if __name__ == "__main__":
    unittest.main()
