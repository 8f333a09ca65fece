#!/usr/bin/env bash
# Writes a fuzz target's seed corpus into DEST: every file of tests/fuzz/corpus/TARGET as is,
# except text-format protobuf (*.txtpb), encoded to binary by protoc as the message its first line
# names ("# refit.v1.Layout: ...").
#   bash tests/fuzz/seeds.sh CORPUS_DIR DEST    (run from the repository root or a Bazel runfiles tree)
set -euo pipefail
src=$1 dest=$2
mkdir -p "$dest"
for f in "$src"/*; do
  [ -f "$f" ] || continue
  case "$f" in
    *.txtpb)
      type=$(head -n 1 "$f" | sed -n 's/^# *\([A-Za-z0-9_.]*\):.*/\1/p')
      [ -n "$type" ] || { echo "$f: its first line must name the message (# refit.v1.X: ...)" >&2; exit 1; }
      proto=proto/layout.proto
      [ "${type#refit.v1.}" = Layout ] || proto=proto/refit.proto
      protoc --proto_path=. --encode="$type" "$proto" < "$f" > "$dest/$(basename "$f" .txtpb).bin" ;;
    *) cp "$f" "$dest/" ;;
  esac
done
