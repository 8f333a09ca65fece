#!/usr/bin/env bash
# Builds the layout fuzzer with clang's libFuzzer, AddressSanitizer and UBSan, and runs it.
#   bash tools/fuzz.sh [SECONDS]   (default 120); findings land in out/fuzz/
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
seconds=${1:-120}
out=out/fuzz
mkdir -p "$out/gen/proto" "$out/corpus" "$out/crashes"
protoc --proto_path=. --cpp_out="$out/gen" proto/layout.proto
srcs=(tests/fuzz/layout_fuzzer.cc "$out/gen/proto/layout.pb.cc" proto/layout_codec.cc
      plan/box.cc plan/dtype.cc plan/layout.cc plan/validate.cc plan/lower.cc plan/region_set.cc
      plan/planner.cc plan/convert.cc plan/host_copy.cc plan/verify.cc)
libs=$(pkg-config --libs protobuf absl_status absl_statusor absl_strings absl_str_format absl_hash absl_raw_hash_set)
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I. -I"$out/gen" "${srcs[@]}" $libs -o "$out/layout_fuzzer"
cp -n tests/fuzz/corpus/*.json "$out/corpus/" 2>/dev/null || true
"$out/layout_fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
  -artifact_prefix="$out/crashes/" "$out/corpus" 2>&1 | tail -n 25
