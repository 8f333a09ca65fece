#!/usr/bin/env bash
# Builds the fuzz targets (tests/fuzz/BUILD: clang's libFuzzer, AddressSanitizer, UBSan) and runs
# each for SECONDS, one after another, seeded from tests/fuzz/corpus/<target>/ (and the corpus
# grown by earlier runs, out/fuzz/<target>/corpus). Findings land in out/fuzz/<target>/crashes;
# exits non-zero on any. docs/FUZZING.md.
#   bash tools/fuzz.sh [TARGET|all] [SECONDS]     (default: all, 120 s each)
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || exit 1
which=${1:-all}
seconds=${2:-120}
all=(layout registration frame)
if [ "$which" = all ]; then targets=("${all[@]}"); else targets=("$which"); fi

for t in "${targets[@]}"; do
  bazel build "//tests/fuzz:${t}_fuzzer" >/dev/null 2>&1 || { echo "fuzz: cannot build ${t}_fuzzer" >&2; exit 1; }
done
failed=0
for t in "${targets[@]}"; do
  out=out/fuzz/$t
  mkdir -p "$out/corpus" "$out/crashes"
  bash tests/fuzz/seeds.sh "tests/fuzz/corpus/$t" "$out/corpus" || exit 1
  cp -f "bazel-bin/tests/fuzz/${t}_fuzzer" "$out/"
  args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1
        -artifact_prefix="$out/crashes/")
  [ -f "tests/fuzz/$t.dict" ] && args+=(-dict="tests/fuzz/$t.dict")
  echo "fuzz: $t for ${seconds} s (log: $out/fuzz.log)"
  nice -n 19 "$out/${t}_fuzzer" "${args[@]}" "$out/corpus" >"$out/fuzz.log" 2>&1
  status=$?
  grep -E '^#[0-9]+[[:space:]]+DONE|^stat::number_of_executed_units|^stat::peak_rss_mb' "$out/fuzz.log"
  if [ "$status" -ne 0 ] || [ -n "$(ls -A "$out/crashes")" ]; then
    echo "fuzz: $t FOUND something (exit $status): $out/crashes/" >&2
    tail -n 40 "$out/fuzz.log" >&2
    failed=1
  fi
done
exit "$failed"
