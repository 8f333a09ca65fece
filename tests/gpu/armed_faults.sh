#!/usr/bin/env bash
# Faults while a round is ARMED, on one GPU (the colocated cluster of tests/gpu/colocated_bench.sh:
# trainer FSDP=2 -> inference TP=2 of Llama-3-8B, widths / SCALE, every worker on GPU 0, one
# refitd --backend cuda --gpus 0, sim-worker-cuda workers).
#
# Armed rounds (docs/ROUNDS.md): where MPS shares the GPU (MPS=1, the default here: a control
# daemon of our own, tests/gpu/mps_lib.sh) or with --arm-rounds always (passed when MPS=0), refitd
# launches a round's copy work at PREPARE, held on the GPU behind a gate, lets it go at TRANSFER
# and calls it off on any failure. One engine (vllm-dp0-tp1, "the held engine") runs with
# --prepare-delay-ms HOLD_MS, so that every round stays in PREPARE -- armed -- for HOLD_MS after
# the other workers answered; each fault strikes STRIKE_S into that window. Workers carry a
# different value pattern each version (no --same-data): an engine checks every element of every
# COMMIT, so bytes of an older or failed round in its buffers would show.
#
# Each case: a healthy round first (on cuda it must be armed: the daemon logs "host let go the
# work launched at PREPARE" for it), then the round with the fault, then the repair and the next
# round. The cases, and what each asserts:
#   1 kill-engine:    kill -9 the held engine while armed. The round fails within PREPARE_S +
#                     SLACK_S, ABORTED, culprit (RoundStats.culprit) worker policy/vllm-dp0-tp1, its
#                     reason names it and no innocent worker; every survivor is told ABORT, no
#                     engine reports COMMIT of it; refitd alive. Engine restarted.
#   2 kill-trainer:   kill -9 trainer fsdp-rank1 while armed (the armed copy reads its CUDA IPC
#                     memory): the same, culprit policy/fsdp-rank1; refitd survives; restarted.
#   3 stop-engine:    SIGSTOP the held engine in PREPARE for PREPARE_S + 1 s, then SIGCONT: the
#                     round fails within PREPARE_S + SLACK_S of its start, culprit the engine; no
#                     COMMIT of it anywhere, not even from the engine once it wakes.
#   4 stop-refitd:    SIGSTOP refitd while armed, then SIGCONT; once per STOP_S ("1 2": 4a frozen
#                     1 s, shorter than the workers' keepalive verdict, about 2 s: the round can
#                     still commit; 4b 2 s: the workers drop their sessions). The round ends
#                     (COMMITTED or failed: either is fine) within PREPARE_S + STOP_S + SLACK_S;
#                     every COMMIT an engine reports is byte-exact, none is told both COMMIT and
#                     ABORT, none commits a failed round; an engine that misses a committed
#                     round's COMMIT (its session dropped during the freeze) was told the round
#                     failed and is named by the round's commit_note; refitd alive.
#   5 kill-refitd:    kill -9 refitd while armed: refitctl's call fails within SLACK_S, no engine
#                     commits; refitd restarted on the same socket and address file
#                     (tools/cluster_lib.sh start_daemon; state file kept). sim-worker survives
#                     its daemon's death: its library reports "disconnected", registers again by
#                     itself once the daemon is back ("registered" again); a worker that exited
#                     all the same is restarted (and the case says so).
# After every case: once the killed process is back and every worker registered, the next round
# commits within ROUND_S and every engine reports "commit V ok" (every byte checked). A last
# healthy round after case 5 must be armed again (cuda).
#
# Output: one line per case, "PASS case N NAME: ..." or "FAIL case N NAME: reason|reason...", then
# "armed_faults: N passed, M failed"; exit status 1 on any failure. A PASS line may carry
# "[note: ...]": something odd the case does not assert (e.g. a culprit that is not the worker its
# reason names). One JSON line per case in $RUN/results.jsonl (times, outcome, culprit, reason,
# whether the round before the fault was armed, problems, notes).
#
# Dry run on a CPU machine (host backend, sim-worker: nothing is armed there, so the "armed"
# assertions are skipped, every fault case runs; about a minute on 2 cores):
#   bazel build //daemon:refitd //client/tools:refitctl //client/tools:refit-layout //tests/workers:sim-worker
#   mkdir -p /tmp/afbin && ln -sf $PWD/bazel-bin/{daemon/refitd,client/tools/refitctl,client/tools/refit-layout,tests/workers/sim-worker} /tmp/afbin/
#   BIN=/tmp/afbin BACKEND=host bash tests/gpu/armed_faults.sh
# On the GPU machine, from the bundle (.device/bin: refitd, refitctl, refit-layout, sim-worker-cuda):
#   OUT=DIR bash tests/gpu/armed_faults.sh          # logs packed into DIR/armed_faults.tgz
#   MPS=0 OUT=DIR bash tests/gpu/armed_faults.sh    # no MPS: refitd --arm-rounds always
# Env: BIN (.device/bin), BACKEND (cuda | host), RUN (scratch dir, default mktemp -d), OUT (where
# the logs go packed; none: left in RUN), MPS (1 with cuda, 0 with host), SCALE (16), CONFIG,
# HOLD_MS (2000), STRIKE_S (0.4), PREPARE_S (5), STOP_S ("1 2"), SLACK_S (3), ROUND_S (60),
# READY_S (40), WORKER_FLAGS (more sim-worker flags, e.g. --vmm), DAEMON_FLAGS (more refitd flags).
set -uo pipefail
abspath() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
BIN=${BIN:-.device/bin}
[ -d "$BIN" ] && BIN=$(abspath "$BIN")
[ -n "${RUN:-}" ] && RUN=$(abspath "$RUN")
OUT=${OUT:-}
[ -n "$OUT" ] && OUT=$(abspath "$OUT")
cd "$(dirname "$0")/../.." || exit 2
[ "$BIN" = .device/bin ] && BIN=$PWD/.device/bin
BACKEND=${BACKEND:-cuda}
if [ "$BACKEND" = cuda ]; then
  WORKER_BIN=${WORKER_BIN:-$BIN/sim-worker-cuda}
  MPS=${MPS:-1}
  export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} NCCL_NVLS_ENABLE=0
else
  WORKER_BIN=$BIN/sim-worker
  MPS=${MPS:-0}
fi
CONFIG=${CONFIG:-tests/configs/llama3-8b.json}
SCALE=${SCALE:-16}
HOLD_MS=${HOLD_MS:-2000}   # the held engine's --prepare-delay-ms: how long every round stays armed
HOLD_S=$(awk -v m="$HOLD_MS" 'BEGIN { print m / 1000 }')
STRIKE_S=${STRIKE_S:-0.4}  # into that window, after the other workers answered PREPARE
PREPARE_S=${PREPARE_S:-5}  # refitd --prepare-timeout (above HOLD_MS and the workers' own PREPARE)
STOP_S=${STOP_S:-1 2}      # case 4: how long refitd is frozen, one case (4a, 4b...) each
SLACK_S=${SLACK_S:-3}      # scheduling on a loaded machine, a control call
ROUND_S=${ROUND_S:-60}     # a healthy round's deadline (refitctl --timeout)
READY_S=${READY_S:-40}     # workers registered and the group ready again
RUN=${RUN:-$(mktemp -d)}
mkdir -p "$RUN"
rm -f "$RUN"/*.report "$RUN"/*.log "$RUN"/*.addr "$RUN"/*.json "$RUN"/*.err "$RUN"/*.rc "$RUN"/results.jsonl "$RUN"/*.state
source tools/cluster_lib.sh || exit 2
source tests/gpu/mps_lib.sh || exit 2
GROUP=policy
HELD=vllm-dp0-tp1       # the engine that holds every round in PREPARE, and the engine victim
OTHER_ENGINE=vllm-dp0-tp0
TRAINER=fsdp-rank1      # the trainer victim
declare -A ROLE LAYOUT EXTRA MARK FAULT_MARK
KEYS=()
ENGINES=()
V=0                     # the last version asked for (versions only grow, across restarts too)
PASSED=0 FAILED=0

now() { echo "$EPOCHREALTIME"; }
since_s() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }
add() { awk 'BEGIN { s = 0; for (i = 1; i < ARGC; i++) s += ARGV[i]; print s }' "$@"; }  # seconds may be fractions
nlines() { if [ -f "$RUN/$1.report" ]; then wc -l <"$RUN/$1.report"; else echo 0; fi; }
since() { tail -n +$((${2:-${MARK[$1]}} + 1)) "$RUN/$1.report" 2>/dev/null; }
mark_all() { for k in "${KEYS[@]}"; do MARK[$k]=$(nlines "$k"); done; }
alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
daemon_alive() { alive "${DAEMON_PID[0]:-}"; }
quiet_ctl() { "$BIN/refitctl" --daemon "$CTL_ADDR" --timeout "${CTL_TIMEOUT:-3}" "$@" 2>/dev/null; }
problem() { PROBLEMS+=("$*"); }
note() { NOTES+=("$*"); }  # odd, not what the case asserts: shown with its result

cleanup() {
  local rc=$?
  for k in "${!WORKER_PID[@]}"; do kill -CONT "${WORKER_PID[$k]}" 2>/dev/null; done
  for k in "${!DAEMON_PID[@]}"; do kill -CONT "${DAEMON_PID[$k]}" 2>/dev/null; done
  stop_all
  [ "$MPS" = 1 ] && stop_mps "$RUN/mps_log"
  if [ -n "$OUT" ]; then
    mkdir -p "$OUT" && tar czf "$OUT/armed_faults.tgz" -C "$RUN" . 2>/dev/null && echo "logs: $OUT/armed_faults.tgz"
  else
    echo "logs: $RUN"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

setup_fail() { echo "FAIL setup: $*"; tail -n 5 "$RUN"/daemon0.log 2>/dev/null; echo "armed_faults: 0 passed, 1 failed"; exit 1; }

# --- the cluster --------------------------------------------------------------------------------
for b in refitd refitctl refit-layout; do [ -x "$BIN/$b" ] || setup_fail "no $BIN/$b"; done
[ -x "$WORKER_BIN" ] || setup_fail "no $WORKER_BIN"
if [ "$MPS" = 1 ]; then
  start_mps "${MPS_DIR:-/tmp/refit-mps-armed}" >"$RUN/mps_start.log" 2>&1 ||
    setup_fail "MPS: the control daemon did not start: $(tail -n 2 "$RUN/mps_start.log")"
fi
L=("$BIN/refit-layout" --config "$CONFIG" --scale-down "$SCALE")
"${L[@]}" --side trainer --fsdp 2 --gpus-per-node 2 -o "$RUN/t.json" >"$RUN/layout.log" 2>&1 || setup_fail "refit-layout: $(tail -n 2 "$RUN/layout.log")"
"${L[@]}" --side inference --tp 2 --gpus-per-node 2 -o "$RUN/i.json" >>"$RUN/layout.log" 2>&1 || setup_fail "refit-layout: $(tail -n 2 "$RUN/layout.log")"
for f in "$RUN/t.json" "$RUN/i.json"; do
  python3 -c 'import json,sys; l=json.load(open(sys.argv[1])); [w.update(node=0, gpu=0) for w in l["workers"]]; json.dump(l, open(sys.argv[1], "w"))' "$f"
done
read -r -a worker_flags <<<"${WORKER_FLAGS:-}"
while read -r name _; do KEYS+=("$name"); ROLE[$name]=trainer; LAYOUT[$name]=$RUN/t.json; EXTRA[$name]=""; done < <(workers_of "$RUN/t.json")
while read -r name _; do KEYS+=("$name"); ENGINES+=("$name"); ROLE[$name]=inference; LAYOUT[$name]=$RUN/i.json; EXTRA[$name]=""; done < <(workers_of "$RUN/i.json")
for k in "$HELD" "$OTHER_ENGINE" "$TRAINER"; do [ -n "${ROLE[$k]:-}" ] || setup_fail "no worker $k in the layouts"; done
EXTRA[$HELD]="--prepare-delay-ms $HOLD_MS"

DFLAGS=(--backend "$BACKEND" --max-message-bytes $((64 << 20)) --prepare-timeout "$PREPARE_S" --commit-timeout 30
        --transfer-timeout 30 --heartbeat 0.5 --heartbeats-missed 10)
if [ "$BACKEND" = cuda ]; then
  DFLAGS+=(--gpus 0 --staging-bytes $((256 << 20)))
  [ "$MPS" = 1 ] || DFLAGS+=(--arm-rounds always)
fi
read -r -a daemon_flags <<<"${DAEMON_FLAGS:-}"
DFLAGS+=("${daemon_flags[@]}")

# restart_daemon: refitd again on the same socket, address file and state file. start_daemon
# allows it 10 s to serve; a GPU just freed by a killed refitd (MPS cleaning up its client) may take
# longer: 30 s more, for the same process.
restart_daemon() {
  start_daemon 0 "${DFLAGS[@]}" >>"$RUN/harness.log" 2>&1 && return 0
  alive "${DAEMON_PID[0]}" || return 1
  for _ in $(seq 300); do [ -s "$RUN/daemon0.addr" ] && break; sleep 0.1; done
  [ -s "$RUN/daemon0.addr" ] || return 1
  CTL_ADDR=$(cut -d' ' -f1 "$RUN/daemon0.addr")
}

# start_w KEY: (re)starts a worker process; MARK_REG[KEY]: its report's length before.
declare -A MARK_REG
start_w() {
  local k=$1 extra
  read -r -a extra <<<"${EXTRA[$k]}"
  MARK_REG[$k]=$(nlines "$k")
  start_worker "$k" 0 "$GROUP" "${ROLE[$k]}" "${LAYOUT[$k]}" "$k" --register-timeout 60 "${extra[@]}" "${worker_flags[@]}"
}
# registered_since KEY MARK SECONDS: until the worker reports a registration after MARK.
registered_since() {
  local k=$1 m=$2 t0; t0=$(now)
  while le "$(since_s "$t0")" "$3"; do
    since "$k" "$m" | grep -q "^registered" && return 0
    alive "${WORKER_PID[$k]}" || return 1
    sleep 0.1
  done
  return 1
}
# wait_ready SECONDS: until the coordinator lists every worker, connected, and the group is ready.
wait_ready() {
  local t0; t0=$(now)
  while le "$(since_s "$t0")" "$1"; do
    quiet_ctl -o json status >"$RUN/ready.status.json"
    quiet_ctl -o json workers "$GROUP" >"$RUN/ready.workers.json"
    python3 - "$RUN/ready.status.json" "$RUN/ready.workers.json" "$GROUP" "${KEYS[@]}" <<'PY' 2>/dev/null && return 0
import json, sys
status, workers = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
group, keys = sys.argv[3], sys.argv[4:]
have = {w["worker_id"] for w in workers.get("workers", []) if w.get("connected")}
ready = any(g["name"] == group and g.get("ready") for g in status.get("groups", []))
sys.exit(0 if ready and all(f"{group}/{k}" in have for k in keys) else 1)
PY
    sleep 0.2
  done
  return 1
}
# The round's log line of an armed round, which LogLater writes after the node answered.
armed_logged() {  # ROUND_ID
  local t0; t0=$(now)
  while le "$(since_s "$t0")" 3; do
    grep -qF "\"$GROUP\" round $1: host let go the work launched at PREPARE" "$RUN/daemon0.log" && return 0
    sleep 0.1
  done
  return 1
}
jfield() {  # FILE KEY: a top-level field of the last JSON line of FILE
  python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]).get(sys.argv[2], ""))' "$1" "$2" 2>/dev/null
}

# healthy_round LABEL [must_be_armed]: the next version must commit within ROUND_S and every engine
# must report "commit V ok" (every element checked). Sets HR_ARMED (yes, no, n/a) and HR_S; adds
# problems. With must_be_armed on cuda: the daemon logged that it let go work armed at PREPARE.
ARMED_ROUNDS=0 UNARMED_ROUNDS=0
healthy_round() {
  local label=$1 must=${2:-} t0 rc rid e line
  V=$((V + 1)); mark_all; t0=$(now)
  "$BIN/refitctl" --daemon "$CTL_ADDR" --timeout "$ROUND_S" -o json refit "$GROUP" "$V" >"$RUN/round$V.json" 2>"$RUN/round$V.err"
  rc=$?
  HR_S=$(since_s "$t0"); HR_ARMED=n/a
  if [ $rc -ne 0 ]; then
    problem "$label (version $V) did not commit: rc $rc after ${HR_S}s: $(tail -c 400 "$RUN/round$V.err" | tr '\n' ' ')"
    LAST_OK=0; return 1
  fi
  for e in "${ENGINES[@]}"; do
    local t1; t1=$(now)
    while ! since "$e" | grep -q "^commit $V " && le "$(since_s "$t1")" 10; do sleep 0.05; done
    line=$(since "$e" | grep "^commit $V " | tail -n 1)
    if [ -z "$line" ]; then problem "$label (version $V) committed, but $e reports no COMMIT: $(since "$e" | tail -n 2 | tr '\n' ' ')"
    elif [[ "$line" != *" ok "* ]]; then problem "$label (version $V): $e did not receive it exactly: $line"; fi
  done
  if [ "$BACKEND" = cuda ]; then
    rid=$(jfield "$RUN/round$V.json" round_id)
    if armed_logged "$rid"; then HR_ARMED=yes; ARMED_ROUNDS=$((ARMED_ROUNDS + 1)); else HR_ARMED=no; UNARMED_ROUNDS=$((UNARMED_ROUNDS + 1)); fi
    [ -n "$must" ] && [ "$HR_ARMED" != yes ] &&
      problem "$label (version $V, round $rid) was not armed: no \"host let go the work launched at PREPARE\" in the daemon log"
  fi
  LAST_OK=1
  return 0
}

# heal: every process running and not stopped, every worker registered, the group ready, and the
# last round a committed one (else a round that commits first).
heal() {
  local k
  daemon_alive && kill -CONT "${DAEMON_PID[0]}" 2>/dev/null
  if ! daemon_alive; then
    LAST_OK=0  # a restart: the next round builds the schedule, unarmed; verified first
    restart_daemon || { problem "heal: refitd did not start again: $(tail -n 3 "$RUN/harness.log" | tr '\n' ' ')"; return 1; }
  fi
  for k in "${KEYS[@]}"; do
    alive "${WORKER_PID[$k]:-}" && kill -CONT "${WORKER_PID[$k]}" 2>/dev/null
    if ! alive "${WORKER_PID[$k]:-}"; then LAST_OK=0; start_w "$k"; fi
  done
  wait_ready "$READY_S" || { problem "heal: the group was not ready within ${READY_S}s"; return 1; }
  [ "${LAST_OK:-0}" = 1 ] || healthy_round "heal: the round that verifies the cluster" || return 1
}

# start_round: the next version in the background (refitctl --timeout ROUND_S: never hangs).
start_round() {
  V=$((V + 1)); FAULT_V=$V; mark_all
  for k in "${KEYS[@]}"; do FAULT_MARK[$k]=${MARK[$k]}; done
  rm -f "$RUN/round$V.rc"
  ( "$BIN/refitctl" --daemon "$CTL_ADDR" --timeout "$ROUND_S" -o json refit "$GROUP" "$V" >"$RUN/round$V.json" 2>"$RUN/round$V.err"
    echo "$? $EPOCHREALTIME" >"$RUN/round$V.rc" ) &
  T_ROUND=$(now)
}
round_ended() { [ -s "$RUN/round$V.rc" ]; }
round_rc() { cut -d' ' -f1 "$RUN/round$V.rc" 2>/dev/null; }
# wait_round_end SECONDS (from T0): 0 once the refitctl call returned. Sets ENDED_S (from T_STRIKE).
wait_round_end() {
  local t0=$2
  while ! round_ended && le "$(since_s "$t0")" "$1"; do sleep 0.05; done
  round_ended || return 1
  ENDED_S=$(awk -v a="$T_STRIKE" -v b="$(cut -d' ' -f2 "$RUN/round$V.rc")" 'BEGIN { printf "%.2f", b - a }')
}
# await_armed: returns once PREPARE is under way and every worker but the held engine answered it
# (the round is armed: RoundPreparing ran before the workers were asked), STRIKE_S later.
await_armed() {
  local k t0; t0=$(now)
  while le "$(since_s "$t0")" 30; do
    local all=1
    for k in "${KEYS[@]}"; do
      [ "$k" = "$HELD" ] && continue
      since "$k" | grep -q "^prepare $V\$" || all=0
    done
    [ $all = 1 ] && break
    round_ended && break
    sleep 0.02
  done
  sleep "$STRIKE_S"
  if round_ended; then
    problem "the round (version $V) ended (refitctl exit $(round_rc)) before the fault could strike (HOLD_MS=$HOLD_MS too short here?): $(tail -c 200 "$RUN/round$V.err")"
    return 1
  fi
  for k in "${KEYS[@]}"; do
    [ "$k" = "$HELD" ] && continue
    since "$k" | grep -q "^prepare $V\$" || { problem "$k never answered PREPARE of version $V within 30 s"; return 1; }
  done
  if since "$HELD" | grep -q "^prepare $V\$"; then
    problem "the held engine had answered PREPARE before the fault (HOLD_MS=$HOLD_MS too short here): the round was no longer in PREPARE"
    return 1
  fi
  T_STRIKE=$(now)
  return 0
}
# outcome: the round's last state in the coordinator's round log (state, culprit, reason).
outcome() {
  CTL_TIMEOUT=5 quiet_ctl -o json rounds "$GROUP" --limit 50 >"$RUN/rounds$V.json"
  read -r O_STATE O_CULPRIT O_PHASE < <(python3 - "$RUN/rounds$V.json" "$V" <<'PY'
import json, sys
try:
    rounds = json.load(open(sys.argv[1])).get("rounds", [])
except Exception:
    rounds = []
mine = [r for r in rounds if str(r.get("version")) == sys.argv[2]]
if not mine:
    print("none - -"); sys.exit()
r, c = mine[-1], mine[-1].get("culprit", {})
who = {"WORKER": c.get("worker_id"), "NODE": f"node{c.get('node', 0)}", "COORDINATOR": "coordinator"}.get(c.get("kind"), "-")
print(r.get("state", "?"), who or "-", c.get("phase") or "-")
PY
)
  O_REASON=$(python3 -c '
import json, sys
try:
    rounds = [r for r in json.load(open(sys.argv[1])).get("rounds", []) if str(r.get("version")) == sys.argv[2]]
    print((rounds[-1].get("reason") or "").replace("\n", " ") if rounds else "")
except Exception:
    print("")' "$RUN/rounds$V.json" "$V")
  # A committed round's note: the workers that did not confirm its COMMIT (docs/ROUNDS.md).
  O_NOTE=$(python3 -c '
import json, sys
try:
    rounds = [r for r in json.load(open(sys.argv[1])).get("rounds", []) if str(r.get("version")) == sys.argv[2]]
    print((rounds[-1].get("commit_note") or "").replace("\n", " ") if rounds else "")
except Exception:
    print("")' "$RUN/rounds$V.json" "$V")
}
# check_failed_round CULPRIT: the round ABORTED, naming CULPRIT (structured and in the reason), and
# no innocent worker in the reason.
check_failed_round() {
  local culprit=$1 k
  local rc; rc=$(round_rc)
  [ "$rc" = 0 ] && problem "the round (version $V) COMMITTED: $(tail -n 1 "$RUN/round$V.json")"
  outcome
  [ "$O_STATE" = ABORTED ] || problem "the round's state is $O_STATE, not ABORTED (refitctl: $(tr '\n' ' ' <"$RUN/round$V.err" | tail -c 300))"
  [ "$O_CULPRIT" = "$GROUP/$culprit" ] || problem "the culprit is $O_CULPRIT, not $GROUP/$culprit: $O_REASON"
  [ "$O_PHASE" = PREPARE ] || problem "the culprit's phase is $O_PHASE, not PREPARE: $O_REASON"
  [[ "$O_REASON" == *"$culprit"* ]] || problem "the reason does not name $culprit: $O_REASON"
  for k in "${KEYS[@]}"; do
    [ "$k" = "$culprit" ] && continue
    [[ "$O_REASON" == *"\"$GROUP/$k\""* ]] && problem "the reason names innocent $k: $O_REASON"
  done
}
# survivors_told SECONDS VICTIM...: every worker but the victims reports an ABORT (or, killed
# daemon, a lost session) of this round within SECONDS; no engine reports a COMMIT of it.
survivors_told() {
  local limit=$1 k t0; shift
  t0=$(now)
  for k in "${KEYS[@]}"; do
    [[ " $* " == *" $k "* ]] && continue
    while ! since "$k" | grep -qE "^(abort|disconnected)" && le "$(since_s "$t0")" "$limit"; do sleep 0.05; done
    since "$k" | grep -qE "^(abort|disconnected)" ||
      problem "$k was not told the round failed within ${limit}s: $(since "$k" | tail -n 2 | tr '\n' ' ')"
  done
}
no_commit_of_v() {
  local e
  for e in "${ENGINES[@]}"; do
    since "$e" | grep -q "^commit $V " && problem "$e reports COMMIT of the failed version $V: $(since "$e" | grep "^commit $V " | tail -n 1)"
  done
}
daemon_must_live() { daemon_alive || problem "refitd exited: $(tail -n 3 "$RUN/daemon0.log" | tr '\n' ' ')"; }
# recovery: after the repair, every worker registered and the group ready, the next round
# commits byte-exact.
recovery() {
  daemon_alive || { problem "no refitd to run the next round with"; LAST_OK=0; return 1; }
  wait_ready "$READY_S" || { problem "the group was not ready again within ${READY_S}s of the repair"; LAST_OK=0; return 1; }
  healthy_round "after the $1, the next round" || return 1
  REC_S=$HR_S
}
restart_victim() {  # KEY: after its kill -9
  local k=$1
  wait "${WORKER_PID[$k]}" 2>/dev/null
  start_w "$k"
  registered_since "$k" "${MARK_REG[$k]}" 60 || problem "$k did not register again after its restart: $(tail -n 2 "$RUN/$k.log" | tr '\n' ' ')"
}

# finish N NAME SUMMARY: the case's line and JSON record.
finish() {
  local n=$1 name=$2 summary=$3
  # Workers told ABORT of this round twice (their library, on losing the daemon, then the daemon
  # again on their new session): noted.
  local k twice=()
  if [ -n "$FAULT_V" ]; then
    for k in "${KEYS[@]}"; do
      since "$k" "${FAULT_MARK[$k]:-0}" | grep -o "^abort round [0-9]*:" | sort | uniq -d | grep -q . && twice+=("$k")
    done
  fi
  [ ${#twice[@]} -gt 0 ] && note "told ABORT of the round twice (on losing the daemon, then by the daemon on the new session): ${twice[*]}"
  python3 - "$n" "$name" "$FAULT_V" "$(IFS='|'; echo "${NOTES[*]}")" "${O_STATE:-}" "${O_CULPRIT:-}${O_PHASE:+ in $O_PHASE}" "${O_REASON:-}" "${ENDED_S:-}" "${REC_S:-}" "$PRE_ARMED" "$summary" \
    "${PROBLEMS[@]}" >>"$RUN/results.jsonl" <<'PY'
import json, sys
a = sys.argv[1:]
notes = [n for n in a[3].split("|") if n]
a = a[:3] + a[4:]
print(json.dumps({"case": a[0], "name": a[1], "version": int(a[2]) if a[2] else None, "outcome": a[3],
                  "culprit": a[4], "reason": a[5], "ended_after_fault_s": float(a[6]) if a[6] else None,
                  "recovery_round_s": float(a[7]) if a[7] else None, "armed_before": a[8], "summary": a[9],
                  "problems": a[10:], "notes": notes, "passed": not a[10:]}))
PY
  if [ ${#PROBLEMS[@]} -eq 0 ]; then
    PASSED=$((PASSED + 1)); echo "PASS case $n $name: $summary${NOTES[*]:+ [note: $(IFS='|'; echo "${NOTES[*]}")]}"
  else
    FAILED=$((FAILED + 1)); local IFS='|'; echo "FAIL case $n $name: ${PROBLEMS[*]}"
    echo "--- case $n: daemon log tail" >>"$RUN/harness.log"; tail -n 20 "$RUN/daemon0.log" >>"$RUN/harness.log" 2>/dev/null
  fi
}
# begin: heal, then the healthy round before the fault (armed on cuda). 1 when the case cannot run
# (the cluster could not be made whole, or that round did not commit).
begin() {
  PROBLEMS=(); NOTES=(); FAULT_V="" O_STATE="" O_CULPRIT="" O_PHASE="" O_REASON="" ENDED_S="" REC_S="" PRE_ARMED=n/a
  heal || return 1
  # Not armed (cuda) is a problem of the case; the fault strikes all the same.
  healthy_round "the round before the fault" must || return 1
  PRE_ARMED=$HR_ARMED
}

start_daemon 0 "${DFLAGS[@]}" >>"$RUN/harness.log" 2>&1 || setup_fail "refitd did not start: $(tail -n 3 "$RUN/harness.log")"
if [ "$BACKEND" = cuda ]; then
  for _ in $(seq 50); do grep -q "(--arm-rounds; MPS" "$RUN/daemon0.log" && break; sleep 0.1; done
  grep -q "armed at PREPARE, let go at TRANSFER" "$RUN/daemon0.log" ||
    setup_fail "refitd does not arm rounds: $(grep -m1 "arm-rounds" "$RUN/daemon0.log")"
fi
for k in "${KEYS[@]}"; do start_w "$k"; done
for k in "${KEYS[@]}"; do registered_since "$k" 0 120 || setup_fail "$k did not register: $(tail -n 3 "$RUN/$k.log")"; done
wait_ready "$READY_S" || setup_fail "the group was not ready: $(quiet_ctl status)"
PROBLEMS=()
healthy_round "the first round" || setup_fail "${PROBLEMS[*]}"
echo "setup: $BACKEND, MPS=$MPS, scale 1/$SCALE, $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("bytes","?"))' "$RUN/round$V.json" 2>/dev/null) bytes a round, held engine $HELD (+${HOLD_MS} ms in PREPARE), first round ${HR_S}s, run dir $RUN"

# --- cases 1 and 2: kill -9 an engine, then a trainer, while armed -------------------------------
# kill_case N NAME VICTIM TOLD_S: the round fails within PREPARE_S + SLACK_S naming VICTIM, every
# survivor is told within TOLD_S, nobody commits it, refitd lives; VICTIM restarted, next round exact.
kill_case() {
  local n=$1 name=$2 victim=$3 told_s=$4
  if begin; then
    start_round
    if await_armed; then
      kill -9 "${WORKER_PID[$victim]}"; wait "${WORKER_PID[$victim]}" 2>/dev/null
      if wait_round_end "$(add "$PREPARE_S" "$SLACK_S")" "$T_STRIKE"; then
        check_failed_round "$victim"
      else
        problem "the round did not end within $(add "$PREPARE_S" "$SLACK_S")s of the kill"
      fi
      survivors_told "$told_s" "$victim"
      no_commit_of_v
      daemon_must_live
      restart_victim "$victim"
      recovery "kill -9 of $victim"
    fi
  fi
  finish "$n" "$name" "round ${O_STATE:-?} ${ENDED_S:-?}s after the kill, culprit ${O_CULPRIT:-?}; restarted, next round committed byte-exact in ${REC_S:-?}s (armed before: $PRE_ARMED)"
}
kill_case 1 kill-engine "$HELD" "$(add "$PREPARE_S" "$SLACK_S")"
# The trainer: the armed copy reads its memory. The held engine is told once its on_prepare
# returns (HOLD_MS).
kill_case 2 kill-trainer "$TRAINER" "$(add "$PREPARE_S" "$SLACK_S" "$HOLD_S" 1)"

# --- case 3: SIGSTOP an engine in PREPARE past the PREPARE timeout --------------------------------
if begin; then
  start_round
  if await_armed; then
    kill -STOP "${WORKER_PID[$HELD]}"
    # The round must fail by its PREPARE deadline (from its start) plus the slack, the engine still
    # frozen (it is thawed PREPARE_S + 1 s after the strike).
    limit=$(awk -v a="$T_ROUND" -v b="$T_STRIKE" -v p="$PREPARE_S" -v s="$SLACK_S" 'BEGIN { printf "%.2f", p + s - (b - a) }')
    ended=0
    wait_round_end "$limit" "$T_STRIKE" && ended=1
    left=$(awk -v a="$(since_s "$T_STRIKE")" -v p="$PREPARE_S" 'BEGIN { d = p + 1 - a; if (d < 0) d = 0; printf "%.2f", d }')
    sleep "$left"
    kill -CONT "${WORKER_PID[$HELD]}"
    if [ $ended = 1 ]; then
      check_failed_round "$HELD"
      ENDED_S=$(awk -v e="$ENDED_S" -v a="$T_ROUND" -v b="$T_STRIKE" 'BEGIN { printf "%.2f", e + (b - a) }')  # from the round's start
    else
      problem "the round did not end within PREPARE_S + SLACK_S = $(add "$PREPARE_S" "$SLACK_S")s of its start"
    fi
    survivors_told "$SLACK_S" "$HELD"
    # Thawed: it finishes its PREPARE (HOLD_MS) and must then learn the round failed, never COMMIT.
    t0=$(now)
    while ! since "$HELD" | grep -qE "^(abort|disconnected)" && le "$(since_s "$t0")" "$(add "$HOLD_S" "$SLACK_S")"; do sleep 0.05; done
    since "$HELD" | grep -qE "^(abort|disconnected)" ||
      problem "$HELD, thawed, was not told the round failed: $(since "$HELD" | tail -n 2 | tr '\n' ' ')"
    no_commit_of_v
    daemon_must_live
    alive "${WORKER_PID[$HELD]}" || problem "$HELD exited after SIGCONT: $(tail -n 2 "$RUN/$HELD.log" | tr '\n' ' ')"
    recovery "SIGSTOP of $HELD"
  fi
fi
finish 3 stop-engine "round ${O_STATE:-?} ${ENDED_S:-?}s after its start (PREPARE timeout ${PREPARE_S}s), culprit ${O_CULPRIT:-?}; thawed, next round committed byte-exact in ${REC_S:-?}s (armed before: $PRE_ARMED)"

# --- case 4: SIGSTOP refitd while armed, once per STOP_S (1 s: the workers' sessions outlive it;
# 2 s: their keepalive, about 2 s, drops them) -------------------------------------------------------
stop_refitd_case() {  # CASE SECONDS
  local n=$1 stop=$2 limit rc e line t0 committed
  if begin; then
    start_round
    if await_armed; then
      kill -STOP "${DAEMON_PID[0]}"
      sleep "$stop"
      kill -CONT "${DAEMON_PID[0]}"
      limit=$(awk -v p="$PREPARE_S" -v t="$stop" -v s="$SLACK_S" 'BEGIN { print p + t + s }')
      if wait_round_end "$limit" "$T_STRIKE"; then
        rc=$(round_rc)
        outcome
        if [[ "$O_CULPRIT" == "$GROUP/"* ]] && [[ "$O_REASON" != *"\"$O_CULPRIT\""* ]]; then
          note "the round's culprit ($O_CULPRIT in $O_PHASE) is not the worker its reason names: $O_REASON"
        fi
        # Every engine agrees with the outcome; whatever it reports it received is exact.
        t0=$(now)
        for e in "${ENGINES[@]}"; do
          while ! since "$e" | grep -qE "^(commit $V |abort|disconnected)" && le "$(since_s "$t0")" "$(add "$SLACK_S" "$HOLD_S")"; do sleep 0.05; done
        done
        sleep 0.5  # a late, second word (COMMIT after ABORT, or the reverse) would show
        committed=()
        for e in "${ENGINES[@]}"; do
          line=$(since "$e" | grep "^commit $V " | tail -n 1)
          [ -z "$line" ] && continue
          committed+=("$e")
          [[ "$line" != *" ok "* ]] && problem "$e reports a wrong byte: $line"
          since "$e" | grep -q "^abort" && problem "$e was told both COMMIT and ABORT of version $V: $(since "$e" | tr '\n' ' ')"
        done
        if [ "$rc" = 0 ]; then
          O_STATE=COMMITTED
          # An engine whose session dropped during the freeze may miss the COMMIT: allowed only if
          # it was told the round failed (its library lost the daemon) and the round's commit
          # note names it (a committed round is not undone for a worker that left; the user is
          # told which one did not confirm).
          for e in "${ENGINES[@]}"; do
            [[ " ${committed[*]} " == *" $e "* ]] && continue
            if [[ "$O_NOTE" == *"\"$GROUP/$e\""* ]] && since "$e" | grep -qE "^(abort|disconnected)"; then
              note "$e missed the COMMIT (its session dropped during the freeze); the round's commit note names it: $O_NOTE"
            else
              problem "the round COMMITTED, yet $e neither reports its COMMIT nor is named by its commit note (\"$O_NOTE\")"
            fi
          done
        else
          no_commit_of_v
          case $O_STATE in ABORTED|none) ;; *) problem "refitctl failed (rc $rc) but the round log says $O_STATE" ;; esac
        fi
      else
        problem "the round did not end within ${limit}s of the freeze"
      fi
      daemon_must_live
      recovery "SIGSTOP of refitd"
    fi
  fi
  finish "$n" "stop-refitd-${stop}s" "frozen ${stop}s: round ${O_STATE:-?} ${ENDED_S:-?}s after the freeze (culprit ${O_CULPRIT:-?}); next round committed byte-exact in ${REC_S:-?}s (armed before: $PRE_ARMED)"
}
i=0
for stop in $STOP_S; do
  i=$((i + 1))
  stop_refitd_case "4$(echo abcdefghij | cut -c$i)" "$stop"
done

# --- case 5: kill -9 refitd while armed, restart it ----------------------------------------------
FINAL_ARMED="not run"
if begin; then
  start_round
  if await_armed; then
    kill -9 "${DAEMON_PID[0]}"
    wait "${DAEMON_PID[0]}" 2>/dev/null
    if wait_round_end "$SLACK_S" "$T_STRIKE"; then
      [ "$(round_rc)" = 0 ] && problem "refitctl reports the round COMMITTED though refitd was killed in its PREPARE"
      O_STATE="failed (refitctl exit $(round_rc): $(tr '\n' ' ' <"$RUN/round$V.err" | sed 's/^refitctl: //; s/ *$//' | cut -c1-120))"
    else
      problem "refitctl's call did not return within ${SLACK_S}s of refitd's death"
    fi
    # Every worker loses its session (keepalive: about 2 s) and keeps running.
    survivors_told "$(add "$SLACK_S" "$HOLD_S")"
    no_commit_of_v
    restarted=()
    for k in "${KEYS[@]}"; do alive "${WORKER_PID[$k]}" || restarted+=("$k"); done
    restart_daemon || problem "refitd did not start again: $(tail -n 3 "$RUN/harness.log" | tr '\n' ' ')"
    for k in "${restarted[@]}"; do start_w "$k"; done
    for k in "${KEYS[@]}"; do
      m=${MARK[$k]}; [[ " ${restarted[*]} " == *" $k "* ]] && m=${MARK_REG[$k]}
      registered_since "$k" "$m" 30 || problem "$k did not register again with the restarted refitd: $(since "$k" "$m" | tail -n 2 | tr '\n' ' ')"
    done
    [ ${#restarted[@]} -eq 0 ] || problem "workers exited when refitd died (restarted): ${restarted[*]}"
    daemon_alive && recovery "kill -9 of refitd"
    # After a restart the first round builds the schedule; the one after must be armed again.
    [ ${#PROBLEMS[@]} -eq 0 ] && healthy_round "the second round after the restart" must && FINAL_ARMED=$HR_ARMED
  fi
fi
finish 5 kill-refitd "round ${O_STATE:-?} ${ENDED_S:-?}s after the kill; workers re-registered by themselves; next round committed byte-exact in ${REC_S:-?}s, the one after armed: $FINAL_ARMED"

daemon_alive || echo "note: refitd is not running at the end"
if [ "$BACKEND" = cuda ]; then
  echo "armed: $ARMED_ROUNDS healthy rounds let go work armed at PREPARE, $UNARMED_ROUNDS not (the first after each restart is not)"
  echo "daemon log: $(grep -c "called off" "$RUN/daemon0.log") \"called off\", $(grep -c "did not run on GPU" "$RUN/daemon0.log") \"armed work did not run; launched again\", $(grep -c "not made ready at PREPARE" "$RUN/daemon0.log") \"not made ready at PREPARE\" warnings"
fi
echo "armed_faults: $PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ]
