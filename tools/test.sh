#!/usr/bin/env bash
# Runs every test that needs no GPU. The README's test command; .ci/run calls it.
# Extra arguments go to `bazel test` (e.g. a single target: bash tools/test.sh //plan:box_test).
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || exit 1
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(//...)
exec bazel test "${targets[@]}"
