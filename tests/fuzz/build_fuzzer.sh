#!/usr/bin/env bash
# Builds one libFuzzer target with clang, AddressSanitizer and UBSan (Bazel's toolchain is gcc,
# which has no -fsanitize=fuzzer): run by the genrules in tests/fuzz/BUILD.
#   build_fuzzer.sh OUTPUT GENDIR SOURCE...   (headers among the sources are skipped)
set -euo pipefail
out=$1 gendir=$2
shift 2
objs=$(mktemp -d)
trap 'rm -rf "$objs"' EXIT
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
       -I. -I"$gendir")
srcs=()
for s in "$@"; do case "$s" in *.cc) srcs+=("$s") ;; esac; done
# Two at a time: the machines have 2 cores.
printf '%s\n' "${srcs[@]}" | xargs -P 2 -I{} sh -c \
  'clang++ "$@" -c "{}" -o "'"$objs"'/$(echo "{}" | tr / _).o"' sh "${flags[@]}"
libs=$(pkg-config --libs protobuf absl_status absl_statusor absl_strings absl_str_format absl_hash absl_raw_hash_set)
# shellcheck disable=SC2086
clang++ -fsanitize=fuzzer,address,undefined "$objs"/*.o $libs -o "$out"
