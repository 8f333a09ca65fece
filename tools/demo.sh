#!/usr/bin/env bash
# The main job (README): a real model's trainer and inference layouts, planned, executed on the
# CPU and checked byte for byte. Qwen3-30B-A3B's structure (48 layers, 128 experts, GQA, qk-norm)
# with every width divided by 16 so that it fits a laptop: a Megatron trainer TP2 PP2 EP4 DP4
# on 4 nodes of 8 GPUs refits a vLLM engine TP4 DP2 (fused qkv and gate_up, stacked experts,
# padded vocabulary) on 1 more node.
#   bash tools/demo.sh [--scale-down N] [extra refit-plan flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
scale=16
if [ "${1:-}" = "--scale-down" ]; then scale=$2; shift 2; fi
bazel build //client:refit-layout //client:refit-plan 2>&1 | grep -vE '^(INFO|Loading|Analyzing|Target|  bazel-bin)' || true
bin=bazel-bin/client
out=out/demo
mkdir -p "$out"
model=tests/configs/qwen3-30b-a3b.json
echo "== layouts: $model, widths / $scale"
$bin/refit-layout --config "$model" --scale-down "$scale" --side trainer \
  --tp 2 --pp 2 --ep 4 --dp 4 --gpus-per-node 8 -o "$out/trainer.json"
$bin/refit-layout --config "$model" --scale-down "$scale" --side inference \
  --tp 4 --dp 2 --gpus-per-node 8 --first-node 4 -o "$out/inference.json"
ls -l "$out"/*.json | awk '{print "   ", $NF, $5, "bytes"}'
echo "== plan and verify on the CPU"
$bin/refit-plan --src "$out/trainer.json" --dst "$out/inference.json" --verify "$@"
