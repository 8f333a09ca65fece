#!/usr/bin/env bash
# Runs every GPU test and benchmark on a GPU machine, from programs built and bundled here:
#   here:   bash tools/gpu_run.sh --bundle        (builds, bundles into .device/)
#   there:  bash tools/gpu_run.sh                 (runs; logs under $OUT, default out/gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
programs=(client/worker/cuda_export_test kernels/copy_kernels_test kernels/copy_bench kernels/peer_bench kernels/nccl_pair_bench daemon/refitd client/tools/refitctl client/tools/refit-layout
          tests/workers/sim-worker-cuda)
if [ "${1:-}" = "--bundle" ]; then
  bazel build //client/worker:cuda_export_test //kernels:copy_kernels_test //kernels:copy_bench //kernels:peer_bench //kernels:nccl_pair_bench //daemon:refitd //client/tools:refitctl \
    //client/tools:refit-layout //tests/workers:sim-worker-cuda 2>&1 | grep -E "ERROR|error:" && exit 1
  ../shared/device/bundle .device "${programs[@]/#/bazel-bin/}"
  exit $?
fi
out=${OUT:-out/gpu}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/machine.txt" 2>&1
status=0
.device/bin/cuda_export_test >"$out/cuda_export_test.log" 2>&1 || status=1
tail -n 2 "$out/cuda_export_test.log"
.device/bin/copy_kernels_test --durations yes >"$out/copy_kernels_test.log" 2>&1 || status=1
.device/bin/copy_bench --repeat 20 >"$out/copy_bench.jsonl" 2>"$out/copy_bench.err" || status=1
tail -n 3 "$out/copy_kernels_test.log"
cat "$out/copy_bench.jsonl"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -ge 2 ]; then
  .device/bin/peer_bench --repeat 10 >"$out/peer_bench.jsonl" 2>&1 || status=1
  cat "$out/peer_bench.jsonl"
  RUN=/tmp/refit-colocated SCALE=${SCALE:-4} bash tests/gpu/colocated.sh >"$out/colocated.log" 2>&1 || status=1
  cp /tmp/refit-colocated/daemon0.log "$out/colocated_daemon0.log" 2>/dev/null
  tail -n 12 "$out/colocated.log"
  RUN=/tmp/refit-disaggregated SCALE=${SCALE:-4} bash tests/gpu/disaggregated.sh >"$out/disaggregated.log" 2>&1 || status=1
  tail -n 20 "$out/disaggregated.log"
fi
# PACK=1: one tarball instead of many files (the device tool brings back only a few files).
if [ "${PACK:-0}" -eq 1 ]; then
  tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"
fi
exit $status
