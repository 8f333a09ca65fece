#!/usr/bin/env bash
# The scale harness on the GPU machine's 16 CPU cores (no GPU used): refitd's CPU backend, N
# daemons on loopback with sim-worker processes, the binaries from the bundle in .device (built
# here from main). From the repository root: OUT=$OUT DEADLINE=240 bash docs/runs/2026-12-08/call2.sh
# Logs and JSON packed into $OUT/call2.tgz.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 PYTHONUNBUFFERED=1
logs=$OUT/call2; mkdir -p "$logs"
T0=$SECONDS
DEADLINE=${DEADLINE:-240}
{ nproc; free -g | head -2; uptime; cat .device/commit.txt; } >"$logs/machine.txt" 2>&1
cat "$logs/machine.txt"
run() {  # run NAME ARGS...: one scale_bench.py run, skipped once DEADLINE is near
  local name=$1; shift
  local left=$((DEADLINE - (SECONDS - T0)))
  if [ "$left" -lt 30 ]; then echo "$name skipped (deadline)"; return; fi
  local t0=$SECONDS
  timeout "$left" python3 tests/scale/scale_bench.py --bin .device/bin --work-dir /tmp/scale-$name \
    --out "$logs/$name.json" "$@" >"$logs/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s"
  grep -E "N=|rounds committed|round CPU|abort" "$logs/$name.log" | cut -c1-220
}
mkdir -p /tmp/scale-a /tmp/scale-a1 /tmp/scale-b /tmp/scale-c
# The goal's pair first: 4 and 64 daemons, 2 workers each, in one run; then the curve.
run a --nodes 4,64 --model small --gpus-per-node 2 --rounds 100 --faults kill --idle-cpu-window 4
# The same with the coordinator's calls started from one thread (the default takes 4 of 16 cores).
run a1 --nodes 4,64 --model small --gpus-per-node 2 --rounds 100 --faults "" --idle-cpu-window 4 \
  --daemon-flag=--fanout-threads=1
run b --nodes 4,8,16,32,64 --model small --gpus-per-node 2 --rounds 50 --faults stop,kill
run c --nodes 64,4 --model small --gpus-per-node 2 --rounds 100 --faults "" --idle-cpu-window 4
echo "total $((SECONDS - T0))s"
tar czf "$OUT/call2.tgz" -C "$OUT" call2 2>/dev/null
