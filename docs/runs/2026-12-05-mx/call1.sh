#!/usr/bin/env bash
# Call 1 (from the bundle's tree: cd .device/mx && OUT=$OUT bash docs/runs/2026-12-05-mx/call1.sh):
# copy_kernels_test "[fp8]" (bit-exactness) and its other cases (the copy kernels' launch changed);
# local_copy_bench on the colocated Llama-3-8B layouts (FSDP=2 -> TP=2 on GPU 0): MXFP8 on both
# fills (the workers' values, weight-like values), block fp8, bf16 and many-small-moe, each with
# this build (MXFP8 row tiles in the quantizing kernel) and main's (local_copy_bench-before); then
# refitd's colocated MXFP8 and block fp8 refits (every round byte-checked); last, if ncu is there
# and time is left, one Nsight Compute profile of the MXFP8 launch. Steps are skipped past DEADLINE
# seconds so that the logs can be packed inside the call's limit (the caller packs $OUT/call1).
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
logs=$OUT/call1; mkdir -p "$logs"
B=.device/bin
T0=$SECONDS
DEADLINE=${DEADLINE:-530}
source "$(dirname "$0")/lib.sh"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader; nproc; cat .device/commit.txt; echo "ncu: $(command -v ncu)"; } >"$logs/machine.txt" 2>&1
cat "$logs/machine.txt"
step copy_kernels_test_fp8 120 $B/copy_kernels_test "[fp8]" --durations yes
layouts /tmp/l-mx llama3-8b mxfp8; layouts /tmp/l-fp8 llama3-8b fp8-block; layouts /tmp/l-bf16 llama3-8b
layouts /tmp/l-moe many-small-moe
bench mx_weights_after $B/local_copy_bench /tmp/l-mx 60 --split 1
bench mx_weights_before $B/local_copy_bench-before /tmp/l-mx 60 --split 1
bench mx_refit_after $B/local_copy_bench /tmp/l-mx 75 --fill refit --split 1
bench mx_refit_before $B/local_copy_bench-before /tmp/l-mx 75 --fill refit --split 1
bench fp8_refit_after $B/local_copy_bench /tmp/l-fp8 75 --fill refit --split 1
bench fp8_refit_before $B/local_copy_bench-before /tmp/l-fp8 75 --fill refit --split 1
# The copy kernels' bf16 path and the small-tensor copy, which the change must leave as they were.
bench bf16_after $B/local_copy_bench /tmp/l-bf16 45 --split 1
bench bf16_before $B/local_copy_bench-before /tmp/l-bf16 45 --split 1
bench moe_after $B/local_copy_bench /tmp/l-moe 45 --split 1
bench moe_before $B/local_copy_bench-before /tmp/l-moe 45 --split 1
echo "benches done at $((SECONDS - T0))s"
for c in llama3-8b:mxfp8 llama3-8b:fp8-block; do
  IFS=: read -r model dt <<<"$c"; tag=$model${dt:+-$dt}
  rm -rf /tmp/lp-$tag
  step "refit_$tag" 120 env BIN=$B RUN=/tmp/lp-$tag CONFIG=tests/configs/$model.json SCALE=1 INFER_DTYPE=$dt bash tests/gpu/colocated_bench.sh
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
        print(d["case"], d.get("fill"), "units", d["units"], "k", d["kernel_ms"], "d2d", d["memcpy_d2d_ms"],
              "bound", d["traffic_bound_ms"], "ofb", d["of_traffic_bound"], "vs_d2d", d["kernel_vs_memcpy"])
    elif d.get("mode") == "colocated-1gpu":
        print(d["case"], "transfer_ms", round(d["median_transfer_s"] * 1e3, 3), "data_plane_ms", d.get("median_data_plane_ms"), "all", d["transfer_s"])
PY
# The rest of copy_kernels_test (copy cases: the copy kernels now come in two kinds per launch).
step copy_kernels_test_rest 90 $B/copy_kernels_test "~[fp8]"
if command -v ncu >/dev/null; then
  step ncu_mx 90 ncu --clock-control none -k regex:QuantizeItemsKernel -c 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    $B/local_copy_bench --src /tmp/l-mx/t.json --dst /tmp/l-mx/i.json --repeat 1 --split 1
fi
echo "total $((SECONDS - T0))s"
