#!/usr/bin/env bash
# One H200 call on main's build (from the bundle's tree: cd .device/s4 && OUT=$OUT DEADLINE=540
# bash docs/runs/2026-12-07/call1.sh): copy_kernels_test; MXFP8 and block fp8 through
# local_copy_bench twice each; many-small-moe through refitd without and with MPS (each beside the
# copy of the same pieces); MXFP8 through refitd; last, the planner on two of the host's cores
# (plan_benchmark pinned with taskset, memory_probe before each), this build against main's.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export PATH=$PATH:/usr/local/cuda/bin
logs=$OUT/call1; mkdir -p "$logs"
B=.device/bin
T0=$SECONDS
DEADLINE=${DEADLINE:-540}
source tests/gpu/bench_lib.sh
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
  nproc; cat .device/commit.txt; } >"$logs/machine.txt" 2>&1
cat "$logs/machine.txt"
step copy_kernels_test 150 $B/copy_kernels_test --durations yes
layouts /tmp/l-mx llama3-8b mxfp8; layouts /tmp/l-fp8 llama3-8b fp8-block
for k in 1 2; do
  for q in mx fp8; do bench ${q}_$k $B/local_copy_bench /tmp/l-$q 40 --split 1; done
done
summary | tee "$logs/summary.txt"
echo "benches done at $((SECONDS - T0))s"
step local_path_nomps 90 env OUT="$OUT/nomps" CASES="many-small-moe:1" RUNS="after" KERNEL_BENCH=0 \
  bash tests/gpu/local_path.sh
step local_path_mps 90 env OUT="$OUT/mps" MPS=1 CASES="many-small-moe:1" RUNS="after" KERNEL_BENCH=0 \
  bash tests/gpu/local_path.sh
left=$((DEADLINE - 200 - (SECONDS - T0)))
step local_path_mx $left env OUT="$OUT/mx" CASES="llama3-8b:1:mxfp8" RUNS="after" KERNEL_BENCH=0 \
  BUDGET_S=$((left - 10)) bash tests/gpu/local_path.sh
# The planner: this build ("after") and main's before the 64-byte descriptors ("before"),
# alternated, pinned to two of the host's cores.
for pair in kimi-k2:1 kimi-k2:2 deepseek-v3:1; do
  c=${pair%%:*}; k=${pair##*:}
  order="after before"; [ "$k" = 2 ] && order="before after"
  for v in $order; do
    prog=$B/plan_benchmark; [ $v = before ] && prog=$B/plan_benchmark-before
    step probe_${c}_${v}$k 20 $B/memory_probe --rounds 1
    step plan_${c}_${v}$k 45 taskset -c 2,3 $prog --repeat 5 --digest --planner-threads 2 --case $c
  done
done
echo "total $((SECONDS - T0))s"
