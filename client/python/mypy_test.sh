#!/usr/bin/env bash
# Type-checks the refit package with Debian's mypy (tools/setup.sh installs it), as configured in
# pyproject.toml ([tool.mypy]); offline, from Bazel's runfiles.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"  # client/python, in the runfiles or the checkout
if ! command -v mypy >/dev/null; then
  echo "mypy_test: mypy is not installed (Debian: apt-get install mypy; bash tools/setup.sh does)" >&2
  exit 1
fi
cd "$here"
exec mypy --config-file pyproject.toml --cache-dir "${TEST_TMPDIR:-/tmp}/mypy-cache" --no-error-summary
