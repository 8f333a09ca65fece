#!/usr/bin/env bash
# GPU machine: what the GPU's switch from another process's context to ours costs a
# copy, and what removes it. tests/bench/ipc_copy_bench's host_sees_done lines (how long after the
# GPU finished a 1 GiB copy the host saw it done; "..._after_other_process": right after another
# process ran GPU work) with each VARIANT: "default"; "connections1" and "connections32"
# (CUDA_DEVICE_MAX_CONNECTIONS for both processes, 8 by default: the hardware queues a context
# has, whose state a switch saves and restores); "mps" (both processes clients of one MPS server:
# one context on the GPU). One JSON line per result, tagged with its variant, in
# $OUT/switch_cost.jsonl; logs in $OUT/switch_cost.tgz.
#   there:  OUT=DIR VARIANTS="default connections1 mps" bash tests/gpu/switch_cost.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-out/gpu}
logs=$out/switch_cost
mkdir -p "$logs"
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0
source tests/gpu/mps_lib.sh
trap stop_mps EXIT
status=0
for variant in ${VARIANTS:-default connections1 connections32 mps}; do
  env=()
  case $variant in
    default) ;;
    connections*) env=(CUDA_DEVICE_MAX_CONNECTIONS=${variant#connections}) ;;
    mps) if ! start_mps /tmp/refit-mps-switch >"$logs/mps_start.log" 2>&1; then
           echo "mps: the control daemon did not start: $(tail -n 2 "$logs/mps_start.log")"; status=1; continue
         fi ;;
    *) echo "unknown variant $variant"; status=1; continue ;;
  esac
  timeout 180 env "${env[@]}" .device/bin/ipc_copy_bench --sizes-mib 1024 --max-mib 1024 --repeat "${REPEAT:-7}" \
    >"$logs/$variant.log" 2>&1 || status=1
  [ "$variant" = mps ] && stop_mps "$logs/mps_log"
  grep '^{' "$logs/$variant.log" | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l); d.update(variant=sys.argv[1]); print(json.dumps(d))' "$variant" >>"$out/switch_cost.jsonl"
  echo "$variant: $(grep -c '^{' "$logs/$variant.log") results; $(grep after_other_process "$logs/$variant.log" | cut -c1-200 | tr '\n' ' ')"
done
tar czf "$out/switch_cost.tgz" -C "$out" switch_cost && rm -rf "$logs"
exit $status
