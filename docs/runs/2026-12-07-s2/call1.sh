#!/usr/bin/env bash
# One GPU call (from the repository root, with the bundle in .device: OUT=$OUT DEADLINE=540 bash
# docs/runs/2026-12-07-s2/call1.sh): the armed rounds' GPU test; MXFP8 and block fp8 through
# local_copy_bench twice each; many-small-moe through refitd without MPS, this build ("after": the
# wait spun around where the stage ended last round) and main's ("before") alternated; MXFP8
# through refitd. Logs packed into $OUT/call1.tgz.
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
step cuda_armed_test 60 $B/cuda_armed_test --durations yes
layouts /tmp/l-mx llama3-8b mxfp8; layouts /tmp/l-fp8 llama3-8b fp8-block
for k in 1 2; do
  for q in mx fp8; do bench ${q}_$k $B/local_copy_bench /tmp/l-$q 40 --split 1; done
done
summary | tee "$logs/summary.txt"
step local_path_nomps 180 env OUT="$OUT/nomps" CASES="many-small-moe:1" RUNS="after before after" \
  KERNEL_BENCH=0 bash tests/gpu/local_path.sh
left=$((DEADLINE - 25 - (SECONDS - T0)))
step local_path_mx $left env OUT="$OUT/mx" CASES="llama3-8b:1:mxfp8" RUNS="after" KERNEL_BENCH=0 \
  BUDGET_S=$((left - 10)) bash tests/gpu/local_path.sh
for d in nomps mx; do cp "$OUT/$d/summary.txt" "$logs/summary_$d.txt" 2>/dev/null; done
echo "total $((SECONDS - T0))s"
tar czf "$OUT/call1.tgz" -C "$OUT" call1 nomps mx 2>/dev/null
