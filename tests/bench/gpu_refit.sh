#!/usr/bin/env bash
# One refit benchmark case on a 2-GPU machine, through the real path: refitd with the cuda
# backend, sim-worker-cuda processes holding the weights in GPU memory, refitctl starting rounds.
#   MODE=disaggregated  trainer TP=4 (four processes) on GPU 0 under daemon 0, inference TP=2 (two
#                       processes) on GPU 1 under daemon 1: NCCL between the daemons.
#   MODE=colocated      one daemon with both GPUs: trainer FSDP=2, inference TP=2 on GPUs 0 and 1.
#   On 4 GPUs: MODE=disaggregated4, colocated4 (two daemons of 2 GPUs each) and
#   replicas4 (two inference replicas on node 1, NCCL on sockets; ROUTING=0 turns routing off).
# Every round: destinations poisoned at PREPARE; the first round checked element by element,
# every later one byte for byte against it (sim-worker --same-data). Prints one JSON line: the
# transfer phase of each measured round (after WARMUP rounds), its median, and what the data
# plane reported (staging, zero-copy bytes). Run from a bundle: BIN=.device/bin.
#   MODE=disaggregated CONFIG=tests/configs/llama3-8b.json SCALE=1 bash tests/bench/gpu_refit.sh
set -uo pipefail
BIN=${BIN:-.device/bin}
BACKEND=${BACKEND:-cuda}  # host: a dry run of this script on a CPU machine (no --gpus)
WORKER_BIN=$BIN/sim-worker-cuda
[ "$BACKEND" = cuda ] || WORKER_BIN=$BIN/sim-worker
MODE=${MODE:-disaggregated}
CONFIG=${CONFIG:-tests/configs/llama3-8b.json}
SCALE=${SCALE:-1}
LAYERS=${LAYERS:-0}
ROUNDS=${ROUNDS:-6}
WARMUP=${WARMUP:-2}
MSG=${MSG:-$((64 << 20))}
STAGING=${STAGING:-$((256 << 20))}
RUN=${RUN:-$(mktemp -d)}
mkdir -p "$RUN"
rm -f "$RUN"/*.report "$RUN"/*.log "$RUN"/*.addr "$RUN"/*.json
source tools/cluster_lib.sh
trap stop_all EXIT
fail() { echo "FAIL: $*" >&2; tail -n 5 "$RUN"/daemon*.log >&2; exit 1; }
gpus() { [ "$BACKEND" = cuda ] && echo "--gpus $1"; }
L=("$BIN/refit-layout" --config "$CONFIG" --scale-down "$SCALE" --layers "$LAYERS")
# Big layouts (100k tensors) keep a small machine busy for seconds: slower heartbeats, a longer
# registration deadline.
flags=(--backend "$BACKEND" --max-message-bytes "$MSG" --staging-bytes "$STAGING" --zero-copy-min-bytes "${ZERO_COPY:-16777216}" --prepare-timeout 300 --commit-timeout 300
       --transfer-timeout 60 --heartbeat 0.5 --heartbeats-missed 10)
[ "${REGISTER:-0}" -eq 1 ] && flags+=(--nccl-register)  # staging registered with NCCL
[ "${PRIORITY:-0}" -eq 1 ] && flags+=(--nccl-stream-priority)  # NCCL's stream ahead of pack/unpack
# set_gpus FILE EXPR: each worker's GPU becomes EXPR of its generated index g (python).
set_gpus() {
  python3 - "$1" "$2" <<'PY'
import json, sys
layout = json.load(open(sys.argv[1]))
for w in layout["workers"]:
    g = w.get("gpu", 0)
    w["gpu"] = eval(sys.argv[2])
json.dump(layout, open(sys.argv[1], "w"))
PY
}
routing=()
[ "${ROUTING:-1}" -eq 1 ] || routing=(--norouting)
case "$MODE" in
  disaggregated)  # 2 GPUs: TP4 on GPU 0 (node 0) -> TP2 on GPU 1 (node 1)
    "${L[@]}" --side trainer --tp 4 --gpus-per-node 4 -o "$RUN/t.json" || fail layout
    "${L[@]}" --side inference --tp 2 --gpus-per-node 2 --first-node 1 -o "$RUN/i.json" || fail layout
    set_gpus "$RUN/t.json" 0; set_gpus "$RUN/i.json" 1
    start_daemon 0 "${flags[@]}" $(gpus 0) || fail "daemon 0"
    start_daemon 1 "${flags[@]}" $(gpus 1) || fail "daemon 1" ;;
  colocated)  # 2 GPUs, one daemon: FSDP2 -> TP2 on GPUs 0 and 1
    "${L[@]}" --side trainer --fsdp 2 --gpus-per-node 2 -o "$RUN/t.json" || fail layout
    "${L[@]}" --side inference --tp 2 --gpus-per-node 2 -o "$RUN/i.json" || fail layout
    start_daemon 0 "${flags[@]}" $(gpus 0,1) || fail "daemon 0" ;;
  disaggregated4)  # 4 GPUs: TP4 on GPUs 0-1 (node 0) -> TP2 on GPUs 2-3 (node 1)
    "${L[@]}" --side trainer --tp 4 --gpus-per-node 4 -o "$RUN/t.json" || fail layout
    "${L[@]}" --side inference --tp 2 --gpus-per-node 2 --first-node 1 -o "$RUN/i.json" || fail layout
    set_gpus "$RUN/t.json" "g // 2"; set_gpus "$RUN/i.json" "g + 2"
    start_daemon 0 "${flags[@]}" $(gpus 0,1) || fail "daemon 0"
    start_daemon 1 "${flags[@]}" $(gpus 2,3) || fail "daemon 1" ;;
  colocated4)  # 4 GPUs, 2 per daemon: FSDP4 -> TP2 x DP2 over all four
    "${L[@]}" --side trainer --fsdp 4 --gpus-per-node 2 -o "$RUN/t.json" || fail layout
    "${L[@]}" --side inference --tp 2 --dp 2 --gpus-per-node 2 -o "$RUN/i.json" || fail layout
    set_gpus "$RUN/t.json" "g + 2 * w.get('node', 0)"; set_gpus "$RUN/i.json" "g + 2 * w.get('node', 0)"
    start_daemon 0 "${flags[@]}" $(gpus 0,1) || fail "daemon 0"
    start_daemon 1 "${flags[@]}" $(gpus 2,3) || fail "daemon 1" ;;
  replicas4)  # TP2 on GPUs 0-1 (node 0) -> two TP1 replicas on GPUs 2-3 (node 1), the
              # daemons' NCCL on sockets over loopback (a real network path); ROUTING=0 for the
              # comparison without topology routing
    "${L[@]}" --side trainer --tp 2 --gpus-per-node 2 -o "$RUN/t.json" || fail layout
    "${L[@]}" --side inference --tp 1 --dp 2 --gpus-per-node 2 --first-node 1 -o "$RUN/i.json" || fail layout
    set_gpus "$RUN/i.json" "g + 2"
    export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo
    start_daemon 0 "${flags[@]}" "${routing[@]}" $(gpus 0,1) || fail "daemon 0"
    start_daemon 1 "${flags[@]}" $(gpus 2,3) || fail "daemon 1"
    unset NCCL_P2P_DISABLE NCCL_SHM_DISABLE NCCL_SOCKET_IFNAME ;;
  *) fail "MODE must be disaggregated, colocated, disaggregated4, colocated4 or replicas4" ;;
esac
keys=()
while read -r name node; do start_worker "$name" "$node" policy trainer "$RUN/t.json" "$name" --same-data --register-timeout 300; keys+=("$name"); done < <(workers_of "$RUN/t.json")
while read -r name node; do start_worker "$name" "$node" policy inference "$RUN/i.json" "$name" --same-data --register-timeout 300; keys+=("$name"); done < <(workers_of "$RUN/i.json")
for _ in $(seq 600); do
  [ "$(cat "$RUN"/*.report 2>/dev/null | grep -c "^registered")" -eq ${#keys[@]} ] && break
  sleep 0.2
done
wait_registered "${keys[@]}" || fail registration
for _ in $(seq 100); do ctl status | grep -q "^policy .*yes" && break; sleep 0.2; done
ctl -o json status >"$RUN/status.json"
for v in $(seq 1 $((WARMUP + ROUNDS))); do
  ctl -o json refit policy "$v" >"$RUN/round$v.json" || fail "round $v: $(cat "$RUN/round$v.json")"
  for r in "$RUN"/vllm-*.report; do
    grep -q "^commit $v ok" "$r" || fail "$(basename "$r") round $v: $(tail -n 1 "$r")"
  done
done
python3 - "$RUN" "$MODE" "$CONFIG" "$SCALE" "$LAYERS" "$WARMUP" "$ROUNDS" "$MSG" "$STAGING" <<'PY'
import glob, json, os, re, statistics, sys
run, mode, config, scale, layers, warmup, rounds, msg, staging = sys.argv[1:]
warmup, rounds = int(warmup), int(rounds)
stats = [json.loads(open(os.path.join(run, f"round{v}.json")).read().strip().splitlines()[-1])
         for v in range(1, warmup + rounds + 1)]
measured = stats[warmup:]
transfer = [float(s["transfer_seconds"]) for s in measured]
# Each daemon's part of every measured round, from the round's statistics (RoundStats.nodes:
# what each node's data plane reported in its PhaseResponse), not from the daemons' logs.
per_node = {}  # "daemon<N>" -> that node's NodeTransfer of each measured round
for s in measured:
    for n in s.get("nodes", []):
        per_node.setdefault(f"daemon{int(n.get('node', 0))}", []).append(n)
moved = {k: [float(n["data_plane_ms"]) for n in v] for k, v in sorted(per_node.items())}
# When each daemon's data plane began (request arrival + its own preparation), per round: the
# spread between daemons is time the whole round waits on the latest one. Each node's clock:
# comparable between daemons of one host.
began = {k: [int(n["request_arrived_unix_us"]) / 1e3 + float(n["started_after_request_ms"]) for n in v]
         for k, v in per_node.items()}
starts = [b for b in began.values() if len(b) == rounds]
# The coordinator's TRANSFER call to each remote daemon, from sending to the daemon's arrival.
request_ms = {k: [round((int(n["request_arrived_unix_us"]) - int(n["request_sent_unix_us"])) / 1e3, 3) for n in v]
              for k, v in per_node.items() if k != "daemon0"}
start_skew_ms = [max(s[i] for s in starts) - min(s[i] for s in starts) for i in range(rounds)] if len(starts) > 1 else []
prepared, timeline = [], []
for log in sorted(glob.glob(os.path.join(run, "daemon*.log"))):
    prepared += re.findall(r"prepared; (.*)", open(log).read())
    lines = re.findall(r"round (\d+ GPU \d+ timeline: .*)", open(log).read())
    gpus_here = max(1, len({re.match(r"\d+ GPU (\d+)", l).group(1) for l in lines}))
    timeline += lines[-rounds * gpus_here:]  # the measured rounds of every GPU of this daemon
status = json.load(open(os.path.join(run, "status.json")))
group = [g for g in status.get("groups", []) if g.get("name") == "policy"][0]
nbytes = int(measured[0]["bytes"])
med = statistics.median(transfer)
print(json.dumps({
    "mode": mode, "config": os.path.basename(config), "scale_down": int(scale), "layers": int(layers),
    "bytes": nbytes, "plan_bytes_total": int(group["plan"]["bytes_total"]),
    "plan_bytes_network": int(group["plan"]["bytes_network"]), "plan_bytes_nvlink": int(group["plan"]["bytes_nvlink"]),
    "messages": int(group["plan"]["messages"]), "max_message_bytes": int(msg), "staging_budget": int(staging),
    "routing": os.environ.get("ROUTING", "1") == "1", "zero_copy_min_bytes": int(os.environ.get("ZERO_COPY", "16777216")),
    "nccl_register": os.environ.get("REGISTER", "0") == "1", "nccl_stream_priority": os.environ.get("PRIORITY", "0") == "1", "env": os.environ.get("CASE_ENV", ""), "rounds": rounds, "warmup": warmup, "transfer_s": transfer, "median_transfer_s": med,
    "gbps": nbytes / med / 1e9, "round_s": [float(s["seconds"]) for s in measured],
    "data_plane_ms": moved, "median_data_plane_ms": {k: statistics.median(v) for k, v in moved.items() if v},
    "start_skew_ms": start_skew_ms, "transfer_request_ms": request_ms, "started_after_request_ms": {
        k: [float(n["started_after_request_ms"]) for n in v] for k, v in per_node.items()},
    "prepared": prepared[:2], "timeline": timeline}))
PY
