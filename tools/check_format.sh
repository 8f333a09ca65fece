#!/usr/bin/env bash
# Fails, naming each file, when a tracked C++ or CUDA file differs from what clang-format makes of
# it with the repository's .clang-format (Debian's clang-format-14; tools/setup.sh installs it).
#   bash tools/check_format.sh          check (tools/test.sh runs it first)
#   bash tools/check_format.sh --fix    rewrite the files in place
set -uo pipefail
cd "$(dirname "$0")/.."
format=$(command -v clang-format-14 || command -v clang-format) || {
  echo "check_format: clang-format is not installed (bash tools/setup.sh installs it)" >&2; exit 2; }
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | grep -v '^third_party/')
if [ "${1:-}" = "--fix" ]; then
  "$format" -i --style=file "${files[@]}"
  exit $?
fi
bad=()
for f in "${files[@]}"; do
  "$format" --style=file --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "check_format: ${#bad[@]} file(s) differ from .clang-format (fix: bash tools/check_format.sh --fix):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files formatted"
