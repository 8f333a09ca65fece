#!/usr/bin/env bash
# GPU run, colocated: one daemon with both GPUs (--backend cuda), trainers
# FSDP-sharded over both GPUs, inference TP=2 on the same GPUs (Llama-3-8B structure, widths / 8).
# Weights live in GPU memory exported by CUDA IPC; the daemon's copy kernels move them, reading
# the other GPU over NVLink. Every inference byte is checked after every round.
# Run on a 2-GPU machine from a bundle (tools/gpu_run.sh): BIN=.device/bin. On one GPU, every
# rank shares it. SIM_WORKER_VMM=1: the workers' weights in CUDA VMM memory (fds, not IPC handles).
set -uo pipefail
BIN=${BIN:-.device/bin}
WORKER_BIN=$BIN/sim-worker-cuda
RUN=${RUN:-$(mktemp -d)}
mkdir -p "$RUN"
rm -f "$RUN"/*.report "$RUN"/*.log "$RUN"/*.addr  # a reused folder must not hold old reports
source tools/cluster_lib.sh
trap stop_all EXIT
fail() { echo "FAIL: $*"; tail -n 20 "$RUN"/daemon0.log; exit 1; }
scale=${SCALE:-8}
"$BIN/refit-layout" --config tests/configs/llama3-8b.json --scale-down "$scale" --side trainer --fsdp 2 --gpus-per-node 2 -o "$RUN/t.json" || fail layout
"$BIN/refit-layout" --config tests/configs/llama3-8b.json --scale-down "$scale" --side inference --tp 2 --gpus-per-node 2 -o "$RUN/i.json" || fail layout
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
gpu_list=0,1
if [ "${gpus:-0}" -lt 2 ]; then
  # One GPU: every trainer and engine rank shares it (verl's hybrid engine on one device).
  for f in "$RUN/t.json" "$RUN/i.json"; do
    python3 -c 'import json,sys; l=json.load(open(sys.argv[1])); [w.update(node=0, gpu=0) for w in l["workers"]]; json.dump(l, open(sys.argv[1], "w"))' "$f"
  done
  gpu_list=0
fi
start_daemon 0 --backend cuda --gpus "$gpu_list" --prepare-timeout 60 --commit-timeout 60 || fail "daemon"
keys=()
while read -r name node; do start_worker "$name" "$node" policy trainer "$RUN/t.json" "$name"; keys+=("$name"); done < <(workers_of "$RUN/t.json")
while read -r name node; do start_worker "$name" "$node" policy inference "$RUN/i.json" "$name"; keys+=("$name"); done < <(workers_of "$RUN/i.json")
for _ in $(seq 300); do
  n=$(cat "$RUN"/*.report 2>/dev/null | grep -c "^registered")
  [ "$n" -eq ${#keys[@]} ] && break
  sleep 0.2
done
wait_registered "${keys[@]}" || fail registration
ctl status
ctl plan policy
for v in 1 2 3 4 5; do
  ctl refit policy "$v" | tail -n 1 || fail "round $v"
  for r in "$RUN"/vllm-*.report; do
    grep -q "^commit $v ok" "$r" || fail "$(basename "$r") round $v: $(tail -n 1 "$r")"
  done
done
echo "colocated: 5 rounds byte-exact"
