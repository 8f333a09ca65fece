#!/usr/bin/env bash
# One GPU, one refitd --backend cuda: the colocated refit (trainer FSDP=2 -> inference TP=2,
# every rank on GPU 0, like verl's hybrid engine on one device) of a full Llama-3-8B (16.06 GB
# at SCALE=1), timed through the real path like tests/bench/gpu_refit.sh (which needs 2 GPUs):
# sim-worker-cuda processes holding the weights in GPU memory (--same-data: the first round
# checked element by element, every later one byte for byte against it), refitctl starting
# rounds. Prints one JSON line: the transfer phase of each measured round (after WARMUP), its
# median, and the daemon's own data-plane time (RoundStats.nodes[].data_plane_ms). BIN: the programs (refitd among
# them), so that two builds of refitd can be compared in one run.
#   BIN=.device/bin SCALE=1 bash tests/gpu/colocated_bench.sh
set -uo pipefail
BIN=${BIN:-.device/bin}
BACKEND=${BACKEND:-cuda}  # host: a dry run of this script on a CPU machine
WORKER_BIN=${WORKER_BIN:-$BIN/sim-worker-cuda}
[ "$BACKEND" = cuda ] || WORKER_BIN=$BIN/sim-worker
CONFIG=${CONFIG:-tests/configs/llama3-8b.json}
SCALE=${SCALE:-1}
ROUNDS=${ROUNDS:-6}
WARMUP=${WARMUP:-2}
RUN=${RUN:-$(mktemp -d)}
mkdir -p "$RUN"
rm -f "$RUN"/*.report "$RUN"/*.log "$RUN"/*.addr "$RUN"/*.json
source tools/cluster_lib.sh
trap stop_all EXIT
fail() { echo "FAIL: $*" >&2; tail -n 5 "$RUN"/daemon*.log >&2; exit 1; }
L=("$BIN/refit-layout" --config "$CONFIG" --scale-down "$SCALE")
"${L[@]}" --side trainer --fsdp 2 --gpus-per-node 2 -o "$RUN/t.json" || fail layout
# INFER_DTYPE=fp8-block (or mxfp8): engines in fp8, quantized on the way; workers then check
# against the CPU reference (--peer-layout).
INFER_DTYPE=${INFER_DTYPE:-}
dtype_flag=(); [ -n "$INFER_DTYPE" ] && dtype_flag=(--dtype "$INFER_DTYPE")
"${L[@]}" --side inference --tp 2 --gpus-per-node 2 "${dtype_flag[@]}" -o "$RUN/i.json" || fail layout
peer_t=(); peer_i=(); [ -n "$INFER_DTYPE" ] && peer_t=(--peer-layout "$RUN/i.json") && peer_i=(--peer-layout "$RUN/t.json")
# WORKER_FLAGS: more sim-worker flags for every worker, e.g. --vmm (buffers in cuMem memory
# handed over as descriptors, instead of cudaMalloc and CUDA IPC handles).
read -r -a worker_flags <<<"${WORKER_FLAGS:-}"
peer_t+=("${worker_flags[@]}"); peer_i+=("${worker_flags[@]}")
for f in "$RUN/t.json" "$RUN/i.json"; do
  python3 -c 'import json,sys; l=json.load(open(sys.argv[1])); [w.update(node=0, gpu=0) for w in l["workers"]]; json.dump(l, open(sys.argv[1], "w"))' "$f"
done
gpus_flag=(--gpus 0); [ "$BACKEND" = cuda ] || gpus_flag=()
# DAEMON_FLAGS: more refitd flags, e.g. --aligned-copy-kernel.
read -r -a daemon_flags <<<"${DAEMON_FLAGS:-}"
start_daemon 0 --backend "$BACKEND" "${gpus_flag[@]}" "${daemon_flags[@]}" --max-message-bytes $((64 << 20)) --staging-bytes $((2 << 30)) \
  --prepare-timeout 300 --commit-timeout 300 --transfer-timeout 60 --heartbeat 0.5 --heartbeats-missed 10 || fail daemon
keys=()
while read -r name node; do start_worker "$name" "$node" policy trainer "$RUN/t.json" "$name" --same-data --register-timeout 300 "${peer_t[@]}"; keys+=("$name"); done < <(workers_of "$RUN/t.json")
while read -r name node; do start_worker "$name" "$node" policy inference "$RUN/i.json" "$name" --same-data --register-timeout 300 "${peer_i[@]}"; keys+=("$name"); done < <(workers_of "$RUN/i.json")
for _ in $(seq 600); do
  [ "$(cat "$RUN"/*.report 2>/dev/null | grep -c "^registered")" -eq ${#keys[@]} ] && break
  sleep 0.2
done
wait_registered "${keys[@]}" || fail registration
for _ in $(seq 100); do ctl status | grep -q "^policy .*yes" && break; sleep 0.2; done
for v in $(seq 1 $((WARMUP + ROUNDS))); do
  ctl -o json refit policy "$v" >"$RUN/round$v.json" || fail "round $v: $(cat "$RUN/round$v.json")"
  for r in "$RUN"/vllm-*.report; do
    grep -q "^commit $v ok" "$r" || fail "$(basename "$r") round $v: $(tail -n 1 "$r")"
  done
done
python3 - "$RUN" "$SCALE" "$WARMUP" "$ROUNDS" "$BIN" <<'PY'
import json, os, re, statistics, sys
run, scale, warmup, rounds, bin_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
stats = [json.loads(open(os.path.join(run, f"round{v}.json")).read().strip().splitlines()[-1]) for v in range(1, warmup + rounds + 1)]
measured = stats[warmup:]
transfer = [float(s["transfer_seconds"]) for s in measured]
# The daemon's own data-plane time, from the round's statistics (RoundStats.nodes), not its log.
moved = [float(n["data_plane_ms"]) for s in measured for n in s.get("nodes", []) if int(n.get("node", 0)) == 0]
nbytes = int(measured[0]["bytes"])
# Where the transfer phase went, per round (node 0, the coordinator's own): the coordinator's call
# reaching the node, the node's preparation before its data plane began, the data plane, and the
# rest (the answer's way back to the coordinator).
def breakdown(s):
    n = next((n for n in s.get("nodes", []) if int(n.get("node", 0)) == 0), None)
    if n is None or not n.get("request_sent_unix_us") or not n.get("request_arrived_unix_us"):
        return None
    sent, arrived = int(n["request_sent_unix_us"]), int(n["request_arrived_unix_us"])
    reach = (arrived - sent) / 1e3
    prep = float(n.get("started_after_request_ms", 0))
    data = float(n.get("data_plane_ms", 0))
    out = {"reach_ms": reach, "node_prep_ms": prep, "data_plane_ms": data,
           "rest_ms": float(s["transfer_seconds"]) * 1e3 - reach - prep - data}
    # With the answer's times (refitd since they were added): the node's own work after its data
    # plane (logging the timeline, answering), the answer's way back, the coordinator waking up.
    answered, received = int(n.get("answered_unix_us", 0)), int(n.get("answer_received_unix_us", 0))
    if answered and received:
        out["node_after_ms"] = (answered - arrived) / 1e3 - prep - data
        out["answer_back_ms"] = (received - answered) / 1e3
        out["coordinator_after_ms"] = float(s["transfer_seconds"]) * 1e3 - (received - sent) / 1e3
    return out
parts = [b for b in map(breakdown, measured) if b]
median_parts = {k: round(statistics.median(b[k] for b in parts if k in b), 4) for k in parts[0]} if parts else None
print(json.dumps({"mode": "colocated-1gpu", "refitd": os.path.realpath(os.path.join(bin_dir, "refitd")), "scale_down": scale,
                  "bytes": nbytes, "rounds": rounds, "warmup": warmup, "transfer_s": transfer,
                  "median_transfer_s": statistics.median(transfer), "data_plane_ms": moved,
                  "median_data_plane_ms": statistics.median(moved) if moved else None,
                  "data_plane_gbps": nbytes / statistics.median(moved) / 1e6 if moved else None,
                  "round_s": [float(s["seconds"]) for s in measured],
                  "median_round_s": statistics.median(float(s["seconds"]) for s in measured),
                  "median_prepare_s": statistics.median(float(s.get("prepare_seconds", 0)) for s in measured),
                  "transfer_breakdown": median_parts}))
PY
