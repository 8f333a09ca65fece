# Call 3 on one H200: the vLLM adapter's RL loop again (the CUDA export now pushes the device's
# primary context itself, for engine worker threads), and the armed fault cases with the cuda backend.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 REFIT_BIN_DIR=$PWD/.device/bin
python3 client/python/gen_stubs.py --proto-root . --out client/python/refit/_proto > /dev/null 2>&1
s=$SECONDS
timeout 200 python3 tests/gpu/integrations/rl_loop.py --out $OUT/rl_loop.json > $OUT/rl_loop.txt 2>&1; echo "rl_loop rc=$? $((SECONDS-s))s" | tee $OUT/summary.txt
s=$SECONDS
MPS=0 OUT=$OUT timeout 200 bash tests/gpu/armed_faults.sh > $OUT/armed_faults.txt 2>&1; echo "armed_faults rc=$? $((SECONDS-s))s" | tee -a $OUT/summary.txt
tail -n 30 $OUT/rl_loop.txt; tail -n 12 $OUT/armed_faults.txt
