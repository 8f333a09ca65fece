#!/usr/bin/env bash
# Call 1 on one H200 (from the bundle's tree: cd .device/fp8 && OUT=$OUT bash docs/runs/2026-12-05-fp8/call1.sh):
# the kernels' bit-exactness, then local_copy_bench on the colocated Llama-3-8B layouts (FSDP=2 ->
# TP=2 on GPU 0) with this build and the one before (local_copy_bench-before: the same bench
# linked with main's copy_kernels.o), both fills (weights, and the refit workers' values with
# their blocks of zeros), block fp8 and MXFP8, bf16; refitd's fp8 refits; a many-small-moe
# launch-shape sweep; one Nsight Compute look at the quantizing kernel. Logs in $OUT/call1.tgz.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
logs=$OUT/call1; mkdir -p "$logs"
B=.device/bin
T0=$SECONDS
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s: $(tail -n 1 "$logs/$name.log" | cut -c1-250)"
}
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader; nproc; cat .device/commit.txt; } >"$logs/machine.txt" 2>&1
step copy_kernels_test 120 $B/copy_kernels_test --durations yes
layouts() {  # layouts DIR CONFIG [DTYPE]
  local dir=$1 config=$2 dtype=${3:-}
  mkdir -p "$dir"
  local L=("$B/refit-layout" --config "tests/configs/$config.json" --scale-down 1)
  "${L[@]}" --side trainer --fsdp 2 --gpus-per-node 2 -o "$dir/t.json" || return 1
  "${L[@]}" --side inference --tp 2 --gpus-per-node 2 ${dtype:+--dtype "$dtype"} -o "$dir/i.json" || return 1
  for f in "$dir/t.json" "$dir/i.json"; do
    python3 -c 'import json,sys; l=json.load(open(sys.argv[1])); [w.update(node=0, gpu=0) for w in l["workers"]]; json.dump(l, open(sys.argv[1], "w"))' "$f" || return 1
  done
}
layouts /tmp/l-fp8 llama3-8b fp8-block; layouts /tmp/l-mx llama3-8b mxfp8; layouts /tmp/l-bf16 llama3-8b; layouts /tmp/l-moe many-small-moe
bench() {  # bench NAME PROG DIR SECONDS FLAGS...
  local name=$1 prog=$2 dir=$3 secs=$4; shift 4
  step "bench_$name" "$secs" "$prog" --src "$dir/t.json" --dst "$dir/i.json" --repeat 10 "$@"
  grep '^{' "$logs/bench_$name.log" | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l); d["case"] = sys.argv[1]; print(json.dumps(d))' "$name" >>"$logs/results.jsonl"
}
bench fp8_refit_after $B/local_copy_bench /tmp/l-fp8 90 --fill refit --split 0,1 --quant-min-blocks 2,3
bench fp8_refit_before $B/local_copy_bench-before /tmp/l-fp8 90 --fill refit --split 0,1
bench fp8_weights_after $B/local_copy_bench /tmp/l-fp8 60 --split 0,1 --quant-min-blocks 2,3
bench fp8_weights_before $B/local_copy_bench-before /tmp/l-fp8 60 --split 0,1
bench mx_refit_after $B/local_copy_bench /tmp/l-mx 90 --fill refit --split 1 --quantizing auto,0 --quant-min-blocks 2,3
bench mx_refit_before $B/local_copy_bench-before /tmp/l-mx 90 --fill refit --split 1
bench bf16_after $B/local_copy_bench /tmp/l-bf16 40 --split 0,1
echo "benches done at $((SECONDS - T0))s"
for dt in fp8-block mxfp8; do
  [ $((SECONDS - T0)) -gt 330 ] && { echo "refit $dt skipped"; continue; }
  rm -rf /tmp/lp-$dt
  step "refit_$dt" 130 env BIN=$B RUN=/tmp/lp-$dt CONFIG=tests/configs/llama3-8b.json SCALE=1 INFER_DTYPE=$dt bash tests/gpu/colocated_bench.sh
  cp /tmp/lp-$dt/daemon0.log "$logs/refit_${dt}_daemon0.log" 2>/dev/null
  grep '^{' "$logs/refit_$dt.log" | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l); d["case"] = "refit-" + sys.argv[1]; print(json.dumps(d))' "$dt" >>"$logs/results.jsonl"
done
[ $((SECONDS - T0)) -lt 480 ] && bench moe_segments $B/local_copy_bench /tmp/l-moe 60 --segments 8192,16384,32768,65536 --split 0,1 --spread auto,0,1
[ $((SECONDS - T0)) -lt 500 ] && bench moe_shape $B/local_copy_bench /tmp/l-moe 60 --split 1 --batch-caps 0,4,8,16 --fill-warps 4096,8192,16384 --blocks-per-sm 0,2,3,4
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [ -n "$NCU" ] && [ $((SECONDS - T0)) -lt 510 ]; then
  step ncu_fp8 75 "$NCU" --clock-control none -k regex:QuantizeItemsKernel -s 2 -c 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section LaunchStats \
    $B/local_copy_bench --src /tmp/l-fp8/t.json --dst /tmp/l-fp8/i.json --repeat 1 --fill refit
fi
python3 - "$logs/results.jsonl" <<'PY' | tee "$logs/summary.txt"
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if d.get("bench") == "local_copy_kernel":
        print(d["case"], "split", d["split"], "q", d["quantizing"], d["quant_min_blocks"], "seg", d["segment_bytes"], "spread", d["spread"],
              "cap", d["batch_cap"], "fw", d["fill_warps"], "bps", d["blocks_per_sm"], "k", d["kernel_ms"], "d2d", d["memcpy_d2d_ms"],
              "bound", d["traffic_bound_ms"], "ofb", d["of_traffic_bound"], "vs_d2d", d["kernel_vs_memcpy"])
    elif d.get("mode") == "colocated-1gpu":
        print(d["case"], "transfer_ms", round(d["median_transfer_s"] * 1e3, 3), "data_plane_ms", d.get("median_data_plane_ms"), "all", d["transfer_s"])
PY
echo "total $((SECONDS - T0))s"
tar czf "$OUT/call1.tgz" -C "$OUT" call1 && cp "$logs/summary.txt" "$OUT/summary.txt" && rm -rf "$logs"
