#!/usr/bin/env python3
"""The refit paths users run today, implemented as they implement them, on the same two GPUs.

Rank 0 (GPU 0) is the training side: every tensor of the model in TP=4 shards (all four trainer
ranks' shards on one GPU, as in refit's disaggregated run). Rank 1 (GPU 1) is the inference side:
TP=2 shards. Llama-style tensors from a Hugging Face config: column-parallel weights split on
dim 0, row-parallel on dim 1, the embedding and lm_head on the vocabulary, norms replicated.

  gather_broadcast      gather each tensor to trainer rank 0 (a local concatenation here), pack
                        into 1 GiB buckets, NCCL-broadcast each bucket to the inference rank,
                        which slices its shards out (OpenRLHF, verl, NeMo-RL's default path).
  per_tensor_send_recv  every trainer shard sent by its own NCCL send, received straight into
                        the inference shard where that slice is contiguous, else into a scratch
                        tensor and copied (no packing).
  nccl_send_recv_1GiB   the ceiling this PyTorch/NCCL pair reaches: one 1 GiB send/recv.

Inference shards are poisoned before every round and compared in full with the expected values
after it. Medians of --rounds after --warmup. One JSON line per result on stdout.

  python3 tests/bench/baselines.py --config tests/configs/llama3-8b.json [--rounds 5 --warmup 2]
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TRAIN_TP, INFER_TP = 4, 2
BUCKET_BYTES = 1 << 30
POISON = -7.0


def llama_tensors(cfg, layers):
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    out = [("embed_tokens", (vocab, h), 0)]
    for i in range(layers if layers else cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out += [(p + "q_proj", (heads * hd, h), 0), (p + "k_proj", (kv * hd, h), 0), (p + "v_proj", (kv * hd, h), 0),
                (p + "o_proj", (h, heads * hd), 1), (p + "gate_proj", (inter, h), 0), (p + "up_proj", (inter, h), 0),
                (p + "down_proj", (h, inter), 1), (p + "input_layernorm", (h,), None),
                (p + "post_attention_layernorm", (h,), None)]
    out += [("norm", (h,), None), ("lm_head", (vocab, h), 0)]
    return out


def full_tensor(index, shape, device):
    g = torch.Generator(device=device)
    g.manual_seed(1000 + index)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)


def shards(t, dim, parts):
    return [t.clone()] if dim is None else [c.contiguous() for c in torch.chunk(t, parts, dim)]


def timed(fn, rounds, warmup, check):
    times = []
    for r in range(warmup + rounds):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        if r >= warmup:
            times.append(time.perf_counter() - t0)
        check()
    return times


def worker(rank, args, queue):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2,
                            device_id=dev)
    cfg = json.load(open(args.config))
    tensors = llama_tensors(cfg, args.layers)
    total = sum(torch.Size(s).numel() * 2 for _, s, _ in tensors)
    if rank == 0:
        mine = [shards(full_tensor(i, s, dev), d, TRAIN_TP) for i, (_, s, d) in enumerate(tensors)]
    else:
        mine = [shards(torch.empty(s, dtype=torch.bfloat16, device=dev), d, INFER_TP) for _, s, d in tensors]
    results = []

    def poison():
        if rank == 1:
            for parts in mine:
                for p in parts:
                    p.fill_(POISON)

    def check():
        if rank == 1:
            for i, (name, s, d) in enumerate(tensors):
                want = shards(full_tensor(i, s, dev), d, INFER_TP)
                for a, b in zip(mine[i], want):
                    if not torch.equal(a, b):
                        raise SystemExit(f"baseline wrong: {name} differs after the round")
        poison()

    # The ceiling: one 1 GiB send/recv with the same library.
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)

    def one_send():
        dist.send(big, 1) if rank == 0 else dist.recv(big, 0)

    t = timed(one_send, args.rounds, args.warmup, lambda: None)
    results.append({"what": "nccl_send_recv_1GiB", "bytes": 1 << 30, "seconds": t,
                    "median_s": statistics.median(t), "gbps": (1 << 30) / statistics.median(t) / 1e9})
    del big

    # (a) gather to rank 0, bucketed broadcast, slice.
    bucket = torch.empty(BUCKET_BYTES // 2, dtype=torch.bfloat16, device=dev)

    def gather_broadcast():
        pending, used = [], 0

        def flush():
            nonlocal pending, used
            dist.broadcast(bucket[:used], src=0)
            if rank == 1:
                at = 0
                for i in pending:
                    _, s, d = tensors[i]
                    n = torch.Size(s).numel()
                    full = bucket[at:at + n].view(s)
                    at += n
                    if d is None:
                        for p in mine[i]:
                            p.copy_(full)
                    else:
                        for p, c in zip(mine[i], torch.chunk(full, INFER_TP, d)):
                            p.copy_(c)
            pending, used = [], 0

        for i, (_, s, d) in enumerate(tensors):
            n = torch.Size(s).numel()
            if used + n > bucket.numel():
                flush()
            if rank == 0:
                full = mine[i][0] if d is None else torch.cat(mine[i], d)
                bucket[used:used + n].copy_(full.reshape(-1))
            pending.append(i)
            used += n
        if pending:
            flush()

    poison()
    t = timed(gather_broadcast, args.rounds, args.warmup, check)
    results.append({"what": "gather_broadcast", "bytes": total, "bucket_bytes": BUCKET_BYTES, "seconds": t,
                    "median_s": statistics.median(t), "gbps": total / statistics.median(t) / 1e9})
    del bucket

    # (b) per-tensor send/recv of every shard.
    def per_tensor():
        for i, (_, s, d) in enumerate(tensors):
            if d is None:
                if rank == 0:
                    dist.send(mine[i][0], 1)
                else:
                    dist.recv(mine[i][0], 0)
                    for p in mine[i][1:]:
                        p.copy_(mine[i][0])
                continue
            per = TRAIN_TP // INFER_TP
            for j in range(TRAIN_TP):
                if rank == 0:
                    dist.send(mine[i][j], 1)
                    continue
                dst = mine[i][j // per]
                width = dst.shape[d] // per
                piece = dst.narrow(d, (j % per) * width, width)
                if piece.is_contiguous():
                    dist.recv(piece, 0)
                else:
                    scratch = torch.empty(piece.shape, dtype=piece.dtype, device=dev)
                    dist.recv(scratch, 0)
                    piece.copy_(scratch)

    t = timed(per_tensor, args.rounds, args.warmup, check)
    ops = sum(1 if d is None else TRAIN_TP for _, _, d in tensors)
    results.append({"what": "per_tensor_send_recv", "bytes": total, "operations": ops, "seconds": t,
                    "median_s": statistics.median(t), "gbps": total / statistics.median(t) / 1e9})
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--layers", type=int, default=0, help="keep this many layers (0: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("baselines: needs 2 GPUs")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    import queue as queues
    deadline = time.time() + 1800
    while True:  # a rank that fails must not leave us waiting on the other
        try:
            results = queue.get(timeout=5)
            break
        except queues.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or time.time() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit("baselines: a rank failed or the run passed 30 minutes")
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise SystemExit(f"baselines: rank exited with {p.exitcode}")
    for r in results:
        r["config"] = os.path.basename(args.config)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
