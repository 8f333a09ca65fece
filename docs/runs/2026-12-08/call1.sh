#!/usr/bin/env bash
# One GPU call (from the repository root, with the bundle in .device: OUT=$OUT DEADLINE=480 bash
# docs/runs/2026-12-08/call1.sh), asked as nvidia-h200: many-small-moe's copy kernel alone
# against cudaMemcpy (its aligned and general parts apart; 8 loads in flight a lane against 4);
# MXFP8 and block fp8 through local_copy_bench; many-small-moe through refitd without MPS and under
# MPS; the aligned loop's change on Llama-3-8B bf16; unit order and size; MXFP8 through refitd.
# Logs packed into $OUT/call1.tgz.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export PATH=$PATH:/usr/local/cuda/bin
logs=$OUT/call1; mkdir -p "$logs"
B=.device/bin
T0=$SECONDS
DEADLINE=${DEADLINE:-300}
source tests/gpu/bench_lib.sh
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
  nproc; cat .device/commit.txt; } >"$logs/machine.txt" 2>&1
cat "$logs/machine.txt"
cp .device/bin/local_copy_bench-k4p .device/bin/local_copy_bench
step copy_kernels_test 120 .device/bin/copy_kernels_test --durations yes
layouts /tmp/l-mx llama3-8b mxfp8; layouts /tmp/l-fp8 llama3-8b fp8-block; layouts /tmp/l-small many-small-moe; layouts /tmp/l-bf16 llama3-8b
# In order of what matters most, each step skipped once DEADLINE is near.
# --split 2: the aligned part alone, 3: the general part alone (the bound: that part's traffic).
# k4p: main's kernels; k8: 16-byte tiles with 8 loads in flight a lane; k8a: also the aligned loop.
for k in 1 2; do
  for v in k4p k8 k8a; do bench small_${v}_$k $B/local_copy_bench-$v /tmp/l-small 30 --split 1,2,3; done
done
for q in mx fp8; do bench ${q}_1 $B/local_copy_bench /tmp/l-$q 40 --split 1; done
summary | tee "$logs/summary.txt"
step local_path_nomps 100 env OUT="$OUT/nomps" CASES="many-small-moe:1" RUNS="after" \
  KERNEL_BENCH=0 bash tests/gpu/local_path.sh
step local_path_mps 100 env OUT="$OUT/mps" MPS=1 CASES="many-small-moe:1" RUNS="after" \
  KERNEL_BENCH=0 bash tests/gpu/local_path.sh
for v in k4p k8a; do bench bf16_${v}_1 $B/local_copy_bench-$v /tmp/l-bf16 40 --split 1; done
bench small_shape $B/local_copy_bench /tmp/l-small 40 --split 1 --spread auto,0,1 --segments 16384,32768
left=$((DEADLINE - 25 - (SECONDS - T0)))
step local_path_mx $left env OUT="$OUT/mx" CASES="llama3-8b:1:mxfp8" RUNS="after" KERNEL_BENCH=0 \
  BUDGET_S=$((left - 10)) bash tests/gpu/local_path.sh
summary >"$logs/summary_all.txt"
for d in nomps mps mx; do cp "$OUT/$d/summary.txt" "$logs/summary_$d.txt" 2>/dev/null; done
echo "total $((SECONDS - T0))s"
tar czf "$OUT/call1.tgz" -C "$OUT" call1 nomps mps mx 2>/dev/null
