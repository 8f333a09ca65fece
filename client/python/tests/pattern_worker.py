#!/usr/bin/python3
"""A Python trainer or engine process for the tests (the Python counterpart of sim-worker): one
worker of a layout file, its tensors in shared memory (torch where present, else numpy).
Trainer: on PREPARE(v) writes version v's pattern into its tensors (the "optimizer step").
Engine: poisons its tensors at PREPARE; on COMMIT(v) checks every byte. One line per event goes
to --report ("registered", "prepare V", "commit V ok N", "commit V FAIL ...", "abort ...",
"disconnected ...", "reconnected").

Delays, for tests that must catch a round in PREPARE or COMMIT: --prepare-delay / --commit-delay
(seconds slept inside on_prepare / on_commit), or --delay-file, a JSON object read at every event
({"prepare": 2.0, "commit": 0}; missing or unreadable: the flags' values), so that a long-lived
worker can be made slow for one round. A delayed callback reports "begin-prepare V" /
"begin-commit V" when it starts.

    pattern_worker.py --daemon unix:/tmp/refitd-1.sock --role inference --layout e.json --worker W
"""
import argparse
import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import refit  # noqa: E402
from refit import layout_io, pattern  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--daemon", required=True)
    ap.add_argument("--group", default="policy")
    ap.add_argument("--role", required=True, choices=["trainer", "inference"])
    ap.add_argument("--layout", required=True)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--refuse", default="", help="refuse every PREPARE with this reason")
    ap.add_argument("--blocking", action="store_true", help="serve rounds from the main thread")
    ap.add_argument("--numpy", action="store_true", help="numpy arrays even where torch exists")
    ap.add_argument("--device", default="cpu", help="cpu (shared memory) or cuda (this process's cuda:0)")
    ap.add_argument("--alloc", default="separate", choices=["separate", "interior"],
                    help="cuda: one torch.empty per tensor, or every tensor a view inside one allocation")
    ap.add_argument("--prepare-delay", type=float, default=0.0, help="seconds to sleep in on_prepare")
    ap.add_argument("--commit-delay", type=float, default=0.0, help="seconds to sleep in on_commit")
    ap.add_argument("--delay-file", default="",
                    help='JSON {"prepare": S, "commit": S} read at every event; overrides the delay flags')
    args = ap.parse_args()
    lock = threading.Lock()

    def report(line):
        with lock, open(args.report, "a") as f:
            f.write(line + "\n")

    def delay(kind, version):
        seconds = args.prepare_delay if kind == "prepare" else args.commit_delay
        if args.delay_file:
            try:
                with open(args.delay_file) as f:
                    seconds = float(json.load(f).get(kind, seconds) or 0)
            except (OSError, ValueError, AttributeError):
                pass
        if seconds > 0:
            report(f"begin-{kind} {version}")
            time.sleep(seconds)

    worker_proto, specs = layout_io.one_worker(args.layout, args.worker)
    total = sum(256 + 8 * max(1, int(__import__("math").prod(b.shape))) for b in worker_proto.buffers) + 4096
    mirror = None  # cuda: host copies for filling and checking
    if args.device == "cuda":
        import torch
        from refit import dtypes
        mirror = {b.name: torch.empty(tuple(b.shape), dtype=dtypes.torch_dtype(b.dtype)) for b in worker_proto.buffers}
        if args.alloc == "interior":  # as a caching allocator hands out pieces of one segment
            sizes = [(m.numel() * m.element_size() + 511) // 512 * 512 for m in mirror.values()]
            blob = torch.empty(sum(sizes) + 512, dtype=torch.uint8, device="cuda")
            tensors, at = {}, 512
            for (name, m), size in zip(mirror.items(), sizes):
                n = m.numel() * m.element_size()
                tensors[name] = blob[at:at + n].view(m.dtype).view(m.shape)
                at += size
        else:
            tensors = {name: torch.empty_like(m, device="cuda") for name, m in mirror.items()}
    else:
        if args.numpy:
            refit.shm.dtypes.have_torch = lambda: False
        arena = refit.SharedArena(total)
        tensors = {b.name: arena.empty(tuple(b.shape), b.dtype) for b in worker_proto.buffers}

    def to_device():
        if mirror is not None:
            for name, m in mirror.items():
                tensors[name].copy_(m)
            __import__("torch").cuda.synchronize()

    def to_host():
        if mirror is not None:
            __import__("torch").cuda.synchronize()
            for name, m in mirror.items():
                m.copy_(tensors[name])

    host = mirror if mirror is not None else tensors
    if args.role == "inference":
        pattern.poison(host)
        to_device()

    def on_prepare(version):
        delay("prepare", version)
        if args.refuse:
            raise RuntimeError(args.refuse)
        if args.role == "trainer":
            pattern.fill(worker_proto, specs, host, seed=version)
        else:
            pattern.poison(host)
        to_device()
        report(f"prepare {version}")

    def on_commit(version):
        delay("commit", version)
        if args.role == "trainer":
            report(f"commit {version}")
            return
        try:
            to_host()
            n = pattern.check(worker_proto, specs, host, seed=version)
            report(f"commit {version} ok {n}")
        except AssertionError as e:
            report(f"commit {version} FAIL {e}")

    worker = refit.Worker(args.daemon, args.group, args.role, args.layout, tensors, name=args.worker,
                          on_prepare=on_prepare, on_commit=on_commit,
                          on_abort=lambda reason: report(f"abort {reason}"),
                          on_disconnect=lambda reason: report(f"disconnected {reason}"),
                          on_reconnect=lambda: report("reconnected"), blocking=args.blocking)
    report(f"registered {worker.worker_id}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    while not stop.is_set():
        if args.blocking:
            r = worker.serve(timeout=0.2)
            if r is not None:
                report(f"served {r.round_id} {'committed' if r.committed else 'aborted'} {r.version}")
        else:
            time.sleep(0.1)
    worker.close()


if __name__ == "__main__":
    main()
