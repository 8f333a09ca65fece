#!/usr/bin/env bash
# Call 2 (from the bundle's tree: cd .device/s2 && OUT=$OUT DEADLINE=420 bash docs/runs/2026-12-06-s2/call2.sh):
# call 1's build without OrderBySource (no gain in call 1), and launches without quantizing units
# through the copy kernels built without quantizing code (QuantizingUnits::kNone). copy_kernels_test
# (every fourth pair of copy-only launches through those kernels); local_copy_bench
# many-small-moe and bf16 with --plain 1,0, main's build beside them; MXFP8 and block fp8 once
# more, this build against main's; refitd's colocated refits of many-small-moe and bf16 Llama-3-8B,
# this build and main's; ncu on many-small-moe's copy kernels (the copy-only ones now).
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
logs=$OUT/call2; mkdir -p "$logs"
B=.device/bin
T0=$SECONDS
DEADLINE=${DEADLINE:-420}
source "$(dirname "$0")/lib.sh"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader; nproc; cat .device/commit.txt; } >"$logs/machine.txt" 2>&1
cat "$logs/machine.txt"
step copy_kernels_test 150 $B/copy_kernels_test --durations yes
layouts /tmp/l-mx llama3-8b mxfp8; layouts /tmp/l-fp8 llama3-8b fp8-block; layouts /tmp/l-bf16 llama3-8b
layouts /tmp/l-moe many-small-moe
for k in 1 2; do
  bench moe_after$k $B/local_copy_bench /tmp/l-moe 45 --split 1 --plain 1,0
  bench moe_before$k $B/local_copy_bench-before /tmp/l-moe 45 --split 1
  bench bf16_after$k $B/local_copy_bench /tmp/l-bf16 45 --split 1 --plain 1,0
  bench bf16_before$k $B/local_copy_bench-before /tmp/l-bf16 45 --split 1
done
bench mx_after $B/local_copy_bench /tmp/l-mx 45 --split 1
bench mx_before $B/local_copy_bench-before /tmp/l-mx 45 --split 1
bench fp8_after $B/local_copy_bench /tmp/l-fp8 45 --split 1
bench fp8_before $B/local_copy_bench-before /tmp/l-fp8 45 --split 1
echo "benches done at $((SECONDS - T0))s"
mkdir -p .device/bin-before
for p in $B/*; do ln -sf "$PWD/$p" .device/bin-before/; done
ln -sf "$PWD/$B/refitd-before" .device/bin-before/refitd
for c in many-small-moe::after many-small-moe::before llama3-8b::after llama3-8b::before; do
  IFS=: read -r model dt build <<<"$c"; tag=$model${dt:+-$dt}-$build
  bin=$B; [ "$build" = before ] && bin=.device/bin-before
  rm -rf /tmp/lp-$tag
  step "refit_$tag" 100 env BIN=$bin RUN=/tmp/lp-$tag CONFIG=tests/configs/$model.json SCALE=1 INFER_DTYPE=$dt bash tests/gpu/colocated_bench.sh
  cp /tmp/lp-$tag/daemon0.log "$logs/refit_${tag}_daemon0.log" 2>/dev/null
  grep '^{' "$logs/refit_$tag.log" 2>/dev/null | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l); d["case"] = "refit-" + sys.argv[1]; print(json.dumps(d))' "$tag" >>"$logs/results.jsonl"
done
python3 - "$logs/results.jsonl" <<'PY' | tee "$logs/summary.txt"
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if d.get("bench") == "local_copy_kernel":
        print(d["case"], d.get("fill"), "plain", d.get("plain"), "units", d["units"], "k", d["kernel_ms"], "d2d", d["memcpy_d2d_ms"],
              "bound", d["traffic_bound_ms"], "ofb", d["of_traffic_bound"], "vs_d2d", d["kernel_vs_memcpy"])
    elif d.get("mode") == "colocated-1gpu":
        print(d["case"], "transfer_ms", round(d["median_transfer_s"] * 1e3, 3), "data_plane_ms", d.get("median_data_plane_ms"), "all", d["transfer_s"])
PY
if command -v ncu >/dev/null; then
  step ncu_moe 60 ncu --clock-control none -k regex:CopyItemsKernel --launch-skip 6 -c 2 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
    $B/local_copy_bench --src /tmp/l-moe/t.json --dst /tmp/l-moe/i.json --repeat 1 --split 1
fi
echo "total $((SECONDS - T0))s"
