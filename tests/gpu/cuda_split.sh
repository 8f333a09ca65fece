#!/usr/bin/env bash
# GPU machine, one call: everything GPU-related one GPU allows, after the cuda backend's split
# into RAII owners (daemon/dataplane/cuda/), from a bundle made here.
#   here:   [REFITD_BEFORE=FILE] bash tests/gpu/cuda_split.sh --bundle   (FILE: an older refitd to compare)
#           (LOCAL_COPY_BENCH_BEFORE=FILE: an older local_copy_bench bundled as local_copy_bench-before)
#   there:  OUT=DIR bash tests/gpu/cuda_split.sh          (logs packed into $OUT/cuda_split.tgz)
# Runs: the kernels' GPU test; tests/gpu/python_cuda.sh (the VMM and export unit tests, the
# Python client's CUDA cases, colocated on IPC and on VMM, pip install); two groups at once on
# one daemon; and the one-GPU colocated benchmark (tests/gpu/colocated_bench.sh, 16 GB) with the
# older refitd (bundled as refitd-before, when given) and this one, alternating, for comparison.
# BUDGET_S: start no benchmark run after this many seconds.
set -uo pipefail
cd "$(dirname "$0")/../.."
programs=(daemon/refitd client/tools/refit-layout client/tools/refitctl tests/workers/sim-worker-cuda daemon/dataplane/cuda/cuda_vmm_test daemon/dataplane/cuda/cuda_armed_test
          client/worker/cuda_export_test kernels/copy_kernels_test kernels/local_copy_bench kernels/gate_bench tests/bench/ipc_copy_bench)
if [ "${1:-}" = "--bundle" ]; then
  bazel build //daemon:refitd //client/tools:refit-layout //client/tools:refitctl //tests/workers:sim-worker-cuda \
    //daemon/dataplane/cuda:cuda_vmm_test //daemon/dataplane/cuda:cuda_armed_test //client/worker:cuda_export_test //kernels:copy_kernels_test //kernels:local_copy_bench //kernels:gate_bench //tests/bench:ipc_copy_bench 2>&1 | grep -E "ERROR|error:" && exit 1
  # Bazel's own output folder for these options: the bazel-bin link follows whichever build ran
  # last, and other builds (another config) may run in this workspace meanwhile.
  bin=$(bazel info bazel-bin 2>/dev/null) || exit 1
  ../shared/device/bundle .device "${programs[@]/#/$bin/}" || exit 1
  if [ -n "${REFITD_BEFORE:-}" ]; then cp "$REFITD_BEFORE" .device/bin/refitd-before && chmod +x .device/bin/refitd-before; fi
  # An older kernels/local_copy_bench, for tests/gpu/local_path.sh's A/B of the copy kernel.
  if [ -n "${LOCAL_COPY_BENCH_BEFORE:-}" ]; then
    cp "$LOCAL_COPY_BENCH_BEFORE" .device/bin/local_copy_bench-before && chmod +x .device/bin/local_copy_bench-before
  fi
  git log -1 --format='%H %s' >.device/commit.txt; git status --short >>.device/commit.txt
  du -sh .device
  exit 0
fi
out=${OUT:-out/gpu}
logs=$out/cuda_split
mkdir -p "$logs"
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
status=0
step() {  # step NAME SECONDS COMMAND...: runs it, logs it, one summary line
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$name rc=$rc $((SECONDS - t0))s: $(tail -n 1 "$logs/$name.log")"
}
{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
  cat .device/commit.txt 2>/dev/null; } >"$logs/machine.txt" 2>&1
step copy_kernels_test 180 .device/bin/copy_kernels_test --durations yes
# python_cuda.sh's own summary lines are its output; its logs come back as python_cuda.tgz.
step python_cuda 300 env OUT="$logs" bash tests/gpu/python_cuda.sh
sed -n '1,20p' "$logs/python_cuda.log"
step two_groups 120 env BIN=.device/bin RUN=/tmp/refit-two-groups bash tests/gpu/two_groups.sh
cp /tmp/refit-two-groups/daemon0.log "$logs/two_groups_daemon0.log" 2>/dev/null
# The benchmark: before (the older refitd, same workers and tools) and after, alternating.
mkdir -p /tmp/bin-before
for f in .device/bin/*; do ln -sf "$PWD/$f" /tmp/bin-before/; done
[ -x .device/bin/refitd-before ] && ln -sf "$PWD/.device/bin/refitd-before" /tmp/bin-before/refitd
declare -A count=([before]=0 [after]=0)
for run in ${BENCH_RUNS:-before after before after}; do
  if [ -n "${BUDGET_S:-}" ] && [ $SECONDS -gt "$BUDGET_S" ]; then echo "bench $run: skipped (BUDGET_S)"; continue; fi
  [ "$run" = before ] && [ ! -x .device/bin/refitd-before ] && continue
  bin=.device/bin; [ "$run" = before ] && bin=/tmp/bin-before
  n=${count[$run]}; count[$run]=$((n + 1))
  step "bench_${run}_$n" 150 env BIN="$bin" RUN="/tmp/bench-$run-$n" SCALE="${SCALE:-1}" bash tests/gpu/colocated_bench.sh
  cp "/tmp/bench-$run-$n/daemon0.log" "$logs/bench_${run}_${n}_daemon0.log" 2>/dev/null
  grep '^{' "$logs/bench_${run}_$n.log" >>"$logs/bench.jsonl"
done
[ -f "$logs/bench.jsonl" ] && python3 -c '
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    print(d["refitd"].split("/")[-1], "data plane ms", [round(x, 2) for x in d["data_plane_ms"]], "median", round(d["median_data_plane_ms"], 2),
          "transfer ms median", round(d["median_transfer_s"] * 1e3, 2), "round s", [round(x, 2) for x in d["round_s"]])' "$logs/bench.jsonl"
echo "status=$status"
tar czf "$out/cuda_split.tgz" -C "$out" cuda_split && rm -rf "$logs"
exit $status
