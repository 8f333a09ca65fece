#!/usr/bin/env bash
# One refitd --backend cuda serving two model groups at once ("policy" and "reward", the same
# FSDP=2 -> TP=2 Llama-3-8B structure at widths / SCALE, every rank on GPU 0 on a 1-GPU machine,
# on GPUs 0 and 1 otherwise): both groups' refits started together, ROUNDS times, each checked
# byte for byte by its engines. Exercises the backend's per-group leases (each Transfer holds its
# own group's streams and schedule; the shared tables are touched only under the lock).
#   BIN=.device/bin bash tests/gpu/two_groups.sh
set -uo pipefail
BIN=${BIN:-.device/bin}
BACKEND=${BACKEND:-cuda}  # host: a dry run of this script on a CPU machine
WORKER_BIN=$BIN/sim-worker-cuda
[ "$BACKEND" = cuda ] || WORKER_BIN=$BIN/sim-worker
RUN=${RUN:-$(mktemp -d)}
ROUNDS=${ROUNDS:-5}
mkdir -p "$RUN"
rm -f "$RUN"/*.report "$RUN"/*.log "$RUN"/*.addr
source tools/cluster_lib.sh
trap stop_all EXIT
fail() { echo "FAIL: $*"; tail -n 20 "$RUN"/daemon0.log; exit 1; }
scale=${SCALE:-8}
"$BIN/refit-layout" --config tests/configs/llama3-8b.json --scale-down "$scale" --side trainer --fsdp 2 --gpus-per-node 2 -o "$RUN/t.json" || fail layout
"$BIN/refit-layout" --config tests/configs/llama3-8b.json --scale-down "$scale" --side inference --tp 2 --gpus-per-node 2 -o "$RUN/i.json" || fail layout
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
gpu_list=0,1
if [ "${gpus:-0}" -lt 2 ]; then
  for f in "$RUN/t.json" "$RUN/i.json"; do
    python3 -c 'import json,sys; l=json.load(open(sys.argv[1])); [w.update(node=0, gpu=0) for w in l["workers"]]; json.dump(l, open(sys.argv[1], "w"))' "$f"
  done
  gpu_list=0
fi
gpus_flag=(--gpus "$gpu_list"); [ "$BACKEND" = cuda ] || gpus_flag=()
start_daemon 0 --backend "$BACKEND" "${gpus_flag[@]}" --prepare-timeout 60 --commit-timeout 60 || fail daemon
keys=()
for group in policy reward; do
  while read -r name node; do start_worker "$group-$name" "$node" "$group" trainer "$RUN/t.json" "$name"; keys+=("$group-$name"); done < <(workers_of "$RUN/t.json")
  while read -r name node; do start_worker "$group-$name" "$node" "$group" inference "$RUN/i.json" "$name"; keys+=("$group-$name"); done < <(workers_of "$RUN/i.json")
done
for _ in $(seq 300); do
  [ "$(cat "$RUN"/*.report 2>/dev/null | grep -c "^registered")" -eq ${#keys[@]} ] && break
  sleep 0.2
done
wait_registered "${keys[@]}" || fail registration
for _ in $(seq 100); do [ "$(ctl status | grep -cE '^(policy|reward) .*yes')" -eq 2 ] && break; sleep 0.2; done
ctl status
for v in $(seq 1 "$ROUNDS"); do
  ctl refit policy "$v" >"$RUN/policy-$v.out" 2>&1 &
  p=$!
  ctl refit reward "$v" >"$RUN/reward-$v.out" 2>&1 &
  r=$!
  wait $p || fail "policy round $v: $(tail -n 2 "$RUN/policy-$v.out")"
  wait $r || fail "reward round $v: $(tail -n 2 "$RUN/reward-$v.out")"
  tail -qn 1 "$RUN/policy-$v.out" "$RUN/reward-$v.out"
  for rep in "$RUN"/policy-vllm-*.report "$RUN"/reward-vllm-*.report; do
    grep -q "^commit $v ok" "$rep" || fail "$(basename "$rep") round $v: $(tail -n 1 "$rep")"
  done
done
# Did the two groups' transfers overlap in the daemon? (informational: the coordinator may order them)
grep -E 'round [0-9]+: .*moved in' "$RUN/daemon0.log" | tail -n 4
echo "two groups: $ROUNDS rounds each, started together, byte-exact"
