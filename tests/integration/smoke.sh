#!/usr/bin/env bash
set -uo pipefail
BIN=${BIN:-bazel-bin/bin}
RUN=$(mktemp -d)
source tools/cluster_lib.sh
trap stop_all EXIT
"$BIN/refit-layout" --config tests/configs/llama3-8b.json --scale-down 32 --layers 2 --side trainer --tp 2 --gpus-per-node 2 -o "$RUN/t.json"
"$BIN/refit-layout" --config tests/configs/llama3-8b.json --scale-down 32 --layers 2 --side inference --tp 2 --gpus-per-node 2 --first-node 1 -o "$RUN/i.json"
start_daemon 0 && start_daemon 1
while read -r name node; do start_worker "$name" "$node" policy trainer "$RUN/t.json" "$name"; keys+=("$name"); done < <(workers_of "$RUN/t.json")
while read -r name node; do start_worker "$name" "$node" policy inference "$RUN/i.json" "$name"; keys+=("$name"); done < <(workers_of "$RUN/i.json")
wait_registered "${keys[@]}"
ctl status
ctl refit policy 1
ctl refit policy 2
cat "$RUN"/*.report
