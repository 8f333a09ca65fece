#!/usr/bin/python3
"""Plots scale_bench.py's JSON: each metric against N (daemons), one line per input file (e.g. one
per model), as PNGs (matplotlib, Agg backend).

    /usr/bin/python3 tests/scale/plot_scale.py small.json deepseek.json --out-dir docs/img [--prefix scale]

Writes <prefix>-setup.png (ready / first commit after the last registration, install max and
median), <prefix>-round.png (a round's prepare, transfer, commit: median), <prefix>-faults.png
(SIGKILL / SIGSTOP abort time, ready and commit after a node's restart), <prefix>-memory.png
(daemons' RSS max and median, the coordinator's, growth over the K rounds) and <prefix>-cpu.png
(coordinator CPU in setup and the first round, per-node CPU of the first round).
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def get(r, path):
    cur = r
    for p in path.split("."):
        if not isinstance(cur, dict) or p not in cur:
            return None
        cur = cur[p]
    return cur


def label_of(data, path):
    a = data.get("args", {})
    return f"{a.get('model', os.path.basename(path))} ({a.get('gpus_per_node', '?')} workers/node)"


def series(data, path):
    rs = [r for r in data.get("results", []) if get(r, path) is not None]
    rs.sort(key=lambda r: r["nodes"])
    return [r["nodes"] for r in rs], [get(r, path) for r in rs]


def panel(ax, inputs, metrics, title, ylabel, log=False):
    for data, path in inputs:
        for key, name, style in metrics:
            xs, ys = series(data, key)
            if xs:
                ax.plot(xs, ys, style, marker="o", label=f"{name}: {label_of(data, path)}")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("N (daemons)")
    ax.set_ylabel(ylabel)
    ax.set_xscale("log", base=2)
    if log:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the axes: no point hidden


FIGURES = {
    "setup": [
        ("Ready after the last registration", "seconds",
         [("ready_after_last_registration_s", "ready", "-"),
          ("first_commit_after_last_registration_s", "first commit", "--")]),
        ("Plan install per node (first round)", "seconds",
         [("install.max_s", "max", "-"), ("install.median_s", "median", "--")]),
    ],
    "round": [
        ("A round's phases (median of K)", "seconds",
         [("rounds.prepare_s_median", "prepare", "-"), ("rounds.transfer_s_median", "transfer", "--"),
          ("rounds.commit_s_median", "commit", ":"), ("rounds.seconds_median", "round", "-.")]),
    ],
    "faults": [
        ("Abort after a daemon's fault in PREPARE", "seconds",
         [("abort_sigkill.abort_s", "SIGKILL", "-"), ("abort_sigstop.abort_s", "SIGSTOP", "--")]),
        ("An engine node killed and restarted", "seconds",
         [("rejoin.ready_after_restart_s", "ready", "-"), ("rejoin.commit_after_restart_s", "committed", "--")]),
    ],
    "memory": [
        ("Daemons' RSS", "MiB",
         [("rss.after_rounds_max_mb", "max", "-"), ("rss.after_rounds_median_mb", "median", "--"),
          ("rss.coordinator_after_mb", "coordinator", ":")]),
        ("RSS growth over K rounds", "MiB",
         [("rss.growth_max_mb", "max", "-"), ("rss.growth_median_mb", "median", "--"),
          ("rss.growth_coordinator_mb", "coordinator", ":")]),
    ],
    "cpu": [
        ("Coordinator CPU", "CPU seconds",
         [("coordinator.cpu_setup_s", "setup (joins, registrations, planning)", "-"),
          ("coordinator.cpu_first_round_s", "first round", "--"),
          ("coordinator.cpu_per_round_s", "per later round", ":")]),
        ("Per-node CPU, first round (install)", "CPU seconds",
         [("install.cpu_max_s", "max", "-"), ("install.cpu_median_s", "median", "--")]),
    ],
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="scale_bench.py JSON files")
    p.add_argument("--out-dir", default="docs/img")
    p.add_argument("--prefix", default="scale")
    a = p.parse_args()
    inputs = []
    for path in a.inputs:
        with open(path) as f:
            inputs.append((json.load(f), path))
    os.makedirs(a.out_dir, exist_ok=True)
    written = []
    for name, panels in FIGURES.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
        for ax, (title, ylabel, metrics) in zip(axes[0], panels):
            panel(ax, inputs, metrics, title, ylabel)
        fig.suptitle("refitd on loopback, 2-core shared machine: " + name, fontsize=11)
        fig.tight_layout()
        out = os.path.join(a.out_dir, f"{a.prefix}-{name}.png")
        fig.savefig(out, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(out)
    print("\n".join(written))


if __name__ == "__main__":
    main()
