#!/usr/bin/env bash
# One GPU call (from the repository root, the bundle of call1.sh in .device: OUT=$OUT bash
# docs/runs/2026-12-07-s2/call3.sh): many-small-moe through refitd without MPS, rounds armed at
# PREPARE (--arm-rounds always: "after") against launched at TRANSFER (the default without MPS:
# "unarmed"), on one machine.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT/call3"
nvidia-smi -L >"$OUT/call3/machine.txt" 2>&1
OUT="$OUT/armed" CASES="many-small-moe:1" RUNS="after unarmed" KERNEL_BENCH=0 \
  DAEMON_FLAGS="--arm-rounds always" timeout 170 bash tests/gpu/local_path.sh
cp "$OUT/armed/summary.txt" "$OUT/call3/summary.txt"
tar xzf "$OUT/armed/local_path.tgz" -C "$OUT/call3" local_path/results.jsonl 2>/dev/null
for r in after unarmed; do
  grep "moved in" /tmp/lp-many-small-moe-s1-$r/daemon0.log >"$OUT/call3/round_lines_$r.txt" 2>/dev/null
done
