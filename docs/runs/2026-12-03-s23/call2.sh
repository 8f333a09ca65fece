# Call 2 on one H200: refitd's colocated refit of Llama-3-8B into bf16, block fp8 and MXFP8
# engines (quantizing work now through the quantizing kernel), each round checked against the CPU
# reference, beside a device-to-device copy of the same bytes and the per-tensor copy baseline;
# then the real-model harness on the DeepSeek-V3 cut alone (its engine in block fp8).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
s=$SECONDS
OUT=$OUT KERNEL_BENCH=0 BUDGET_S=300 CASES="llama3-8b:1:fp8-block llama3-8b:1 llama3-8b:1:mxfp8" RUNS="after" \
  timeout 330 bash tests/gpu/local_path.sh > $OUT/local_path.txt 2>&1
echo "local_path rc=$? $((SECONDS-s))s" | tee $OUT/summary.txt
s=$SECONDS
mkdir -p $OUT/models
OUT=$OUT/models CONFIGS=tests/models/configs/deepseek-v3-small.json BENCH_ROUNDS=2 \
  timeout 190 bash tests/gpu/models/run.sh > $OUT/models.txt 2>&1
echo "models rc=$? $((SECONDS-s))s" | tee -a $OUT/summary.txt
tar czf $OUT/logs.tgz -C $OUT models local_path 2>/dev/null; rm -rf $OUT/models $OUT/local_path
tail -n 14 $OUT/local_path.txt; tail -n 12 $OUT/models.txt
