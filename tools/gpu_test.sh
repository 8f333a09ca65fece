#!/usr/bin/env bash
# Every GPU test and benchmark smoke, in one call on a GPU machine (CI runs none of them: it has
# no GPU). The GPU machine has no Bazel, so the programs are built here and travel as a bundle.
#   here:   bash tools/gpu_test.sh --bundle        (builds into .device; carry .device)
#   there:  OUT=DIR bash tools/gpu_test.sh         (logs packed into $OUT/gpu_test.tgz)
# Runs: every test tagged "gpu" (their list is read from Bazel at bundle time); the Python
# client's CUDA paths (tests/gpu/python_cuda.sh); two groups on one daemon; the colocated
# benchmark at a small scale; the armed fault cases; the real-model harness on its smallest model;
# and, where two GPUs or more are present, the disaggregated path through NCCL. Ends with the line
# "N passed, N failed" and a non-zero status if any step failed.
# Env: ONLY="step ..." runs just those steps; SKIP="step ..." leaves those out; SCALE divides the
# benchmarks' widths (default 8).
set -uo pipefail
cd "$(dirname "$0")/.."
tools=(daemon/refitd client/tools/refit-layout client/tools/refitctl tests/workers/sim-worker tests/workers/sim-worker-cuda
      )
if [ "${1:-}" = "--bundle" ]; then
  mapfile -t gpu_tests < <(bazel query 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null | sort)
  [ ${#gpu_tests[@]} -gt 0 ] || { echo "gpu_test: no test tagged \"gpu\" found" >&2; exit 1; }
  targets=("${gpu_tests[@]}")
  for t in "${tools[@]}"; do targets+=("//${t%/*}:${t##*/}"); done
  bazel build "${targets[@]}" 2>&1 | grep -E "ERROR|error:" && exit 1
  bin=$(bazel info bazel-bin 2>/dev/null) || exit 1
  programs=()
  for t in "${targets[@]}"; do
    t=${t#//}
    programs+=("$bin/${t%%:*}/${t##*:}")
  done
  ../shared/device/bundle .device "${programs[@]}" || exit 1
  printf '%s\n' "${gpu_tests[@]}" >.device/gpu_tests.txt
  git log -1 --format='%H %s' >.device/commit.txt
  git status --short >>.device/commit.txt
  exit 0
fi
[ -f .device/gpu_tests.txt ] || { echo "gpu_test: no bundle here: run 'bash tools/gpu_test.sh --bundle' first" >&2; exit 2; }
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "gpu_test: no GPU here: these tests need one"
  echo "0 passed, 1 failed"
  exit 1
fi
out=${OUT:-out/gpu}
logs=$out/gpu_test
mkdir -p "$logs"
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L | grep -c '^GPU ')
scale=${SCALE:-8}
passed=0 failed=0
step() {  # step NAME SECONDS COMMAND...: runs it, logs it, one summary line
  local name=$1 secs=$2; shift 2
  case " ${ONLY:-$name} " in *" $name "*) ;; *) return 0 ;; esac
  case " ${SKIP:-} " in *" $name "*) return 0 ;; esac
  local t0=$SECONDS
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
  echo "$name rc=$rc $((SECONDS - t0))s: $(tail -n 1 "$logs/$name.log")"
}
{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  cat .device/commit.txt; } >"$logs/machine.txt" 2>&1
while read -r target; do
  name=${target##*:}
  step "$name" 300 ".device/bin/$name" --durations yes
done <.device/gpu_tests.txt
step python_cuda 300 env OUT="$logs" bash tests/gpu/python_cuda.sh
step two_groups 180 env BIN=.device/bin RUN=/tmp/gpu-test-two-groups SCALE="$scale" bash tests/gpu/two_groups.sh
step colocated_bench 180 env BIN=.device/bin RUN=/tmp/gpu-test-bench SCALE="$scale" bash tests/gpu/colocated_bench.sh
step armed_faults 420 env BIN=.device/bin OUT="$logs" SCALE="$scale" bash tests/gpu/armed_faults.sh
step models 420 env OUT="$logs" CONFIGS="${MODEL_CONFIGS:-tests/models/configs/qwen2.5-0.5b.json}" BENCH_ROUNDS=2 bash tests/gpu/models/run.sh
if [ "$gpus" -ge 2 ]; then
  step disaggregated 300 env BIN=.device/bin RUN=/tmp/gpu-test-disagg SCALE="$scale" bash tests/gpu/disaggregated.sh
fi
tar czf "$out/gpu_test.tgz" -C "$out" gpu_test && rm -rf "$logs"
echo "${passed} passed, ${failed} failed"
[ "$failed" -eq 0 ]
