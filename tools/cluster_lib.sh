# Helpers to run a local refit cluster on loopback: daemons, sim-workers, refitctl.
# Sourced by tools/demo.sh and tests/integration/*.sh. Expects $BIN (folder with refitd,
# refitctl, refit-layout, sim-worker) and $RUN (a scratch folder).

declare -A DAEMON_PID WORKER_PID
CTL_ADDR=""
CLUSTER_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# REFIT_TEST_TLS=1: mutual TLS between the daemons and for refitctl (as refit-operator), with
# certificates made for this run (tools/gen_certs.sh: $RUN/certs).
tls_flags() {
  [ "${REFIT_TEST_TLS:-}" = 1 ] || return 0
  local node=$1 certs="$RUN/certs"
  if [ ! -s "$certs/ca.pem" ]; then
    bash "$CLUSTER_LIB_DIR/gen_certs.sh" "$certs" 8 intruder >/dev/null 2>&1 || { echo "gen_certs.sh failed" >&2; return 1; }
  fi
  export REFIT_TLS_CERT="$certs/refit-operator.pem" REFIT_TLS_KEY="$certs/refit-operator.key" REFIT_TLS_CA="$certs/ca.pem"
  echo "--tls-cert $certs/node-$node.pem --tls-key $certs/node-$node.key --tls-ca $certs/ca.pem"
}

# start_daemon NODE [extra flags]: starts refitd for NODE; node 0 coordinates.
start_daemon() {
  local node=$1; shift
  local coord=()
  [ "$node" -ne 0 ] && coord=(--coordinator "$CTL_ADDR")
  rm -f "$RUN/daemon$node.addr"
  local tls
  tls=$(tls_flags "$node") || return 1
  tls_flags "$node" >/dev/null  # exports REFIT_TLS_* here (the line above ran in a subshell)
  # shellcheck disable=SC2086 # tls: paths without spaces, split on purpose
  "$BIN/refitd" --node "$node" --listen 127.0.0.1:0 --data-listen 127.0.0.1:0 \
    --worker-socket "$RUN/refitd-$node.sock" --address-file "$RUN/daemon$node.addr" \
    --heartbeat 0.2 --heartbeats-missed 5 $tls "${coord[@]}" "$@" >>"$RUN/daemon$node.log" 2>&1 &
  DAEMON_PID[$node]=$!
  for _ in $(seq 100); do
    [ -s "$RUN/daemon$node.addr" ] && break
    kill -0 "${DAEMON_PID[$node]}" 2>/dev/null || { echo "refitd $node died:"; tail -5 "$RUN/daemon$node.log"; return 1; }
    sleep 0.1
  done
  [ -s "$RUN/daemon$node.addr" ] || { echo "refitd $node did not start"; return 1; }
  if [ -n "$tls" ] && ! grep -q "TLS: certificate" "$RUN/daemon$node.log"; then
    echo "refitd $node was given TLS flags but does not say it uses TLS"; return 1
  fi
  [ "$node" -eq 0 ] && CTL_ADDR=$(cut -d' ' -f1 "$RUN/daemon0.addr")
  return 0
}

# start_worker KEY NODE GROUP ROLE LAYOUT WORKER [extra flags]
start_worker() {
  local key=$1 node=$2 group=$3 role=$4 layout=$5 worker=$6; shift 6
  "${WORKER_BIN:-$BIN/sim-worker}" --daemon "unix:$RUN/refitd-$node.sock" --group "$group" --role "$role" \
    --layout "$layout" --worker "$worker" --report "$RUN/$key.report" "$@" >>"$RUN/$key.log" 2>&1 &
  WORKER_PID[$key]=$!
}

# wait_registered KEY...: until each worker reported its registration (10 s at most).
wait_registered() {
  for key in "$@"; do
    for _ in $(seq 100); do
      grep -q "^registered" "$RUN/$key.report" 2>/dev/null && break
      sleep 0.1
    done
    grep -q "^registered" "$RUN/$key.report" 2>/dev/null || { echo "worker $key did not register:"; tail -3 "$RUN/$key.log"; return 1; }
  done
}

# wait_report PATTERN KEY...: until one of the workers KEY... reported a line matching PATTERN
# (an extended regex; 10 s at most).
wait_report() {
  local pattern=$1; shift
  for _ in $(seq 200); do
    for key in "$@"; do grep -Eq "$pattern" "$RUN/$key.report" 2>/dev/null && return 0; done
    sleep 0.05
  done
  echo "no worker of $* reported \"$pattern\""
  return 1
}

# wait_watching FILE: until the `refitctl watch` writing to FILE (stderr included) says its stream
# is open (10 s at most); every round started after this is seen.
wait_watching() {
  for _ in $(seq 200); do
    grep -q "^refitctl: watching the rounds of" "$1" 2>/dev/null && return 0
    sleep 0.05
  done
  echo "refitctl watch did not open its stream: $(cat "$1")"
  return 1
}

ctl() { "$BIN/refitctl" --daemon "$CTL_ADDR" "$@"; }

# workers_of LAYOUT: the worker names in a layout file, and their nodes ("name node" lines).
workers_of() {
  python3 -c 'import json,sys; [print(w["name"], w.get("node",0)) for w in json.load(open(sys.argv[1]))["workers"]]' "$1"
}

stop_all() {
  for pid in "${WORKER_PID[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${WORKER_PID[@]}"; do wait "$pid" 2>/dev/null; done
  # SIGCONT too: a daemon a test froze (SIGSTOP) would never act on the SIGTERM.
  for pid in "${DAEMON_PID[@]}"; do kill "$pid" 2>/dev/null; kill -CONT "$pid" 2>/dev/null; done
  for pid in "${DAEMON_PID[@]}"; do wait "$pid" 2>/dev/null; done
  return 0
}
