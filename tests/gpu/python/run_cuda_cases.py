"""GPU machine: Python workers with live CUDA tensors through `refitd --backend cuda`, byte-exact.

Cases: PyTorch's caching allocator by default (legacy IPC) and with expandable_segments:True
(CUDA VMM, descriptors over the handle socket); tensors each their own allocation, or views
inside one (interior tensors); with two or more GPUs, the engine under CUDA_VISIBLE_DEVICES
naming another GPU than its index (the daemon finds it by UUID). One GPU: trainer and engine
colocated on it. Every round: the trainer writes version v's pattern, the engine checks every
byte. Prints one JSON line per case; exits 1 if any case failed.

    REFIT_BIN_DIR=.device/bin python3 tests/gpu/python/run_cuda_cases.py --out DIR
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path[:0] = [os.path.join(REPO, "client", "python"), os.path.join(REPO, "client", "python", "tests")]

import harness  # noqa: E402
import refit  # noqa: E402

WORKER = os.path.join(REPO, "client", "python", "tests", "pattern_worker.py")


def gpu_count():
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return len([l for l in out.splitlines() if l.startswith("GPU ")])


def make_layouts(dirname, gpus):
    cfg = harness.config_path("qwen2.5-7b.json")
    files = {}
    for side, tp in [("trainer", 2), ("inference", 2)]:
        path = os.path.join(dirname, f"{side}.json")
        subprocess.run([harness.binary("refit-layout"), "--config", cfg, "--side", side, "--tp", str(tp),
                        "--scale-down", "16", "--layers", "2", "-o", path], check=True)
        layout = json.load(open(path))
        for i, w in enumerate(layout["workers"]):
            w["node"] = 0
            # One GPU: all colocated. More: trainer rank i on GPU i, engine rank i on GPU i+1.
            w["gpu"] = 0 if gpus == 1 else (i + (1 if side == "inference" else 0)) % gpus
        json.dump(layout, open(path, "w"))
        files[side] = path
    return files


def run_case(name, alloc_conf, alloc, gpus, out_dir):
    # REFITD_FLAGS: more refitd flags (e.g. --arm-rounds auto).
    cluster = harness.Cluster(nodes=1, daemon_flags=["--backend", "cuda"] + shlex.split(os.environ.get("REFITD_FLAGS", "")))
    result = {"case": name, "alloc_conf": alloc_conf, "alloc": alloc, "gpus": gpus}
    try:
        files = make_layouts(cluster.dir, gpus)
        procs = []
        for side in ["trainer", "inference"]:
            layout = json.load(open(files[side]))
            for w in layout["workers"]:
                env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=alloc_conf,
                           CUDA_VISIBLE_DEVICES=str(w["gpu"]),
                           PYTHONPATH=os.path.join(REPO, "client", "python"))
                key = f"{side}-{w['name']}"
                report = os.path.join(cluster.dir, f"{key}.report")
                log = open(os.path.join(cluster.dir, f"{key}.log"), "ab")
                p = subprocess.Popen([sys.executable, WORKER, "--daemon", cluster.daemons[0].worker_address,
                                      "--group", name, "--role", side, "--layout", files[side], "--worker",
                                      w["name"], "--report", report, "--device", "cuda", "--alloc", alloc],
                                     env=env, stdout=log, stderr=subprocess.STDOUT)
                p.log_path = log.name
                cluster.procs.append(p)
                procs.append((key, side, report))
        def registered(report):
            return os.path.exists(report) and any(l.startswith("registered") for l in open(report).read().splitlines())
        for key, side, report in procs:  # every rank, not just a group that happens to be ready
            harness.wait_for(lambda: registered(report), 60, f"{key} to register")
        ctl = refit.Controller(cluster.control)
        ctl.wait_ready(name, timeout=60)
        rounds = []
        for v in [1, 2, 3]:
            stats = ctl.refit(name, v, timeout=120)
            rounds.append({"version": v, "bytes": stats.bytes, "seconds": stats.seconds,
                           "transfer_seconds": stats.transfer_seconds})
        checks = {}
        for key, side, report in procs:
            if side != "inference":
                continue
            harness.wait_for(lambda: any(l.startswith("commit 3 ") for l in open(report).read().splitlines()),
                             20, f"{key} commit 3")
            checks[key] = [l for l in open(report).read().splitlines() if l.startswith("commit")]
        result.update(rounds=rounds, checks=checks,
                      ok=all(all(" ok " in l for l in ls) and len(ls) == 3 for ls in checks.values()))
    except Exception as e:  # reported, with the logs
        result.update(ok=False, error=f"{type(e).__name__}: {e}")
    finally:
        cluster.close()
        result["logs"] = cluster.dir
        os.system(f"cp -r {cluster.dir} {out_dir}/{name}")
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gpus = gpu_count()
    results = []
    for name, conf, alloc in [("legacy_separate", "", "separate"), ("legacy_interior", "", "interior"),
                              ("vmm_separate", "expandable_segments:True", "separate"),
                              ("vmm_interior", "expandable_segments:True", "interior")]:
        t = time.time()
        r = run_case(name, conf, alloc, gpus, args.out)
        r["wall_s"] = round(time.time() - t, 1)
        print(json.dumps(r), flush=True)
        results.append(r)
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
