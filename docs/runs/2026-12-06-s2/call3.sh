#!/usr/bin/env bash
# Call 3 (cd .device/s2 && OUT=$OUT DEADLINE=300 bash docs/runs/2026-12-06-s2/call3.sh), on the
# machine of call 2: refitd's colocated MXFP8 refit, this build and main's, and its block fp8 refit
# (every round byte-checked).
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
logs=$OUT/call3; mkdir -p "$logs"
B=.device/bin
T0=$SECONDS
DEADLINE=${DEADLINE:-300}
source "$(dirname "$0")/lib.sh"
nvidia-smi -L >"$logs/machine.txt" 2>&1
mkdir -p .device/bin-before
for p in $B/*; do ln -sf "$PWD/$p" .device/bin-before/; done
ln -sf "$PWD/$B/refitd-before" .device/bin-before/refitd
for c in llama3-8b:mxfp8:after llama3-8b:mxfp8:before llama3-8b:fp8-block:after; do
  IFS=: read -r model dt build <<<"$c"; tag=$model${dt:+-$dt}-$build
  bin=$B; [ "$build" = before ] && bin=.device/bin-before
  rm -rf /tmp/lp-$tag
  step "refit_$tag" 95 env BIN=$bin RUN=/tmp/lp-$tag CONFIG=tests/configs/$model.json SCALE=1 INFER_DTYPE=$dt bash tests/gpu/colocated_bench.sh
  grep '^{' "$logs/refit_$tag.log" 2>/dev/null | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l); print("refit-" + sys.argv[1], "transfer_ms", round(d["median_transfer_s"] * 1e3, 3), "data_plane_ms", d.get("median_data_plane_ms"), "all", d["transfer_s"])' "$tag" | tee -a "$logs/summary.txt"
done
echo "total $((SECONDS - T0))s"
