"""Large registrations on a node that is not the coordinator, while rounds go on: each travels to
the coordinator once (as a change to the node's list, not the node's whole list again), the node's
heartbeats go on while it travels, and a node declared dead (stopped with SIGSTOP past the verdict)
names its list on its return instead of sending it again. Six legal registrations of 10^6 pieces
used to knock a node out for good: each sent the whole list again (24, 48, ... 144 MB), the
heartbeats waited behind a sync that outlived --peer-timeout, the node was declared dead, and its
resync, as slow, had it declared dead again, forever.

Two daemons (harness heartbeats: 0.2 s, declared dead after 1 s), a trainer on node 0 and an
engine on node 1 (Python pattern workers that check every destination byte at every commit), and
registrations of many one-element pieces on node 1, each in a group of its own, each holding its
session open. The coordinator counts what it received in syncs (refit_membership_synced_bytes_total).
"""
import os
import queue
import re
import signal
import sys
import threading
import time
import unittest
import urllib.request

import grpc

import harness

sys.path.insert(0, os.path.dirname(harness.HERE))
import refit  # noqa: E402
from refit import _rpc, handles  # noqa: E402
from refit._proto import refit_pb2  # noqa: E402

from e2e_lib import Reports, commit_checked, layouts, start_policy_workers  # noqa: E402

PIECES = 200_000  # about 4.8 MB a registration
WORKERS = 4


def varint(v):
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def field(number, payload):
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def worker_encoding(name, pieces):
    """A Worker with one fp32 buffer "w" of `pieces` elements, one piece per element: encoded by
    hand (building 10^5 messages in Python takes minutes)."""
    def box(i):
        return field(1, varint(i)) + field(2, varint(1))  # origin [i], shape [1]
    piece_list = b"".join(field(4, b"\x20\x01" + field(2, box(i)) + field(3, box(i))) for i in range(pieces))
    buffer = field(1, b"w") + field(2, b"fp32") + field(3, varint(pieces)) + piece_list
    return field(1, name.encode()) + field(4, buffer)


def metric(address, name):
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


class LargeRegistrationSuite(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = harness.Cluster(nodes=2, tls=False, daemon_flags=["--metrics-listen", "127.0.0.1:0"])
        cls.reports = Reports(cls.cluster)
        cls.files = layouts(cls.cluster)
        cls.engines = start_policy_workers(cls.cluster, cls.reports, cls.files)
        cls.ctl = refit.Controller(cls.cluster.control)
        cls.ctl.wait_ready("policy", timeout=30)
        cls.version = 0
        cls.channel = grpc.insecure_channel(cls.cluster.daemons[1].worker_address,
                                            options=[("grpc.max_send_message_length", -1)])
        cls.sessions = []

    @classmethod
    def tearDownClass(cls):
        for q, _ in cls.sessions:
            q.put(None)
        cls.channel.close()
        cls.ctl.close()
        cls.cluster.close()

    def refit_still_works(self):
        type(self).version += 1
        commit_checked(self, self.ctl, self.reports, self.engines, self.version)

    def metrics_address(self, node):
        with open(self.cluster.daemons[node].log, errors="replace") as f:
            return re.search(r"metrics at http://(\S+)/metrics", f.read()).group(1)

    def synced_bytes(self):
        return metric(self.metrics_address(0), "refit_membership_synced_bytes_total")

    def register_large(self, k):
        """Registers worker "big/w" of group "big<k>" on node 1 and holds its session open; returns
        the registration's size."""
        stub = _rpc.Stub(self.channel, "RefitWorker")
        socket_path = self.cluster.daemons[1].socket
        fd = os.memfd_create("large", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 4 * PIECES)
            token = handles.deliver(socket_path + ".handles", [fd])
        finally:
            os.close(fd)
        request = refit_pb2.RegisterWorkerRequest(group=f"big{k}", role=refit_pb2.INFERENCE, fd_token=token,
                                                  worker_encoded=worker_encoding("w", PIECES))
        request.tensors.add(name="w", shape=[PIECES], dtype="fp32")
        request.memory.add().shm.CopyFrom(refit_pb2.SharedMemory(offset=0, size=4 * PIECES, fd=1))
        answer = stub.Register(request, timeout=120)
        q = queue.Queue()
        q.put(refit_pb2.WorkerMessage(hello=answer.worker_id, session_key=answer.session_key))

        def messages():
            while True:
                m = q.get()
                if m is None:
                    return
                yield m
        stream = stub.Session(messages())

        def drain():
            try:
                for _ in stream:
                    pass
            except grpc.RpcError:
                pass  # ended when the test closes its channel
        threading.Thread(target=drain, daemon=True).start()
        self.sessions.append((q, stream))
        return request.ByteSize()

    def verdicts_on_node1(self):
        with open(self.cluster.daemons[0].log, errors="replace") as f:
            return len(re.findall(r"node 1 \(\S+\) is dead", f.read()))

    def node1_workers(self):
        status = self.ctl.status()
        return next((n.get("workers", 0) for n in status.get("nodes", [])
                     if n.get("node") == 1 and n.get("alive")), -1)

    def test_large_registrations_travel_once_and_a_revived_node_names_its_list(self):
        self.refit_still_works()
        before = self.synced_bytes()
        self.assertIsNotNone(before, "the coordinator serves refit_membership_synced_bytes_total")
        sizes = []
        for k in range(WORKERS):
            sizes.append(self.register_large(k))
            self.refit_still_works()
        received = self.synced_bytes() - before
        # Each once (and a little for the engine's own re-registrations, if any); the whole list
        # each time would be 1 + 2 + 3 + 4 = 10 registrations' worth.
        self.assertLess(received, 1.5 * sum(sizes), f"{received:.0f} bytes received for registrations of {sizes}")
        self.assertEqual(self.verdicts_on_node1(), 0, "node 1 was declared dead while it registered")
        workers = self.node1_workers()
        self.assertEqual(workers, WORKERS + len(self.engines))

        # Frozen past the verdict: declared dead once, then back with its list, not a resend of it.
        before = self.synced_bytes()
        node1 = self.cluster.daemons[1].proc
        node1.send_signal(signal.SIGSTOP)
        try:
            harness.wait_for(lambda: self.verdicts_on_node1() == 1, 10, "node 1 to be declared dead")
        finally:
            node1.send_signal(signal.SIGCONT)
        harness.wait_for(lambda: self.node1_workers() == workers, 10, "node 1 to be back with its workers")
        self.assertLess(self.synced_bytes() - before, sizes[0] / 2, "the list was sent again")
        with open(self.cluster.daemons[0].log, errors="replace") as f:
            self.assertIn("kept while it was dead is back", f.read())
        time.sleep(3)  # 3 verdicts' time: it stays alive
        self.assertEqual(self.verdicts_on_node1(), 1, "node 1 was declared dead again")
        self.refit_still_works()


if __name__ == "__main__":
    unittest.main()
