# Helpers to run a local refit cluster on loopback: daemons, sim-workers, refitctl.
# Sourced by tools/demo.sh and tests/integration/*.sh. Expects $BIN (folder with refitd,
# refitctl, refit-layout, sim-worker) and $RUN (a scratch folder).

declare -A DAEMON_PID WORKER_PID
CTL_ADDR=""

# start_daemon NODE [extra flags]: starts refitd for NODE; node 0 coordinates.
start_daemon() {
  local node=$1; shift
  local coord=()
  [ "$node" -ne 0 ] && coord=(--coordinator "$CTL_ADDR")
  rm -f "$RUN/daemon$node.addr"
  "$BIN/refitd" --node "$node" --listen 127.0.0.1:0 --data-listen 127.0.0.1:0 \
    --worker-socket "$RUN/refitd-$node.sock" --address-file "$RUN/daemon$node.addr" \
    --heartbeat 0.2 --heartbeats-missed 5 "${coord[@]}" "$@" >>"$RUN/daemon$node.log" 2>&1 &
  DAEMON_PID[$node]=$!
  for _ in $(seq 100); do
    [ -s "$RUN/daemon$node.addr" ] && break
    kill -0 "${DAEMON_PID[$node]}" 2>/dev/null || { echo "refitd $node died:"; tail -5 "$RUN/daemon$node.log"; return 1; }
    sleep 0.1
  done
  [ -s "$RUN/daemon$node.addr" ] || { echo "refitd $node did not start"; return 1; }
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
