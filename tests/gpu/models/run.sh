#!/usr/bin/env bash
# GPU machine: real models through refit (docs/MODELS.md). transformers' causal LMs built from
# configs (random init, no downloads), FSDP2 (fully_shard) over the trainer ranks, AdamW steps on
# random tokens between rounds; the reference engine in vLLM's conventions (tests/models) on GPU 0,
# colocated, one `refitd --backend cuda`. Every round checks weights bit for bit; logits and 32
# greedy tokens exact: equal to the reference engine's (the same engine code, the trainer's weights
# loaded the ordinary way) in every mode, and in transformers' arithmetic (transformers' own modules
# on views of the engine's parameters) equal to the trainer's; a decode in flight and a refused
# round; and times the round against the optimizer step and against full_tensor()-then-copy
# (docs/BENCHMARKS.md). A config with an fp8 quantization_config (the DeepSeek-V3 cut) gets a
# block-fp8 engine with weight_scale_inv (tests/models/fp8ref.py).
#   here:   bash tests/gpu/models/run.sh --bundle          (bash tests/gpu/python_cuda.sh --bundle)
#   there:  OUT=DIR bash tests/gpu/models/run.sh            (logs packed into $OUT/models.tgz)
# Env: CONFIGS (default: Qwen2.5-0.5B, a Llama-3-style cut, a Qwen3-MoE cut, and cuts of
# DeepSeek-V3 (fp8 engine), DeepSeek-V2-Lite, Kimi-K2 and Mixtral; docs/MODELS.md), TRAINER_RANKS
# (default: every GPU; the engine stays on GPU 0), BENCH_ROUNDS (5). Without a GPU or without
# transformers it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/../../.."
if [ "${1:-}" = "--bundle" ]; then
  exec bash tests/gpu/python_cuda.sh --bundle
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "models: no GPU here: skipped"; exit 0
fi
if ! python3 -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "models: torch with CUDA and transformers are needed: skipped"; exit 0
fi
[ -x .device/bin/refitd ] || { echo "models: .device/bin/refitd missing (bundle it here first)"; exit 1; }
out=${OUT:-out/gpu}
logs=$out/models
mkdir -p "$logs"
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
  REFIT_BIN_DIR=$PWD/.device/bin REFIT_TORCH_THREADS=4
gpus=$(nvidia-smi -L | grep -c '^GPU ')
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, transformers, grpc; print("torch", torch.__version__, "transformers", transformers.__version__, "grpc", grpc.__version__)'
  nproc; } >"$logs/machine.txt" 2>&1
python3 client/python/gen_stubs.py --proto-root . --out client/python/refit/_proto >"$logs/stubs.log" 2>&1 || { cat "$logs/stubs.log"; exit 1; }
dense="tests/models/configs/qwen2.5-0.5b.json tests/models/configs/llama3-small.json"
moe="tests/models/configs/qwen3-moe-small.json tests/models/configs/deepseek-v3-small.json
  tests/models/configs/deepseek-v2-lite-small.json tests/models/configs/kimi-k2-small.json
  tests/models/configs/mixtral-small.json"
configs=${CONFIGS:-"$dense $moe"}
args=()
for c in $configs; do args+=(--config "$c"); done
timeout "${MODELS_TIMEOUT:-1500}" python3 tests/models/driver.py "${args[@]}" --impl hf --device cuda --dtype bfloat16 \
  --backend cuda --trainer-ranks "${TRAINER_RANKS:-$gpus}" --bench-rounds "${BENCH_ROUNDS:-5}" \
  --out "$logs" 2>&1 | tee "$logs/driver.log"
status=${PIPESTATUS[0]}
cat "$logs/machine.txt"
tar czf "$out/models.tgz" -C "$out" models && rm -rf "$logs"
exit "$status"
