# Call 1 on one H200 (bundle: bash tools/gpu_test.sh --bundle): every GPU test and smoke through
# the one command that runs them (the real-model harness on Qwen2.5-0.5B and the DeepSeek-V3 cut,
# its engine in block fp8; the VMM export after MapVmmRange's split; quantizing work through
# refitd's quantizing kernel), then the vLLM adapter's RL loop on a real model after every trainer
# rank's worker became blocking.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
s=$SECONDS
OUT=$OUT MODEL_CONFIGS="tests/models/configs/qwen2.5-0.5b.json tests/models/configs/deepseek-v3-small.json" \
  timeout 360 bash tools/gpu_test.sh > $OUT/gpu_test.txt 2>&1
echo "gpu_test rc=$? $((SECONDS-s))s" | tee $OUT/summary.txt
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 REFIT_BIN_DIR=$PWD/.device/bin
python3 client/python/gen_stubs.py --proto-root . --out client/python/refit/_proto > /dev/null 2>&1
s=$SECONDS
timeout 170 python3 tests/gpu/integrations/rl_loop.py --out $OUT/rl_loop.json > $OUT/rl_loop.txt 2>&1
echo "rl_loop rc=$? $((SECONDS-s))s" | tee -a $OUT/summary.txt
tail -n 16 $OUT/gpu_test.txt; tail -n 12 $OUT/rl_loop.txt
