#!/usr/bin/env bash
# Call 3 (cd .device/fp8 && OUT=$OUT bash docs/runs/2026-12-05-fp8/call3.sh), the short one device
# time allowed: the [fp8] bit-exactness cases, then local_copy_bench on the colocated Llama-3-8B
# block fp8 layouts: this build (main's kernel plus the zero-block product) on the workers' values
# and on weight-like values, main's kernel (local_copy_bench-before) on the workers' values.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0
logs=$OUT/call3; mkdir -p "$logs"; B=.device/bin; T0=$SECONDS
step() { local name=$1 secs=$2; shift 2; local t0=$SECONDS
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - t0))s: $(tail -n 1 "$logs/$name.log" | cut -c1-200)"; }
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader; cat .device/commit.txt; } >"$logs/machine.txt" 2>&1
step copy_kernels_test 45 $B/copy_kernels_test "[fp8]"
d=/tmp/l-fp8; mkdir -p $d
L=("$B/refit-layout" --config tests/configs/llama3-8b.json --scale-down 1)
"${L[@]}" --side trainer --fsdp 2 --gpus-per-node 2 -o $d/t.json && "${L[@]}" --side inference --tp 2 --gpus-per-node 2 --dtype fp8-block -o $d/i.json
for f in $d/t.json $d/i.json; do python3 -c 'import json,sys; l=json.load(open(sys.argv[1])); [w.update(node=0, gpu=0) for w in l["workers"]]; json.dump(l, open(sys.argv[1], "w"))' $f; done
for run in "after $B/local_copy_bench --fill refit" "before $B/local_copy_bench-before --fill refit" "after_weights $B/local_copy_bench --fill weights"; do
  set -- $run; name=$1; shift
  step "bench_$name" 60 "$@" --src $d/t.json --dst $d/i.json --repeat 10 --split 1
  grep '^{' "$logs/bench_$name.log" | sed "s/^{/{\"case\":\"$name\",/" >>"$logs/results.jsonl"
done
python3 -c '
import json,sys
for l in open(sys.argv[1]):
    d=json.loads(l); print(d["case"], d["fill"], "kernel_ms", d["kernel_ms"], "d2d_ms", d["memcpy_d2d_ms"], "bound_ms", d["traffic_bound_ms"], "of_bound", d["of_traffic_bound"])' "$logs/results.jsonl" | tee "$logs/summary.txt"
echo "total $((SECONDS - T0))s"
tar czf "$OUT/call3.tgz" -C "$OUT" call3
