#!/usr/bin/env bash
# Runs every test that needs no GPU. The README's test command; .ci/run calls it.
# Extra arguments go to `bazel test` (e.g. a single target: bash tools/test.sh //plan:box_test).
# Tests tagged "gpu" are built but not run (.bazelrc's test_tag_filters); they fail where no GPU
# is present, so that a test that did not run is never counted as passed: tools/gpu_test.sh runs
# them on a GPU machine.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || exit 1
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(//...)
  # clang's thread-safety analysis of the daemon's lock annotations (.bazelrc's --config=tsa: its
  # own output directory, so neither build evicts the other; about 70 s cold on 2 cores, seconds
  # when only daemon/ changed).
  bazel build --config=tsa //daemon/... || exit 1
  # The daemon and the clients depend on neither's internals (common/ holds what both use), and
  # every C++ and CUDA file is as clang-format makes it (bash tools/check_format.sh --fix).
  bash tools/check_deps.sh || exit 1
  bash tools/check_format.sh || exit 1
fi
exec bazel test "${targets[@]}"
