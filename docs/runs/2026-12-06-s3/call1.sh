#!/usr/bin/env bash
# Call 1 (from the bundle's tree: cd .device/s3 && OUT=$OUT DEADLINE=540 bash docs/runs/2026-12-06-s3/call1.sh):
# the general copy kernel's tiles with small views (RowsView) and the 16-byte tile loop inlined
# ("after"), the same with 128 registers a thread (local_copy_bench-v2), main's build ("before").
# SASS local-memory instructions per function of each; copy_kernels_test; many-small-moe and bf16
# through local_copy_bench, alternated; MXFP8 and block fp8 once (this card's bound); refitd's
# many-small-moe refit, this build and main's; ncu on many-small-moe's general kernel, and the full
# set with source counters on the quantizing kernel (MXFP8, block fp8).
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export PATH=$PATH:/usr/local/cuda/bin
logs=$OUT/call1; mkdir -p "$logs"
B=.device/bin
T0=$SECONDS
DEADLINE=${DEADLINE:-540}
source tests/gpu/bench_lib.sh
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
  nproc; cat .device/commit.txt; echo "ncu: $(command -v ncu) cuobjdump: $(command -v cuobjdump)"; ncu --version | tail -1; } >"$logs/machine.txt" 2>&1
cat "$logs/machine.txt"
sass_locals after $B/local_copy_bench; sass_locals v2 $B/local_copy_bench-v2; sass_locals before $B/local_copy_bench-before
head -n 12 "$logs"/sass_*_locals.txt
step copy_kernels_test 150 $B/copy_kernels_test --durations yes
layouts /tmp/l-moe many-small-moe; layouts /tmp/l-bf16 llama3-8b
layouts /tmp/l-mx llama3-8b mxfp8; layouts /tmp/l-fp8 llama3-8b fp8-block
for k in 1 2; do
  bench moe_after$k $B/local_copy_bench /tmp/l-moe 40 --split 1
  bench moe_v2_$k $B/local_copy_bench-v2 /tmp/l-moe 40 --split 1
  bench moe_before$k $B/local_copy_bench-before /tmp/l-moe 40 --split 1
done
bench bf16_after $B/local_copy_bench /tmp/l-bf16 40 --split 1
bench bf16_before $B/local_copy_bench-before /tmp/l-bf16 40 --split 1
bench mx_after $B/local_copy_bench /tmp/l-mx 40 --split 1
bench fp8_after $B/local_copy_bench /tmp/l-fp8 40 --split 1
echo "benches done at $((SECONDS - T0))s"
mkdir -p .device/bin-before
for p in $B/*; do ln -sf "$PWD/$p" .device/bin-before/; done
ln -sf "$PWD/$B/refitd-before" .device/bin-before/refitd
refit moe-after $B many-small-moe
refit moe-before .device/bin-before many-small-moe
summary | tee "$logs/summary.txt"
NCU=(ncu --clock-control none --import-source no)
step ncu_moe 60 "${NCU[@]}" -k regex:CopyItemsKernel --launch-skip 6 -c 2 --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
  --section InstructionStats $B/local_copy_bench --src /tmp/l-moe/t.json --dst /tmp/l-moe/i.json --repeat 1 --split 1
for q in mx fp8; do
  step "ncu_$q" 100 "${NCU[@]}" -k regex:QuantizeItemsKernel --launch-skip 3 -c 1 --set full \
    --section SourceCounters -o "$logs/ncu_$q" $B/local_copy_bench --src /tmp/l-$q/t.json --dst /tmp/l-$q/i.json \
    --repeat 1 --split 1
  step "ncu_${q}_details" 60 ncu -i "$logs/ncu_$q.ncu-rep" --page details --print-details all
  step "ncu_${q}_sass" 60 ncu -i "$logs/ncu_$q.ncu-rep" --page source --csv --print-source sass
done
echo "total $((SECONDS - T0))s"
