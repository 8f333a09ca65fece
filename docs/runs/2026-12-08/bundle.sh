#!/usr/bin/env bash
# The bundle that call1.sh, call2.sh and call3.sh take to the GPU machine, built here from the
# checkout (from the repository root: bash docs/runs/2026-12-08/bundle.sh; then carry [".device"]).
# Besides main's programs, two builds of kernels/local_copy_bench with more loads in flight a lane:
# -k8 (the general kernel's 16-byte tiles, TileCopy and TileCopyInline <16, 8>) and -k8a (also the
# aligned loop's kInFlight = 8); kernels/copy_device.cuh is restored after them. Stripped to fit
# the 64 MiB a call carries.
set -euo pipefail
cuh=kernels/copy_device.cuh
git diff --quiet -- "$cuh" || { echo "bundle.sh: $cuh has changes; commit or stash them first" >&2; exit 1; }
bin=$(bazel info bazel-bin 2>/dev/null)
bazel build //daemon:refitd //client/tools:refit-layout //client/tools:refitctl //tests/workers:sim-worker-cuda \
  //tests/workers:sim-worker //kernels:copy_kernels_test //kernels:local_copy_bench
../shared/device/bundle .device "$bin"/daemon/refitd "$bin"/client/tools/refit-layout "$bin"/client/tools/refitctl \
  "$bin"/tests/workers/sim-worker-cuda "$bin"/tests/workers/sim-worker "$bin"/kernels/copy_kernels_test \
  "$bin"/kernels/local_copy_bench
mv .device/bin/local_copy_bench .device/bin/local_copy_bench-k4p  # the calls copy it back: 4.5 MiB less to carry
trap 'git checkout -- "$cuh"' EXIT
sed -i 's/TileCopy<16, 4>(/TileCopy<16, 8>(/; s/TileCopyInline<16, 4>(/TileCopyInline<16, 8>(/' "$cuh"
bazel build //kernels:local_copy_bench
cp "$bin"/kernels/local_copy_bench .device/bin/local_copy_bench-k8
sed -i '170s/constexpr int kInFlight = 4;/constexpr int kInFlight = 8;/' "$cuh"
grep -q "constexpr int kInFlight = 8;" "$cuh" || { echo "bundle.sh: the aligned loop's line moved" >&2; exit 1; }
bazel build //kernels:local_copy_bench
cp "$bin"/kernels/local_copy_bench .device/bin/local_copy_bench-k8a
git checkout -- "$cuh"
bazel build //kernels:local_copy_bench  # bazel-bin as main has it again
chmod -R u+w .device
strip .device/bin/*
strip --strip-unneeded .device/lib/*
{ git log -1 --format='%H %s'; echo "local_copy_bench-k8, -k8a: $cuh edited as bundle.sh says"; } >.device/commit.txt
du -sh .device
