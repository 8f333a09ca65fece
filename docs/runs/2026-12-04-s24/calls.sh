# Calls on one H200 (bundle: bash tools/gpu_test.sh --bundle, after the daemon's move into folders).
# Call 1: every GPU test and smoke but the real-model step (unchanged code, new paths).
export NCCL_NVLS_ENABLE=0
SKIP="models" OUT=$OUT timeout 580 bash tools/gpu_test.sh > $OUT/gpu_test.log 2>&1
# Call 2: the vLLM adapter's RL loop on a real model, its update now carrying the round's id.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 REFIT_BIN_DIR=$PWD/.device/bin
python3 client/python/gen_stubs.py --proto-root . --out client/python/refit/_proto > /dev/null 2>&1
timeout 300 python3 tests/gpu/integrations/rl_loop.py --out $OUT/rl_loop.json > $OUT/rl_loop.txt 2>&1
