#!/usr/bin/env bash
# GPU machine: the copy kernels' GPU test (kernels/copy_kernels_test: the fp8 quantizing units,
# tagged [fp8], against the host twin bit for bit, then the copy cases), from a bundle made here.
#   here:   bash tests/gpu/fp8_kernels.sh --bundle     (builds it into .device/fp8; /.device is ignored)
#   there:  bash tests/gpu/fp8_kernels.sh              (device tool: carry .device/fp8; log under $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=.device/fp8
if [ "${1:-}" = "--bundle" ]; then
  bazel build //kernels:copy_kernels_test 2>&1 | grep -E "ERROR|error:" && exit 1
  bin=$(bazel info bazel-bin 2>/dev/null) || exit 1
  ../shared/device/bundle "$dest" "$bin/kernels/copy_kernels_test" || exit 1
  git log -1 --format='%H %s' >"$dest/commit.txt"; git status --short >>"$dest/commit.txt"
  exit 0
fi
[ -x "$dest/bin/copy_kernels_test" ] || { echo "no $dest/bin/copy_kernels_test: run --bundle here first, and carry $dest" >&2; exit 2; }
out=${OUT:-out/gpu}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/$dest/lib:/usr/local/cuda/lib64
{ nvidia-smi -L; cat "$dest/commit.txt" 2>/dev/null; } 2>&1 | tee "$out/fp8_machine.txt"
status=0
timeout 300 "$dest/bin/copy_kernels_test" "[fp8]" --durations yes 2>&1 | tee "$out/fp8_kernels.log" || status=1
timeout 240 "$dest/bin/copy_kernels_test" "~[fp8]" --durations yes 2>&1 | tee "$out/copy_kernels.log" || status=1
echo "status=$status"
exit $status
