#!/usr/bin/env python3
"""The ceiling and the baseline of a colocated refit on one GPU, for the same layouts refit runs.

Given the trainer and engine layouts of a colocated refit (every worker on GPU 0, as
tests/gpu/colocated_bench.sh writes them), allocates every buffer of both sides on the GPU and
times, with CUDA events, medians of --rounds after --warmup:

  ceiling        one device-to-device copy_ of as many bytes as the engines' pieces hold (the
                 copy engine's rate for these bytes: what no refit of them can beat);
  per_piece      the loop users write today: for every engine parameter piece and every trainer
                 piece of the same tensor, dst[overlap].copy_(src[overlap]) (PyTorch views, one
                 copy_ per overlap, Python overhead included).

The per-piece result is checked: engine buffers are poisoned first and every piece compared with
its trainer values afterwards. One JSON line on stdout.

  python3 tests/bench/local_path_bench.py --source t.json --destination i.json [--rounds 7]
"""
import argparse
import json
import statistics
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int8": torch.int8,
          "int32": torch.int32, "int64": torch.int64}


def load(path):
    with open(path) as f:
        layout = json.load(f)
    tensors = {t["name"]: (list(t.get("shape", [])), t["dtype"]) for t in layout["tensors"]}
    buffers = []  # (name, dtype, shape, pieces: [(tensor, origin, shape, borigin, bshape)])
    for w in layout["workers"]:
        if w.get("buffers_like") or w.get("buffersLike"):
            raise SystemExit(f"{path}: compact layouts (buffers_like) are not read here")
        for b in w.get("buffers", []):
            shape = list(b.get("shape", []))
            pieces = []
            for p in b.get("pieces", []):
                tshape = tensors[p["tensor"]][0]
                # proto3 JSON: either spelling of the field names.
                tb = p.get("tensor_box") or p.get("tensorBox") or {"origin": [0] * len(tshape), "shape": tshape}
                bb = p.get("buffer_box") or p.get("bufferBox") or {"origin": [0] * len(shape), "shape": shape}
                pieces.append((p["tensor"], [int(x) for x in tb.get("origin", [])], [int(x) for x in tb.get("shape", [])],
                               [int(x) for x in bb.get("origin", [])], [int(x) for x in bb.get("shape", [])]))
            buffers.append((w["name"] + "/" + b["name"], b["dtype"], shape, pieces))
    return tensors, buffers


def views(buffers, device):
    """Allocates each buffer; returns {tensor: [(origin, shape, view)]}."""
    out, memory = {}, []
    for _, dtype, shape, pieces in buffers:
        n = 1
        for s in shape:
            n *= s
        mem = torch.empty(n, dtype=DTYPES[dtype], device=device)
        memory.append(mem)
        full = mem.view(shape) if shape else mem
        for tensor, origin, tshape, borigin, bshape in pieces:
            sub = full[tuple(slice(o, o + s) for o, s in zip(borigin, bshape))] if bshape else full
            out.setdefault(tensor, []).append((origin, tshape, sub.view(tshape)))
    return out, memory


def overlaps(src, dst):
    """(dst view region, src view region) for every overlap of a destination and a source piece."""
    pairs = []
    for tensor, pieces in dst.items():
        for dorigin, dshape, dview in pieces:
            for sorigin, sshape, sview in src[tensor]:
                lo = [max(a, b) for a, b in zip(dorigin, sorigin)]
                hi = [min(a + x, b + y) for a, x, b, y in zip(dorigin, dshape, sorigin, sshape)]
                if any(h <= l for l, h in zip(lo, hi)):
                    continue
                d = dview[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, dorigin))]
                s = sview[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, sorigin))]
                pairs.append((d, s))
    return pairs


def timed(fn, rounds, warmup, idle_s=0.0):
    """Seconds of fn() per round; ``idle_s``: the GPU left idle that long before each round, as
    between refit rounds in colocated_bench.sh (clocks may drop while idle)."""
    times = []
    if not torch.cuda.is_available():  # a dry run on a CPU machine
        for i in range(warmup + rounds):
            t = time.perf_counter()
            fn()
            if i >= warmup:
                times.append(time.perf_counter() - t)
        return times
    for i in range(warmup + rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if idle_s:
            time.sleep(idle_s)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--destination", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--label", default="")
    ap.add_argument("--idle-s", type=float, default=0.0,
                    help="also time the ceiling after the GPU idled this long (3 rounds)")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    _, src_buffers = load(args.source)
    _, dst_buffers = load(args.destination)
    src, src_memory = views(src_buffers, device)
    dst, dst_memory = views(dst_buffers, device)
    for m in src_memory:
        if m.is_floating_point():
            m.uniform_(-1, 1)
        else:
            m.random_(0, 100)
    pairs = overlaps(src, dst)
    nbytes = sum(d.numel() * d.element_size() for d, _ in pairs)

    # The ceiling: one copy of as many bytes.
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_(0, 255)
    ceiling = timed(lambda: b.copy_(a), args.rounds, args.warmup)
    ceiling_idle = timed(lambda: b.copy_(a), 3, 0, idle_s=args.idle_s) if args.idle_s else []
    del a, b

    def per_piece():
        for d, s in pairs:
            d.copy_(s)

    for m in dst_memory:
        m.fill_(-7 if m.is_floating_point() else 7)
    baseline = timed(per_piece, args.rounds, args.warmup)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wrong = sum(1 for d, s in pairs if not torch.equal(d, s.to(d.dtype)))
    if wrong:
        raise SystemExit(f"per-piece baseline: {wrong} of {len(pairs)} overlaps differ after the copy")
    print(json.dumps({"bench": "local_path", "label": args.label, "bytes": nbytes, "copies": len(pairs),
                      "rounds": args.rounds, "warmup": args.warmup, "ceiling_s": ceiling,
                      "median_ceiling_s": statistics.median(ceiling), "per_piece_s": baseline,
                      "median_per_piece_s": statistics.median(baseline),
                      "ceiling_gbps": nbytes / statistics.median(ceiling) / 1e9,
                      "ceiling_after_idle_s": ceiling_idle, "idle_s": args.idle_s,
                      "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}))


if __name__ == "__main__":
    main()
