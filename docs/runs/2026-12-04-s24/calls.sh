# Calls on one H200 (bundle: bash tools/gpu_test.sh --bundle, after the daemon's move into folders).
# Call 1: every GPU test and smoke but the real-model step (unchanged code, new paths).
export NCCL_NVLS_ENABLE=0
SKIP="models" OUT=$OUT timeout 580 bash tools/gpu_test.sh > $OUT/gpu_test.log 2>&1
# Call 2: the vLLM adapter's RL loop on a real model, its update now carrying the round's id.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 REFIT_BIN_DIR=$PWD/.device/bin
python3 client/python/gen_stubs.py --proto-root . --out client/python/refit/_proto > /dev/null 2>&1
timeout 300 python3 tests/gpu/integrations/rl_loop.py --out $OUT/rl_loop.json > $OUT/rl_loop.txt 2>&1
# Call 3 (after the long functions' split, the backend factory, CollectiveParams): calls 1 and 2
# again (gpu_test_2.txt: armed_faults' case 4b failed once, its round COMMITTED while every session
# dropped and the commit note named only the first worker gone).
# Call 4 (after the COMMIT's failure names every worker that did not confirm): armed_faults twice.
for i in 1 2; do ONLY="armed_faults" OUT=$OUT/r$i timeout 250 bash tools/gpu_test.sh; done
