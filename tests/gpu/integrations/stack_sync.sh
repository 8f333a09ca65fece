#!/usr/bin/env bash
# GPU machine: each RL stack's default weight sync against refit through its adapter, one GPU,
# trainer and engine processes colocated (tests/gpu/integrations/stack_sync_bench.py).
#   here:   bash tests/gpu/integrations/stack_sync.sh --bundle     (builds refitd into .device/)
#   there:  OUT=DIR bash tests/gpu/integrations/stack_sync.sh      (writes $OUT/stack_sync.json)
# Settings from the environment: MODEL (qwen2-0.6b), ROUNDS (5), WARMUP (1),
# STACKS (sglang,verl,nemo_rl), LIMIT_S (480, the whole benchmark's deadline).
# The log goes to $OUT/stack_sync.log; the last lines are printed.
set -uo pipefail
cd "$(dirname "$0")/../../.."
if [ "${1:-}" = "--bundle" ]; then
  bazel build //daemon:refitd 2>&1 | grep -E "ERROR|error:" && exit 1
  ../shared/device/bundle .device bazel-bin/daemon/refitd
  exit $?
fi
out=${OUT:-out/gpu}
mkdir -p "$out"
[ -x .device/bin/refitd ] || { echo "stack_sync: .device/bin/refitd is missing: run '$0 --bundle' before the call" >&2; exit 2; }
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export REFIT_BIN_DIR=$PWD/.device/bin HF_HUB_OFFLINE=1
{
  nvidia-smi -L
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} >"$out/stack_sync.log" 2>&1
python3 client/python/gen_stubs.py --proto-root . --out client/python/refit/_proto >>"$out/stack_sync.log" 2>&1 \
  || { echo "stack_sync: generating the protobuf modules failed (see $out/stack_sync.log)" >&2; exit 1; }
t0=$SECONDS
timeout "${LIMIT_S:-480}" python3 tests/gpu/integrations/stack_sync_bench.py --out "$out/stack_sync.json" \
  --model "${MODEL:-qwen2-0.6b}" --rounds "${ROUNDS:-5}" --warmup "${WARMUP:-1}" \
  --stacks "${STACKS:-sglang,verl,nemo_rl}" >>"$out/stack_sync.log" 2>&1
rc=$?
echo "stack_sync rc=$rc $((SECONDS - t0))s" | tee -a "$out/stack_sync.log"
tail -n 60 "$out/stack_sync.log"
exit $rc
