#!/usr/bin/env bash
# Call 4 (from the bundle's tree: cd .device/s3 && OUT=$OUT DEADLINE=560 bash docs/runs/2026-12-06-s3/call4.sh):
# the quantizing kernel's tiles staged through stepped addresses where every chunk is inside its
# tile, and MXFP8's straight-line path without its separate finite check ("after"); call 3's build
# ("prev", local_copy_bench-prev) and main's before both ("before"). copy_kernels_test in full;
# MXFP8 and block fp8 through local_copy_bench, alternated; tests/gpu/local_path.sh on MXFP8,
# block fp8 and many-small-moe, then many-small-moe again with every process a client of one MPS
# server (one GPU context: no switch between the workers' and refitd's); ncu on the MXFP8 build.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export PATH=$PATH:/usr/local/cuda/bin
logs=$OUT/call4; mkdir -p "$logs"
B=.device/bin
T0=$SECONDS
DEADLINE=${DEADLINE:-560}
source tests/gpu/bench_lib.sh
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
  nproc; cat .device/commit.txt; } >"$logs/machine.txt" 2>&1
cat "$logs/machine.txt"
step copy_kernels_test 150 $B/copy_kernels_test --durations yes
layouts /tmp/l-mx llama3-8b mxfp8; layouts /tmp/l-fp8 llama3-8b fp8-block
for k in 1 2; do
  for q in mx fp8; do
    bench ${q}_after$k $B/local_copy_bench /tmp/l-$q 40 --split 1
    bench ${q}_prev$k $B/local_copy_bench-prev /tmp/l-$q 40 --split 1
    bench ${q}_before$k $B/local_copy_bench-before /tmp/l-$q 40 --split 1
  done
done
summary | tee "$logs/summary.txt"
echo "benches done at $((SECONDS - T0))s"
step local_path_mps 100 env OUT="$OUT/mps" MPS=1 CASES="many-small-moe:1" RUNS="after" KERNEL_BENCH=0 \
  bash tests/gpu/local_path.sh
left=$((DEADLINE - 30 - (SECONDS - T0)))
step local_path $left env OUT="$OUT" CASES="llama3-8b:1:mxfp8 llama3-8b:1:fp8-block many-small-moe:1" RUNS="after" \
  SEGMENTS=16384 KERNEL_FLAGS="--split 1" BUDGET_S=$((left - 60)) bash tests/gpu/local_path.sh
step ncu_mx 25 ncu --clock-control none --import-source no -k regex:QuantizeItemsKernel --launch-skip 3 -c 1 \
  --section SpeedOfLight --section WarpStateStats --section InstructionStats --section Occupancy --section SourceCounters \
  $B/local_copy_bench --src /tmp/l-mx/t.json --dst /tmp/l-mx/i.json --repeat 1 --split 1
echo "total $((SECONDS - T0))s"
