#!/usr/bin/python3
"""Plots for docs/BENCHMARKS.md from the machine-readable results in a docs/runs folder.

  /usr/bin/python3 tools/plot_bench.py docs/runs/2026-11-30-s8 docs/img   (Debian's python3-matplotlib)
  /usr/bin/python3 tools/plot_bench.py --scaling docs/img/h200x2-scaling-s10.png \
      --ceilings docs/runs/2026-11-30-s10/callA/ceilings.jsonl \
      --baselines docs/runs/2026-11-30-s10/callA/baselines.jsonl \
      docs/runs/2026-11-30-s10/callD/refit.jsonl docs/runs/2026-11-30-s10/callA/refit.jsonl \
      docs/runs/2026-11-30-s9/call3/refit.jsonl
    (the default disaggregated cases of several calls, the first file's case of each size kept)
"""
import json
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def lines(path):
    return [json.loads(l) for l in open(path) if l.strip().startswith("{")]


def main(run, out):
    ceil = lines(os.path.join(run, "ceilings.jsonl"))[0]
    refit = [r for r in lines(os.path.join(run, "refit.jsonl")) if r["config"] == "llama3-8b.json"]
    extra = json.load(open(os.path.join(run, "dis-8b.json")))  # the 16 GB case, from an earlier call
    refit.append(extra)
    refit.sort(key=lambda r: r["bytes"])
    base = {b["what"]: b for b in lines(os.path.join(run, "baselines.jsonl"))}

    # 1. Effective bandwidth against model size, with the ceilings of the same machine.
    fig, ax = plt.subplots(figsize=(7, 4.2))
    gb = [r["bytes"] / 1e9 for r in refit]
    ax.plot(gb, [r["bytes"] / r["median_transfer_s"] / 1e9 for r in refit], "o-", label="refit, transfer phase (coordinator)")
    ax.plot(gb, [r["bytes"] / (statistics.median(r["data_plane_ms"]["daemon1"]) / 1e3) / 1e9 for r in refit], "s--",
            label="refit, data plane (receiving daemon)")
    ax.axhline(ceil["peer_copy_engine_gbps"], color="k", lw=1, label=f"copy engine GPU0→GPU1 ({ceil['peer_copy_engine_gbps']:.0f})")
    ax.axhline(ceil["nccl_send_recv_gbps"], color="gray", lw=1, ls=":", label=f"NCCL send/recv 1 GiB ({ceil['nccl_send_recv_gbps']:.0f})")
    for what, marker in (("gather_broadcast", "^"), ("per_tensor_send_recv", "v")):
        b = base[what]
        ax.plot([b["bytes"] / 1e9], [b["gbps"]], marker, ms=9, label=f"baseline: {what.replace('_', ' ')}")
    ax.set_xscale("log")
    ax.set_xlabel("model bytes moved (GB), Llama-3-8B structure, TP4 on GPU 0 → TP2 on GPU 1")
    ax.set_ylabel("effective GB/s (median of 6 rounds)")
    ax.set_ylim(0, 450)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Disaggregated refit on 2 × H200 (two daemons, NCCL)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "h200x2-scaling.png"), dpi=110)

    # 2. Frontier predictions: refit's plan against direct sends and broadcast.
    path = os.path.join(run, "frontier.jsonl")
    if os.path.exists(path):
        rows = lines(path)
        cases = [r for r in rows if r["gpus_per_node"] == 8 and r["routing"]]
        direct = {r["case"]: r for r in rows if r["gpus_per_node"] == 8 and not r["routing"]}
        fig, ax = plt.subplots(figsize=(7, 4))
        x = range(len(cases))
        w = 0.2
        ax.bar([i - 1.5 * w for i in x], [r["lower_bound_seconds"] for r in cases], w, label="lower bound")
        ax.bar([i - 0.5 * w for i in x], [r["predicted_seconds"] for r in cases], w, label="refit plan (routing)")
        ax.bar([i + 0.5 * w for i in x], [direct[r["case"]]["predicted_seconds"] for r in cases], w, label="direct point-to-point")
        ax.bar([i + 1.5 * w for i in x], [r["broadcast_seconds_bound"] for r in cases], w, label="broadcast (best case)")
        ax.set_xticks(list(x), [r["case"] for r in cases])
        ax.set_ylabel("seconds (predicted, ideal links)")
        ax.set_title("Frontier refits, 8 GPUs per node, 50 GB/s NIC per GPU")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "frontier.png"), dpi=110)


def scaling(out, ceilings, baselines, refit_files):
    ceil = lines(ceilings)[0]
    base = {b["what"]: b for b in lines(baselines)}
    by_bytes = {}
    for path in refit_files:
        for r in lines(path):
            default = (r["mode"] == "disaggregated" and not r.get("nccl_stream_priority") and not r.get("env")
                       and r["staging_budget"] == 2 << 30 and r["config"] != "many-small-moe.json")
            if default and r["bytes"] not in by_bytes:
                by_bytes[r["bytes"]] = r
    refit = sorted(by_bytes.values(), key=lambda r: r["bytes"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    gb = [r["bytes"] / 1e9 for r in refit]
    ax.plot(gb, [r["bytes"] / r["median_transfer_s"] / 1e9 for r in refit], "o-", label="refit, transfer phase (coordinator)")
    ax.plot(gb, [r["bytes"] / (r["median_data_plane_ms"]["daemon1"] / 1e3) / 1e9 for r in refit], "s--",
            label="refit, data plane (receiving daemon)")
    ax.axhline(ceil["peer_copy_engine_gbps"], color="k", lw=1, label=f"copy engine GPU0→GPU1 ({ceil['peer_copy_engine_gbps']:.0f})")
    ax.axhline(0.9 * ceil["peer_copy_engine_gbps"], color="k", lw=1, ls="--", label="goal: 0.9 of the copy engine")
    ax.axhline(ceil["nccl_send_recv_gbps"], color="gray", lw=1, ls=":", label=f"NCCL send/recv 1 GiB ({ceil['nccl_send_recv_gbps']:.0f})")
    for what, marker in (("gather_broadcast", "^"), ("per_tensor_send_recv", "v")):
        b = base[what]
        ax.plot([b["bytes"] / 1e9], [b["gbps"]], marker, ms=9, label=f"baseline: {what.replace('_', ' ')}")
    for r in refit:
        if r["config"] != "llama3-8b.json":
            ax.annotate(r["config"].replace(".json", ""), (r["bytes"] / 1e9, r["bytes"] / r["median_transfer_s"] / 1e9),
                        textcoords="offset points", xytext=(-60, -18), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("GB moved, TP4 on GPU 0 → TP2 on GPU 1 (Llama-3-8B scaled; 61 GB: Qwen3-30B-A3B)")
    ax.set_ylabel("effective GB/s (median of 6 rounds)")
    ax.set_ylim(0, 450)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Disaggregated refit on 2 × H200 (two daemons, NCCL)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    if sys.argv[1] == "--scaling":
        import argparse
        parser = argparse.ArgumentParser()
        parser.add_argument("--scaling", required=True)
        parser.add_argument("--ceilings", required=True)
        parser.add_argument("--baselines", required=True)
        parser.add_argument("refit", nargs="+")
        a = parser.parse_args()
        scaling(a.scaling, a.ceilings, a.baselines, a.refit)
    else:
        main(sys.argv[1], sys.argv[2])
