# Session 20's GPU call: the cuda backend runs plans installed as slices.
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
s=$SECONDS
OUT=$OUT BENCH_RUNS="after after" BUDGET_S=300 timeout 420 bash tests/gpu/cuda_split.sh > $OUT/cuda_split.txt 2>&1; echo "cuda_split rc=$? $((SECONDS-s))s" | tee -a $OUT/summary.txt
s=$SECONDS
MPS=0 OUT=$OUT timeout 150 bash tests/gpu/armed_faults.sh > $OUT/armed_faults.txt 2>&1; echo "armed_faults (MPS=0) rc=$? $((SECONDS-s))s" | tee -a $OUT/summary.txt
tail -n 25 $OUT/cuda_split.txt $OUT/armed_faults.txt
