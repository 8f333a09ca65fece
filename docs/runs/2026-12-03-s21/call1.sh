# Call 1 on one H200: the frontier model families through the real-model harness (tests/gpu/models).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
s=$SECONDS
CONFIGS="tests/models/configs/deepseek-v3-small.json tests/models/configs/deepseek-v2-lite-small.json tests/models/configs/kimi-k2-small.json tests/models/configs/mixtral-small.json" \
  BENCH_ROUNDS=1 MODELS_TIMEOUT=520 OUT=$OUT timeout 560 bash tests/gpu/models/run.sh > $OUT/models.txt 2>&1
echo "models rc=$? $((SECONDS-s))s" | tee $OUT/summary.txt
tail -n 40 $OUT/models.txt
