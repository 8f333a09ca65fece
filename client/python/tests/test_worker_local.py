"""The Python client without a daemon: tensors checked against the layout, shared memory,
the handle socket protocol as a client speaks it, reasons parsed into phase and culprit."""
import os
import socket
import struct
import sys
import tempfile
import threading
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import refit  # noqa: E402
from refit import controller, export, handles, layout_io, shm  # noqa: E402
from refit.worker import check_tensors  # noqa: E402

try:
    import torch
except ImportError:  # numpy only
    torch = None

LAYOUT = {
    "tensors": [{"name": "w", "shape": [8, 4], "dtype": "fp32"}, {"name": "b", "shape": [8], "dtype": "fp32"}],
    "workers": [{"name": "rank0", "node": 0, "gpu": 0, "buffers": [
        {"name": "w", "dtype": "fp32", "shape": [4, 4],
         "pieces": [{"tensor": "w", "tensorBox": {"origin": [0, 0], "shape": [4, 4]}}]},
        {"name": "b", "dtype": "fp32", "shape": [8], "pieces": [{"tensor": "b"}]}]}],
}


class CheckTensors(unittest.TestCase):
    def setUp(self):
        self.worker, self.specs = layout_io.one_worker(LAYOUT)
        self.arena = refit.SharedArena(1 << 16)

    def tearDown(self):
        self.arena.close()

    def test_matching_tensors_pass_in_layout_order(self):
        t = {"b": self.arena.empty((8,), "fp32"), "w": self.arena.empty((4, 4), "fp32")}
        pairs = check_tensors(self.worker, self.specs, t)
        self.assertEqual([n for n, _ in pairs], ["w", "b"])

    def test_each_mismatch_is_named(self):
        cases = [
            ({"w": self.arena.empty((4, 5), "fp32"), "b": self.arena.empty((8,), "fp32")}, "parameter 'w' has shape [4, 5]"),
            ({"w": self.arena.empty((4, 4), "fp16"), "b": self.arena.empty((8,), "fp32")}, "parameter 'w' is fp16"),
            ({"w": self.arena.empty((4, 4), "fp32")}, "buffer 'b' of the layout has no tensor"),
            ({"w": self.arena.empty((4, 4), "fp32"), "b": self.arena.empty((8,), "fp32"),
              "rotary.inv_freq": self.arena.empty((2,), "fp32")}, "'rotary.inv_freq'"),
        ]
        for tensors, message in cases:
            with self.subTest(message=message):
                with self.assertRaises(refit.RegistrationError) as e:
                    check_tensors(self.worker, self.specs, tensors)
                self.assertIn(message, str(e.exception))

    def test_non_contiguous_is_refused(self):
        big = self.arena.empty((4, 8), "fp32")
        view = big[:, ::2]
        with self.assertRaises(refit.RegistrationError) as e:
            check_tensors(self.worker, self.specs, {"w": view, "b": self.arena.empty((8,), "fp32")})
        self.assertIn("not contiguous", str(e.exception))

    def test_layout_with_several_workers_needs_a_name(self):
        two = dict(LAYOUT, workers=LAYOUT["workers"] + [dict(LAYOUT["workers"][0], name="rank1")])
        with self.assertRaises(ValueError) as e:
            layout_io.one_worker(two)
        self.assertIn("say which one", str(e.exception))
        with self.assertRaises(ValueError) as e:
            layout_io.one_worker(two, "rank7")
        self.assertIn("no worker 'rank7'", str(e.exception))
        self.assertEqual(layout_io.one_worker(two, "rank1")[0].name, "rank1")


class SharedMemory(unittest.TestCase):
    def test_private_memory_is_refused_with_the_fix(self):
        private = np.zeros((4, 4), np.float32) if torch is None else torch.zeros(4, 4)
        with self.assertRaises(export.ExportError) as e:
            export.export_buffers([("w", private)])
        self.assertIn("refit.share_module_", str(e.exception))

    def test_interior_views_are_offsets_of_one_memfd(self):
        arena = refit.SharedArena(1 << 20)
        try:
            a = arena.empty((100,), "fp32")
            b = arena.empty((10, 10), "bf16")
            out = export.export_buffers([("a", a), ("b", b), ("b_rows", b[2:4])])
            self.assertEqual(len(out.fds), 1)  # one descriptor for the whole arena
            offsets = [m.shm.offset for m in out.memory]
            self.assertEqual(offsets[0] % 256, 0)
            self.assertEqual(offsets[1] % 256, 0)
            self.assertEqual(offsets[2], offsets[1] + 2 * 10 * 2)
            self.assertTrue(all(m.shm.fd == 1 and m.shm.size == arena.nbytes for m in out.memory))
            # Sealed: nobody can shrink it under the daemon's mapping.
            with self.assertRaises(OSError):
                os.ftruncate(arena.fd, 4096)
        finally:
            arena.close()

    def test_arena_full_says_so(self):
        arena = refit.SharedArena(1024)
        with self.assertRaises(MemoryError):
            arena.empty((1024,), "fp32")
        arena.close()

    @unittest.skipIf(torch is None, "needs torch")
    def test_share_module_moves_parameters_and_keeps_ties(self):
        m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
        m[1].weight = m[0].weight  # tied
        before = m[0].weight.detach().clone()
        arena = refit.share_module_(m)
        self.assertTrue(torch.equal(m[0].weight, before))
        self.assertEqual(m[0].weight.data_ptr(), m[1].weight.data_ptr())
        self.assertIsNotNone(shm.find_arena(m[0].weight.data_ptr(), 160)[0])
        arena.close()


    @unittest.skipIf(torch is None, "needs torch")
    def test_fp8_codes_held_as_bytes_are_shared_as_bytes(self):
        # An fp8 engine on a PyTorch without float8 dtypes holds its codes as torch.uint8: shared
        # as bytes (never cast), and accepted as fp8 storage; an arena gives fp8 tensors of either.
        m = torch.nn.Module()
        codes = torch.tensor([[0x7E, 0x01, 0xFF, 0x80]], dtype=torch.uint8)
        m.w = torch.nn.Parameter(codes.clone(), requires_grad=False)
        arena = refit.share_module_(m)
        self.assertEqual(m.w.dtype, torch.uint8)
        self.assertTrue(torch.equal(m.w.data, codes))
        self.assertIsNotNone(shm.find_arena(m.w.data_ptr(), 4)[0])
        self.assertTrue(refit.dtypes.matches(m.w.data, "fp8_e4m3"))
        t = refit.SharedArena(4096).empty((2, 3), "fp8_e4m3")
        self.assertEqual(t.element_size(), 1)
        self.assertTrue(refit.dtypes.matches(t, "fp8_e4m3"))
        arena.close()


class HandleSocket(unittest.TestCase):
    """A stand-in daemon end of the handle socket: what the client sends is what daemon/README.md
    says, and the descriptors arrive in order."""

    def serve(self, reply):
        path = os.path.join(tempfile.mkdtemp(), "refitd.sock.handles")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        srv.bind(path)
        srv.listen(1)
        got = {"packets": [], "fds": []}

        def run():
            conn, _ = srv.accept()
            while True:
                data, fds, _, _ = socket.recv_fds(conn, 1024, 300)
                got["packets"].append(data)
                got["fds"].extend(fds)
                if struct.unpack("<I", data[40:44])[0] & 1:
                    break
            conn.send(reply(len(got["fds"])))
            conn.close()
            srv.close()

        t = threading.Thread(target=run)
        t.start()
        return path, got, t

    def test_descriptors_arrive_in_order_over_several_packets(self):
        path, got, t = self.serve(lambda n: b"OK\0\0" + struct.pack("<I", n))
        fds = [os.memfd_create(f"t{i}") for i in range(300)]
        for i, fd in enumerate(fds):
            os.write(fd, str(i).encode())
        token = handles.deliver(path, fds)
        t.join()
        self.assertEqual(len(token), 32)
        self.assertEqual(len(got["packets"]), 2)
        for data in got["packets"]:
            self.assertEqual(len(data), 44)
            self.assertEqual(data[:4], b"RFH1")
            self.assertEqual(data[4:36].decode(), token)
        self.assertEqual([struct.unpack("<I", p[36:40])[0] for p in got["packets"]], [250, 50])
        for i, fd in enumerate(got["fds"]):
            os.lseek(fd, 0, 0)
            self.assertEqual(os.read(fd, 8), str(i).encode())
        handles.close_all(fds + got["fds"])

    def test_a_refusal_is_raised_with_its_message(self):
        msg = b"too many handles"
        path, got, t = self.serve(lambda n: b"ER\0\0" + struct.pack("<I", len(msg)) + msg)
        fd = os.memfd_create("x")
        with self.assertRaises(handles.HandoverError) as e:
            handles.deliver(path, [fd])
        t.join()
        self.assertIn("too many handles", str(e.exception))
        handles.close_all([fd] + got["fds"])

    def test_no_daemon_is_a_clear_error(self):
        with self.assertRaises(handles.HandoverError) as e:
            handles.deliver("/nonexistent/refitd.sock.handles", [])
        self.assertIn("is refitd running", str(e.exception))


class Reasons(unittest.TestCase):
    def test_phase_and_culprit(self):
        cases = [
            ('node 1: worker "policy/vllm-dp0-tp0" did not confirm PREPARE of group "policy" within 10s',
             ("PREPARE", 'worker "policy/vllm-dp0-tp0"')),
            ("node 3 still waits for messages from node 0 (TRANSFER)", ("TRANSFER", "node 3")),
            ("something else", (None, None)),
        ]
        for reason, want in cases:
            self.assertEqual(controller.parse_reason(reason), want)


if __name__ == "__main__":
    unittest.main()
