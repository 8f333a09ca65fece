#!/usr/bin/python3
"""A Python trainer or engine process for the tests (the Python counterpart of sim-worker): one
worker of a layout file, its tensors in shared memory (torch where present, else numpy).
Trainer: on PREPARE(v) writes version v's pattern into its tensors (the "optimizer step").
Engine: poisons its tensors at PREPARE; on COMMIT(v) checks every byte. One line per event goes
to --report ("registered", "prepare V", "commit V ok N", "commit V FAIL ...", "abort ...",
"disconnected ...", "reconnected").

    pattern_worker.py --daemon unix:/tmp/refitd-1.sock --role inference --layout e.json --worker W
"""
import argparse
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
    args = ap.parse_args()
    lock = threading.Lock()

    def report(line):
        with lock, open(args.report, "a") as f:
            f.write(line + "\n")

    worker_proto, specs = layout_io.one_worker(args.layout, args.worker)
    total = sum(256 + 8 * max(1, int(__import__("math").prod(b.shape))) for b in worker_proto.buffers) + 4096
    if args.numpy:
        refit.shm.dtypes.have_torch = lambda: False
    arena = refit.SharedArena(total)
    tensors = {b.name: arena.empty(tuple(b.shape), b.dtype) for b in worker_proto.buffers}
    if args.role == "inference":
        pattern.poison(tensors)

    def on_prepare(version):
        if args.refuse:
            raise RuntimeError(args.refuse)
        if args.role == "trainer":
            pattern.fill(worker_proto, specs, tensors, seed=version)
        else:
            pattern.poison(tensors)
        report(f"prepare {version}")

    def on_commit(version):
        if args.role == "trainer":
            report(f"commit {version}")
            return
        try:
            n = pattern.check(worker_proto, specs, tensors, seed=version)
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
