#!/usr/bin/env bash
# A real cluster on loopback: 4 daemons (training nodes 0-1, inference nodes 2-3), two model
# groups at once (Llama-3-8B structure: Megatron TP2 PP2 -> vLLM TP2 DP2; Qwen3-30B-A3B structure:
# FSDP over 4 ranks -> vLLM TP2 with stacked experts, DP2), several rounds each, every inference
# byte checked after every round; then faults: a trainer worker, an inference worker and a
# non-coordinator daemon killed mid-round, and a daemon frozen mid-round. Each round aborts within its deadline naming the
# culprit, the daemons keep serving, and the next round after re-registration is byte-exact.
set -uo pipefail
BIN=$(mktemp -d)
for p in daemon/refitd client/tools/refitctl client/tools/refit-layout tests/workers/sim-worker; do
  ln -s "$PWD/$p" "$BIN/"
done
RUN=$(mktemp -d)
source tools/cluster_lib.sh
trap 'stop_all; rm -rf "$BIN"' EXIT
fail() { echo "FAIL: $*"; for f in "$RUN"/daemon*.log; do echo "== $f"; tail -n 15 "$f"; done; exit 1; }

L="$BIN/refit-layout"
$L --config tests/configs/llama3-8b.json --scale-down 32 --layers 4 --side trainer --tp 2 --pp 2 --gpus-per-node 2 -o "$RUN/policy-t.json" || fail layout
$L --config tests/configs/llama3-8b.json --scale-down 32 --layers 4 --side inference --tp 2 --dp 2 --gpus-per-node 2 --first-node 2 -o "$RUN/policy-i.json" || fail layout
$L --config tests/configs/qwen3-30b-a3b.json --scale-down 32 --layers 2 --side trainer --fsdp 4 --gpus-per-node 2 -o "$RUN/reward-t.json" || fail layout
$L --config tests/configs/qwen3-30b-a3b.json --scale-down 32 --layers 2 --side inference --tp 2 --dp 2 --gpus-per-node 2 --first-node 2 -o "$RUN/reward-i.json" || fail layout

for n in 0 1 2 3; do start_daemon "$n" --prepare-timeout 5 --transfer-timeout 10 --commit-timeout 5 || fail "daemon $n"; done
declare -A NODE_OF
start_side() {  # GROUP ROLE LAYOUT [extra flags for every worker]
  local group=$1 role=$2 layout=$3; shift 3
  while read -r name node; do
    start_worker "$group-$name" "$node" "$group" "$role" "$layout" "$name" "$@"
    NODE_OF[$group-$name]=$node
    STARTED+=("$group-$name")
  done < <(workers_of "$layout")
}
STARTED=()
start_side policy trainer "$RUN/policy-t.json"
start_side policy inference "$RUN/policy-i.json"
start_side reward trainer "$RUN/reward-t.json"
start_side reward inference "$RUN/reward-i.json"
wait_registered "${STARTED[@]}" || fail "registration"
ctl status >"$RUN/status.out" || fail status
cat "$RUN/status.out"
# The replicas table: policy (dense, TP2 x DP2) has two engines of 2 ranks; reward (MoE, experts
# split over DP x TP without EP) is one engine of 4.
for want in "policy dp0 2/2" "policy dp1 2/2" "reward engine 4/4"; do
  read -r g r n <<<"$want"
  grep -Eq "^$g +$r +$n +yes " "$RUN/status.out" || fail "status does not list replica $r of $g ($n) complete"
done
ctl workers >/dev/null || fail workers

# every_inference_ok GROUP VERSION: each inference worker of GROUP checked version VERSION.
every_inference_ok() {
  local group=$1 v=$2 n=0
  for r in "$RUN/$group"-vllm-*.report; do
    grep -q "^commit $v ok" "$r" || fail "$(basename "$r") did not verify version $v: $(tail -n 2 "$r")"
    n=$((n + 1))
  done
  [ "$n" -eq 4 ] || fail "expected 4 inference workers in $group, found $n"
}

echo "== rounds, two groups at once (watched from a non-coordinator daemon)"
"$BIN/refitctl" --daemon "unix:$RUN/refitd-2.sock" -o json watch policy >"$RUN/watch.out" 2>&1 &
WATCH=$!
wait_watching "$RUN/watch.out" || fail "watch"
for v in 1 2 3; do
  ctl refit policy "$v" >"$RUN/policy-$v.out" 2>&1 &
  p1=$!
  ctl refit reward "$v" >"$RUN/reward-$v.out" 2>&1 &
  p2=$!
  wait $p1 || fail "policy round $v: $(cat "$RUN/policy-$v.out")"
  wait $p2 || fail "reward round $v: $(cat "$RUN/reward-$v.out")"
  cat "$RUN/policy-$v.out" "$RUN/reward-$v.out" | grep committed
  every_inference_ok policy "$v"
  every_inference_ok reward "$v"
done

kill $WATCH; wait $WATCH 2>/dev/null
grep -c '"state":"COMMITTED"' "$RUN/watch.out" | grep -q '^3$' || fail "watch saw: $(cat "$RUN/watch.out")"
grep -q '"state":"TRANSFERRING"' "$RUN/watch.out" || fail "watch did not see progress: $(cat "$RUN/watch.out")"
"$BIN/refitctl" --daemon "unix:$RUN/refitd-3.sock" -o json status | grep -q '"ready":true' || fail "status through node 3"

echo "== stale version and unknown group are refused, the cluster keeps serving"
out=$(ctl refit policy 2 2>&1) && fail "stale version accepted: $out"
echo "$out" | grep -q "FAILED_PRECONDITION" || fail "stale version: $out"
out=$(ctl refit nosuchgroup 9 2>&1) && fail "unknown group accepted: $out"
echo "$out" | grep -q "NOT_FOUND" || fail "unknown group: $out"

# node3_workers GROUP: the keys of GROUP's workers on node 3.
node3_workers() {
  for key in "${!NODE_OF[@]}"; do
    [ "${NODE_OF[$key]}" -eq 3 ] && [[ $key == "$1"-* ]] && echo "$key"
  done
}

# kill_mid_round GROUP VERSION VICTIM_KEY: restart VICTIM with a slow PREPARE, start a round,
# kill the victim while the round waits for it; the round must abort within 5 s naming it.
kill_mid_round() {
  local group=$1 v=$2 key=$3 culprit=$4
  kill "${WORKER_PID[$key]}"; wait "${WORKER_PID[$key]}" 2>/dev/null
  rm -f "$RUN/$key.report"
  local role=trainer layout="$RUN/$group-t.json"
  [[ $key == *vllm* ]] && { role=inference; layout="$RUN/$group-i.json"; }
  start_worker "$key" "${NODE_OF[$key]}" "$group" "$role" "$layout" "${key#$group-}" --prepare-delay-ms 4000
  wait_registered "$key" || fail "re-registration of $key"
  ctl refit "$group" "$v" >"$RUN/abort-$v.out" 2>&1 &
  local p=$!
  wait_report "^preparing $v\$" "$key" || fail "round $v of $group never reached $key"
  local t0=$(date +%s.%N)
  kill -9 "${WORKER_PID[$key]}"
  wait $p && fail "round $v of $group committed although $key was killed"
  local dt=$(echo "$(date +%s.%N) - $t0" | bc)
  echo "aborted after ${dt}s: $(cat "$RUN/abort-$v.out")"
  grep -q "ABORTED" "$RUN/abort-$v.out" || fail "not an ABORTED error: $(cat "$RUN/abort-$v.out")"
  grep -q "$culprit" "$RUN/abort-$v.out" || fail "the reason does not name $culprit"
  [ "$(echo "$dt < 5" | bc)" -eq 1 ] || fail "abort took ${dt}s"
  # Recovery: the worker comes back (without the delay) and the next round is byte-exact.
  rm -f "$RUN/$key.report"
  start_worker "$key" "${NODE_OF[$key]}" "$group" "$role" "$layout" "${key#$group-}"
  wait_registered "$key" || fail "re-registration of $key"
  ctl refit "$group" "$((v + 1))" | grep committed || fail "round $((v + 1)) after recovery"
  every_inference_ok "$group" "$((v + 1))"
}

echo "== a trainer worker killed mid-round"
kill_mid_round policy 4 policy-trainer-rank1 "policy/trainer-rank1"
echo "== an inference worker killed mid-round"
kill_mid_round reward 4 reward-vllm-dp1-tp0 "reward/vllm-dp1-tp0"

echo "== a non-coordinator daemon killed mid-round"
# Node 3's workers confirm PREPARE slowly; node 3's daemon dies meanwhile.
for key in "${!NODE_OF[@]}"; do
  if [ "${NODE_OF[$key]}" -eq 3 ] && [[ $key == policy-* ]]; then
    kill "${WORKER_PID[$key]}"; wait "${WORKER_PID[$key]}" 2>/dev/null; rm -f "$RUN/$key.report"
    start_worker "$key" 3 policy inference "$RUN/policy-i.json" "${key#policy-}" --prepare-delay-ms 4000
    wait_registered "$key" || fail "re-registration of $key"
  fi
done
ctl refit policy 7 >"$RUN/abort-7.out" 2>&1 &
p=$!
wait_report "^preparing 7$" $(node3_workers policy) || fail "round 7 never reached node 3"
t0=$(date +%s.%N)
kill -9 "${DAEMON_PID[3]}"
wait $p && fail "round 7 committed although node 3 died"
dt=$(echo "$(date +%s.%N) - $t0" | bc)
echo "aborted after ${dt}s: $(cat "$RUN/abort-7.out")"
grep -q "node 3" "$RUN/abort-7.out" || fail "the reason does not name node 3"
[ "$(echo "$dt < 5" | bc)" -eq 1 ] || fail "abort took ${dt}s"
ctl status >/dev/null || fail "the coordinator stopped serving"
# restart_node3 VERSION: node 3 (dead or frozen) is killed and restarts with its workers; both
# groups refit to VERSION, byte-exact.
restart_node3() {
  local v=$1 key group name role layout
  kill -9 "${DAEMON_PID[3]}" 2>/dev/null; wait "${DAEMON_PID[3]}" 2>/dev/null
  for key in "${!NODE_OF[@]}"; do
    [ "${NODE_OF[$key]}" -eq 3 ] && { kill -9 "${WORKER_PID[$key]}" 2>/dev/null; wait "${WORKER_PID[$key]}" 2>/dev/null; }
  done
  start_daemon 3 --prepare-timeout 5 --transfer-timeout 10 --commit-timeout 5 || fail "daemon 3 restart"
  RESTARTED=()
  for key in "${!NODE_OF[@]}"; do
    if [ "${NODE_OF[$key]}" -eq 3 ]; then
      group=${key%%-*}; name=${key#$group-}
      role=trainer; layout="$RUN/$group-t.json"
      [[ $name == vllm* ]] && { role=inference; layout="$RUN/$group-i.json"; }
      rm -f "$RUN/$key.report"
      start_worker "$key" 3 "$group" "$role" "$layout" "$name" "${@:2}"
      RESTARTED+=("$key")
    fi
  done
  wait_registered "${RESTARTED[@]}" || fail "re-registration on node 3"
  [ "$v" -gt 0 ] || return 0
  ctl refit policy "$v" | grep committed || fail "policy round $v after node 3 restarted"
  ctl refit reward "$v" | grep committed || fail "reward round $v after node 3 restarted"
  every_inference_ok policy "$v"
  every_inference_ok reward "$v"
}
restart_node3 8

echo "== a non-coordinator daemon frozen mid-round"
# Node 3 is stopped (SIGSTOP) while the coordinator's PREPARE call to it is in flight: no error
# ever comes back. The heartbeat verdict (1 s here) must cancel the call and abort the round,
# long before the phase deadline (5 s + 5 s).
restart_node3 0 --prepare-delay-ms 3000
ctl refit policy 9 >"$RUN/abort-9.out" 2>&1 &
p=$!
wait_report "^preparing 9$" $(node3_workers policy) || fail "round 9 never reached node 3"
t0=$(date +%s.%N)
kill -STOP "${DAEMON_PID[3]}"
wait $p && fail "round 9 committed although node 3 was frozen"
dt=$(echo "$(date +%s.%N) - $t0" | bc)
echo "aborted after ${dt}s: $(cat "$RUN/abort-9.out")"
grep -q "node 3" "$RUN/abort-9.out" || fail "the reason does not name node 3"
[ "$(echo "$dt < 4" | bc)" -eq 1 ] || fail "abort took ${dt}s: a frozen node must not cost the phase deadline"
restart_node3 10

echo "== operating: health, version, round history, failover between daemons"
out=$(ctl health) || fail "health of node 0: $out"
echo "$out"
[ "$(echo "$out" | grep -c ' SERVING$')" -eq 4 ] || fail "not every service SERVING: $out"
"$BIN/refitctl" --daemon "unix:$RUN/refitd-2.sock" health >/dev/null || fail "health of node 2"
ctl version | grep -q "^refitctl [0-9]" || fail "version: $(ctl version 2>&1)"
ctl version | grep -q "^cluster (coordinator .*) [0-9]" || fail "version of the cluster: $(ctl version 2>&1)"
out=$(ctl rounds policy --limit 3) || fail "rounds: $out"
echo "$out"
[ "$(echo "$out" | grep -c '^policy ')" -eq 3 ] || fail "rounds --limit 3 listed: $out"
echo "$out" | tail -n 1 | grep -Eq '^policy +[0-9]+ +10 +committed' || fail "the last policy round is not version 10: $out"
ctl -o wide rounds reward --limit 1 | grep -q "REPLICAS" || fail "-o wide has no REPLICAS column"
out=$("$BIN/refitctl" --daemon "127.0.0.1:1,unix:$RUN/refitd-2.sock" status 2>&1) || fail "failover to node 2: $out"
out=$("$BIN/refitctl" --daemon 127.0.0.1:1 --timeout 2 status 2>&1); rc=$?
[ "$rc" -eq 3 ] || fail "an unreachable daemon: exit $rc, not 3: $out"
out=$(ctl refit policy 3 2>&1); rc=$?
[ "$rc" -eq 1 ] || fail "a refused refit: exit $rc, not 1: $out"
# Each node's part of the round, structured (RoundStats.nodes: what the benchmarks read).
ctl -o json refit policy 11 >"$RUN/nodes.json" || fail "round 11: $(cat "$RUN/nodes.json")"
python3 - "$RUN/nodes.json" <<'PY' || fail "RoundStats.nodes: $(cat "$RUN/nodes.json")"
import json, sys
s = json.load(open(sys.argv[1]))
nodes = {int(n.get("node", 0)): n for n in s["nodes"]}
assert sorted(nodes) == [0, 1, 2, 3], nodes
assert sum(int(n.get("bytes_received", 0)) + int(n.get("bytes_local", 0)) for n in nodes.values()) == int(s["bytes"]), s
assert all(float(n["data_plane_ms"]) > 0 and float(n["started_after_request_ms"]) >= 0 for n in nodes.values()), nodes
assert all(int(n["request_arrived_unix_us"]) >= int(n["request_sent_unix_us"]) > 0 for n in nodes.values()), nodes
PY
every_inference_ok policy 11

echo "== SIGTERM drains a node: its running round finishes, health says NOT_SERVING meanwhile, exit 0"
restart_node3 0 --prepare-delay-ms 2000
ctl refit policy 12 >"$RUN/drain-12.out" 2>&1 &
p=$!
wait_report "^preparing 12$" $(node3_workers policy) || fail "round 12 never reached node 3"
kill -TERM "${DAEMON_PID[3]}"
for _ in $(seq 50); do  # the signal is handled on the daemon's own time: 5 s at most
  out=$("$BIN/refitctl" --daemon "unix:$RUN/refitd-3.sock" health 2>&1); rc=$?
  [ "$rc" -eq 1 ] && break
  sleep 0.1
done
echo "$out"
[ "$rc" -eq 1 ] && echo "$out" | grep -q "NOT_SERVING" || fail "node 3 draining: health exit $rc: $out"
wait $p || fail "the round running while node 3 drained did not commit: $(cat "$RUN/drain-12.out")"
grep committed "$RUN/drain-12.out"
every_inference_ok policy 12
t0=$(date +%s.%N)
wait "${DAEMON_PID[3]}"; rc=$?
[ "$rc" -eq 0 ] || fail "node 3 exited $rc after SIGTERM, not 0"
grep -q "signal 15" "$RUN/daemon3.log" || fail "node 3 did not log the signal"

echo "== refitctl watch ends non-zero when its daemon dies (no abort)"
"$BIN/refitctl" --daemon "unix:$RUN/refitd-2.sock" watch >"$RUN/watch2.out" 2>&1 &
w=$!
wait_watching "$RUN/watch2.out" || fail "watch"
kill -9 "${DAEMON_PID[2]}"; wait "${DAEMON_PID[2]}" 2>/dev/null
wait $w; rc=$?
[ "$rc" -eq 3 ] || fail "watch exited $rc when its daemon died, not 3: $(cat "$RUN/watch2.out")"
grep -q "the watch stream ended" "$RUN/watch2.out" || fail "watch said nothing: $(cat "$RUN/watch2.out")"
echo "cluster test passed"
