#!/usr/bin/env bash
# GPU run, disaggregated: a "training node" daemon on GPU 0 with four trainer
# processes (Megatron TP=4, Llama-3-8B structure, widths / SCALE), an "inference node" daemon on
# GPU 1 with two inference processes (vLLM TP=2: fused qkv and gate_up, padded vocabulary).
# Data crosses between the daemons by NCCL (pack, send/recv, unpack). Every inference byte is
# checked after every round. Run on a 2-GPU machine from a bundle: BIN=.device/bin.
set -uo pipefail
BIN=${BIN:-.device/bin}
WORKER_BIN=$BIN/sim-worker-cuda
RUN=${RUN:-$(mktemp -d)}
mkdir -p "$RUN"
rm -f "$RUN"/*.report "$RUN"/*.log "$RUN"/*.addr  # a reused folder must not hold old reports
source tools/cluster_lib.sh
trap stop_all EXIT
fail() { echo "FAIL: $*"; tail -n 20 "$RUN"/daemon0.log "$RUN"/daemon1.log; exit 1; }
scale=${SCALE:-4}
L="$BIN/refit-layout"
$L --config tests/configs/llama3-8b.json --scale-down "$scale" --side trainer --tp 4 --gpus-per-node 4 -o "$RUN/t.json" || fail layout
$L --config tests/configs/llama3-8b.json --scale-down "$scale" --side inference --tp 2 --gpus-per-node 2 --first-node 1 -o "$RUN/i.json" || fail layout
# Every trainer process shares GPU 0 of node 0; both inference processes GPU 1 of node 1.
python3 - "$RUN/t.json" 0 "$RUN/i.json" 1 <<'PY'
import json, sys
for path, gpu in ((sys.argv[1], int(sys.argv[2])), (sys.argv[3], int(sys.argv[4]))):
    layout = json.load(open(path))
    for w in layout["workers"]:
        w["gpu"] = gpu
    json.dump(layout, open(path, "w"))
PY
start_daemon 0 --backend cuda --gpus 0 --prepare-timeout 60 --commit-timeout 60 --transfer-timeout 30 || fail "daemon 0"
start_daemon 1 --backend cuda --gpus 1 --prepare-timeout 60 --commit-timeout 60 --transfer-timeout 30 || fail "daemon 1"
keys=()
while read -r name node; do start_worker "$name" "$node" policy trainer "$RUN/t.json" "$name"; keys+=("$name"); done < <(workers_of "$RUN/t.json")
while read -r name node; do start_worker "$name" "$node" policy inference "$RUN/i.json" "$name"; keys+=("$name"); done < <(workers_of "$RUN/i.json")
for _ in $(seq 300); do
  [ "$(cat "$RUN"/*.report 2>/dev/null | grep -c "^registered")" -eq ${#keys[@]} ] && break
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
echo "disaggregated: 5 rounds byte-exact"
[ "${FAULTS:-1}" -eq 1 ] || exit 0

# Run (c): faults. A worker, then a daemon, die while the round waits for them; the round aborts
# within its deadline naming the culprit, and after they come back the next round is byte-exact
# (for the daemon, through a rebuilt NCCL communicator).
round_must_abort() {  # VERSION CULPRIT KILL-COMMAND...
  local v=$1 culprit=$2; shift 2
  ctl refit policy "$v" >"$RUN/abort-$v.out" 2>&1 &
  local p=$!
  sleep 1
  local t0=$(date +%s%N)
  "$@"
  wait $p && fail "round $v committed although $culprit died"
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  echo "round $v aborted ${ms} ms after the kill: $(cat "$RUN/abort-$v.out")"
  grep -q "$culprit" "$RUN/abort-$v.out" || fail "the reason does not name $culprit"
  [ "$ms" -lt 10000 ] || fail "abort took ${ms} ms"
}
restart_worker() {  # KEY ROLE LAYOUT [flags]
  local key=$1 role=$2 layout=$3; shift 3
  kill "${WORKER_PID[$key]}" 2>/dev/null; wait "${WORKER_PID[$key]}" 2>/dev/null
  rm -f "$RUN/$key.report"
  start_worker "$key" "$(workers_of "$layout" | awk -v k="$key" '$1 == k {print $2}')" policy "$role" "$layout" "$key" "$@"
  for _ in $(seq 150); do grep -q "^registered" "$RUN/$key.report" 2>/dev/null && break; sleep 0.2; done
  grep -q "^registered" "$RUN/$key.report" || fail "$key did not come back"
}
all_ok() {
  for r in "$RUN"/vllm-*.report; do grep -q "^commit $1 ok" "$r" || fail "$(basename "$r") round $1: $(tail -n 1 "$r")"; done
}

echo "== (c) an inference worker killed mid-round"
restart_worker vllm-dp0-tp1 inference "$RUN/i.json" --prepare-delay-ms 5000
round_must_abort 6 "policy/vllm-dp0-tp1" kill -9 "${WORKER_PID[vllm-dp0-tp1]}"
restart_worker vllm-dp0-tp1 inference "$RUN/i.json"
ctl refit policy 7 | tail -n 1 || fail "round 7 after the worker came back"
all_ok 7

echo "== (c) the inference node's daemon killed mid-round"
restart_worker vllm-dp0-tp0 inference "$RUN/i.json" --prepare-delay-ms 5000
round_must_abort 8 "node 1" kill -9 "${DAEMON_PID[1]}"
for key in vllm-dp0-tp0 vllm-dp0-tp1; do kill -9 "${WORKER_PID[$key]}" 2>/dev/null; wait "${WORKER_PID[$key]}" 2>/dev/null; done
start_daemon 1 --backend cuda --gpus 1 --prepare-timeout 60 --commit-timeout 60 --transfer-timeout 30 || fail "daemon 1 restart"
restart_worker vllm-dp0-tp0 inference "$RUN/i.json"
restart_worker vllm-dp0-tp1 inference "$RUN/i.json"
ctl refit policy 9 | tail -n 1 || fail "round 9 after the daemon came back"
all_ok 9
ctl refit policy 10 | tail -n 1 || fail "round 10"
all_ok 10

echo "== (c) the inference node's daemon freezes after PREPARE: node 0 is inside its NCCL sends"
# A trainer's slow PREPARE holds the round while daemon 1 (already prepared) is stopped; at
# TRANSFER daemon 0 posts its sends to a peer that never receives: NCCL over NVLink reports no
# error, so the coordinator's dead-peer verdict (heartbeats) cancels it, NCCL is aborted, and
# the stopped daemon is then killed and replaced.
trainer=$(workers_of "$RUN/t.json" | head -n 1 | cut -d' ' -f1)
restart_worker "$trainer" trainer "$RUN/t.json" --prepare-delay-ms 800
ctl refit policy 11 | tail -n 1 || fail "round 11 (builds the communicator of the new membership)"
all_ok 11
aborts_before=$(grep -c "communicator aborted" "$RUN/daemon0.log")
ctl refit policy 12 >"$RUN/abort-12.out" 2>&1 &
p=$!
sleep 0.3
kill -STOP "${DAEMON_PID[1]}"
t0=$(date +%s%N)
wait $p && fail "round 12 committed although node 1 was frozen"
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
echo "round 12 aborted ${ms} ms after the freeze: $(cat "$RUN/abort-12.out")"
grep -q "node 1" "$RUN/abort-12.out" || fail "the reason does not name node 1"
[ "$ms" -lt 10000 ] || fail "abort took ${ms} ms"
grep "round 12\|communicator aborted" "$RUN/daemon0.log" | tail -n 4
[ "$(grep -c "communicator aborted" "$RUN/daemon0.log")" -gt "$aborts_before" ] || fail "daemon 0 did not abort its NCCL communicator"
kill -9 "${DAEMON_PID[1]}"; wait "${DAEMON_PID[1]}" 2>/dev/null
for key in vllm-dp0-tp0 vllm-dp0-tp1; do kill -9 "${WORKER_PID[$key]}" 2>/dev/null; wait "${WORKER_PID[$key]}" 2>/dev/null; done
start_daemon 1 --backend cuda --gpus 1 --prepare-timeout 60 --commit-timeout 60 --transfer-timeout 30 || fail "daemon 1 restart"
restart_worker "$trainer" trainer "$RUN/t.json"
restart_worker vllm-dp0-tp0 inference "$RUN/i.json"
restart_worker vllm-dp0-tp1 inference "$RUN/i.json"
ctl refit policy 13 | tail -n 1 || fail "round 13 after the frozen daemon was replaced"
all_ok 13
echo "faults: aborted in time, recovered byte-exact"
