#!/usr/bin/env bash
# Call 4, cut to the device time left (from the bundle's tree: cd .device/s3 && OUT=$OUT
# DEADLINE=330 bash docs/runs/2026-12-06-s3/call4b.sh): copy_kernels_test on call4-kernels.patch's
# build ("after"); MXFP8 and block fp8 through it and through call 3's build ("prev"), alternated;
# many-small-moe through refitd with every process a client of one MPS server, then MXFP8 through
# refitd, as far as the deadline allows.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export PATH=$PATH:/usr/local/cuda/bin
logs=$OUT/call4; mkdir -p "$logs"
B=.device/bin
T0=$SECONDS
DEADLINE=${DEADLINE:-330}
source tests/gpu/bench_lib.sh
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
  nproc; cat .device/commit.txt; } >"$logs/machine.txt" 2>&1
cat "$logs/machine.txt"
step copy_kernels_test 120 $B/copy_kernels_test --durations yes
layouts /tmp/l-mx llama3-8b mxfp8; layouts /tmp/l-fp8 llama3-8b fp8-block
for k in 1 2; do
  for q in mx fp8; do
    bench ${q}_after$k $B/local_copy_bench /tmp/l-$q 40 --split 1
    bench ${q}_prev$k $B/local_copy_bench-prev /tmp/l-$q 40 --split 1
  done
done
summary | tee "$logs/summary.txt"
echo "benches done at $((SECONDS - T0))s"
step local_path_mps 90 env OUT="$OUT/mps" MPS=1 CASES="many-small-moe:1" RUNS="after" KERNEL_BENCH=0 \
  bash tests/gpu/local_path.sh
left=$((DEADLINE - 15 - (SECONDS - T0)))
step local_path $left env OUT="$OUT" CASES="llama3-8b:1:mxfp8" RUNS="after" \
  SEGMENTS=16384 KERNEL_FLAGS="--split 1" BUDGET_S=$((left - 10)) bash tests/gpu/local_path.sh
echo "total $((SECONDS - T0))s"
