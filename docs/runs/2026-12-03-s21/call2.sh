# Call 2 on one H200: the quantizing kernel (bit for bit, then speed against the copy of the same
# run), the vLLM adapter's RL loop on a real model, and the Python client's CUDA paths.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
s=$SECONDS
OUT=$OUT timeout 260 bash tests/gpu/fp8_speed.sh > $OUT/fp8_speed.txt 2>&1; echo "fp8_speed rc=$? $((SECONDS-s))s" | tee $OUT/summary.txt
s=$SECONDS
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 REFIT_BIN_DIR=$PWD/.device/bin
python3 client/python/gen_stubs.py --proto-root . --out client/python/refit/_proto > /dev/null 2>&1
timeout 150 python3 tests/gpu/integrations/rl_loop.py --out $OUT/rl_loop.json > $OUT/rl_loop.txt 2>&1; echo "rl_loop rc=$? $((SECONDS-s))s" | tee -a $OUT/summary.txt
s=$SECONDS
OUT=$OUT timeout 120 bash tests/gpu/python_cuda.sh > $OUT/python_cuda.txt 2>&1; echo "python_cuda rc=$? $((SECONDS-s))s" | tee -a $OUT/summary.txt
tail -n 12 $OUT/fp8_speed.txt; tail -n 8 $OUT/rl_loop.txt; tail -n 6 $OUT/python_cuda.txt
