#!/usr/bin/env bash
# One short GPU call for a session with little device time left (from the repository root, with
# the bundle in .device: OUT=$OUT DEADLINE=170 bash docs/runs/2026-12-08/call3.sh). In order of
# what matters most: the copy kernels' test (the packed descriptors' first GPU run); the scale
# harness at N = 4 and 64 on the machine's 16 CPU cores; many-small-moe, MXFP8 and block fp8
# through local_copy_bench against cudaMemcpy. Logs are packed into $OUT/call3.tgz after every
# step, so that a call cut short still brings back what ran.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export PATH=$PATH:/usr/local/cuda/bin
logs=/tmp/call3; mkdir -p "$logs"
B=.device/bin
T0=$SECONDS
DEADLINE=${DEADLINE:-170}
source tests/gpu/bench_lib.sh
pack() { tar czf "$OUT/call3.tgz.part" -C /tmp call3 2>/dev/null && mv "$OUT/call3.tgz.part" "$OUT/call3.tgz"; }
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
  nproc; uptime; cat .device/commit.txt; } >"$logs/machine.txt" 2>&1
cat "$logs/machine.txt"
cp $B/local_copy_bench-k4p $B/local_copy_bench
step copy_kernels_test 60 $B/copy_kernels_test --durations yes
pack
left=$((DEADLINE - 45 - (SECONDS - T0)))
if [ "$left" -gt 30 ]; then
  mkdir -p /tmp/scale-a
  timeout "$left" python3 tests/scale/scale_bench.py --bin $B --work-dir /tmp/scale-a \
    --out "$logs/scale_a.json" --nodes 4,64 --model small --gpus-per-node 2 --rounds 100 \
    --faults kill --idle-cpu-window 4 >"$logs/scale_a.log" 2>&1
  echo "scale_a rc=$? $((SECONDS - T0))s"
  grep -E "N=|rounds committed|round CPU|abort" "$logs/scale_a.log" | cut -c1-220
fi
pack
layouts /tmp/l-small many-small-moe; layouts /tmp/l-mx llama3-8b mxfp8; layouts /tmp/l-fp8 llama3-8b fp8-block
bench small_1 $B/local_copy_bench /tmp/l-small 25 --split 1,2,3
pack
for q in mx fp8; do bench ${q}_1 $B/local_copy_bench /tmp/l-$q 25 --split 1; pack; done
summary | tee "$logs/summary.txt"
echo "total $((SECONDS - T0))s"
pack
