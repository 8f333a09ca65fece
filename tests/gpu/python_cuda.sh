#!/usr/bin/env bash
# GPU machine: the Python client's CUDA paths and the daemon's CUDA VMM import, from a bundle.
#   here:   bash tests/gpu/python_cuda.sh --bundle
#   there:  OUT=DIR bash tests/gpu/python_cuda.sh      (logs packed into $OUT/python_cuda.tgz)
# Runs: the CUDA VMM and export unit tests; Python workers with live CUDA tensors (default and
# expandable-segments allocators, separate and interior tensors, by GPU UUID) byte-exact through
# refitd --backend cuda; the C++ colocated round trip on IPC and on VMM memory; pip install.
set -uo pipefail
cd "$(dirname "$0")/../.."
programs=(daemon/refitd client/tools/refit-layout client/tools/refitctl tests/workers/sim-worker-cuda daemon/dataplane/cuda/cuda_vmm_test client/worker/cuda_export_test)
if [ "${1:-}" = "--bundle" ]; then
  bazel build //daemon:refitd //client/tools:refit-layout //client/tools:refitctl //tests/workers:sim-worker-cuda \
    //daemon/dataplane/cuda:cuda_vmm_test //client/worker:cuda_export_test 2>&1 | grep -E "ERROR|error:" && exit 1
  ../shared/device/bundle .device "${programs[@]/#/bazel-bin/}"
  exit $?
fi
out=${OUT:-out/gpu}
logs=$out/python_cuda
mkdir -p "$logs"
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0
status=0
_step() {  # _step NAME SECONDS COMMAND...: runs it, logs it, one summary line
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$name rc=$rc $((SECONDS - t0))s: $(tail -n 1 "$logs/$name.log")"
}
nvidia-smi -L >"$logs/machine.txt" 2>&1
python3 -c 'import torch, grpc, google.protobuf as p; print(torch.__version__, grpc.__version__, p.__version__)' >>"$logs/machine.txt" 2>&1
only=${ONLY:-}  # ONLY="python_cases pip_install": just those steps
step() {
  case " ${only:-$1} " in *" $1 "*) ;; *) return 0;; esac
  _step "$@"
}
step stubs 60 python3 client/python/gen_stubs.py --proto-root . --out client/python/refit/_proto
step import 60 env PYTHONPATH=client/python python3 -c 'import refit, refit._proto.refit_pb2, refit.worker; print("refit imports")'
step cuda_vmm_test 120 .device/bin/cuda_vmm_test
step cuda_export_test 120 .device/bin/cuda_export_test
step python_cases 300 env REFIT_BIN_DIR=.device/bin python3 tests/gpu/python/run_cuda_cases.py --out "$logs"
step colocated_ipc 120 env BIN=.device/bin RUN=/tmp/refit-col-ipc SCALE=8 bash tests/gpu/colocated.sh
cp /tmp/refit-col-ipc/daemon0.log "$logs/colocated_ipc_daemon0.log" 2>/dev/null
step colocated_vmm 120 env BIN=.device/bin RUN=/tmp/refit-col-vmm SCALE=8 SIM_WORKER_VMM=1 bash tests/gpu/colocated.sh
cp /tmp/refit-col-vmm/daemon0.log "$logs/colocated_vmm_daemon0.log" 2>/dev/null
step pip_install 120 bash -c 'python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/refit-pkg ./client/python && cd /tmp && PYTHONPATH=/tmp/refit-pkg python3 -c "import refit, refit.worker; print(refit.__file__)"'
cp "$logs/python_cases.log" "$out/python_cases.jsonl" 2>/dev/null
tar czf "$out/python_cuda.tgz" -C "$out" python_cuda && rm -rf "$logs"
exit $status
