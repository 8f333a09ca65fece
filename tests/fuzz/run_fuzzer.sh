#!/usr/bin/env bash
# CI's short run of one fuzz target (tests/fuzz/BUILD): seeds from its corpus, SECONDS of
# fuzzing, a failure on any finding (the input is kept in Bazel's undeclared outputs).
#   run_fuzzer.sh FUZZER CORPUS_DIR SECONDS [DICT]
set -euo pipefail
fuzzer=$1 corpus=$2 seconds=$3 dict=${4:-}
work=${TEST_TMPDIR:-$(mktemp -d)}/corpus
crashes=${TEST_UNDECLARED_OUTPUTS_DIR:-$(mktemp -d)}/
bash tests/fuzz/seeds.sh "$corpus" "$work"
args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1
      -artifact_prefix="$crashes")
[ -n "$dict" ] && args+=(-dict="$dict")
nice -n 19 "$fuzzer" "${args[@]}" "$work"
