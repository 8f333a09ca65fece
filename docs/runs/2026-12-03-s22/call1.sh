# One call on one H200 (bundle: bash tools/gpu_test.sh --bundle): the GPU tests through the one
# command that runs them (the copy kernels after the fp8 work, the armed rounds and VMM/IPC export
# after the cuda backend's split), then each RL stack's default sync against refit.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
s=$SECONDS
OUT=$OUT ONLY="copy_kernels_test cuda_armed_test cuda_vmm_test cuda_export_test" timeout 170 bash tools/gpu_test.sh > $OUT/gpu_test.txt 2>&1
echo "gpu_test rc=$? $((SECONDS-s))s" | tee $OUT/summary.txt
s=$SECONDS
OUT=$OUT LIMIT_S=210 ROUNDS=4 WARMUP=1 timeout 225 bash tests/gpu/integrations/stack_sync.sh > $OUT/stack_sync.txt 2>&1
echo "stack_sync rc=$? $((SECONDS-s))s" | tee -a $OUT/summary.txt
tail -n 8 $OUT/gpu_test.txt; tail -n 30 $OUT/stack_sync.txt
