#!/usr/bin/env bash
# The main job (README): a real refit on a local cluster, on the CPU.
#
# Qwen3-30B-A3B's structure (48 layers, 128 experts, GQA, qk-norm) with every width divided by 16
# so that it fits a laptop. Two "training node" daemons hold a Megatron trainer TP2 EP2 DP2 (four
# processes), two "inference node" daemons hold a vLLM engine TP2 DP2 (four processes: fused qkv
# and gate_up, stacked experts, padded vocabulary). Every worker is its own process with its
# weights in shared memory. The trainers produce new weights for each version; each round moves
# them into the engines (daemon to daemon over TCP, host backend), and every engine checks every
# byte it received before the round is reported.
#
# Where two or more GPUs are present (and --cpu is not given), the refit runs on them instead:
# one daemon with the node's GPUs (--backend cuda), trainers FSDP over two GPUs and a TP=2
# engine on the same GPUs, weights in GPU memory shared by CUDA IPC (tests/gpu/colocated.sh).
#   bash tools/demo.sh [--cpu] [--scale-down N] [--rounds N]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
scale=16
rounds=3
cpu=0
while [ $# -gt 0 ]; do
  case $1 in
    --scale-down) scale=$2; shift 2;;
    --rounds) rounds=$2; shift 2;;
    --cpu) cpu=1; shift;;
    *) echo "demo: unknown argument $1" >&2; exit 2;;
  esac
done
gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c "^GPU" || true)
if [ "$cpu" -eq 0 ] && [ "$gpus" -ge 2 ]; then
  echo "== $gpus GPUs: the refit runs on GPUs 0 and 1 (--cpu for the CPU cluster)"
  bazel build //daemon:refitd //client/tools:refitctl //client/tools:refit-layout //tests/workers:sim-worker-cuda 2>&1 |
    grep -E "ERROR|error:" || true
  BIN=$(mktemp -d)
  for p in daemon/refitd client/tools/refitctl client/tools/refit-layout tests/workers/sim-worker-cuda; do cp "bazel-bin/$p" "$BIN/"; done
  BIN=$BIN SCALE=$((scale / 2 > 0 ? scale / 2 : 1)) exec bash tests/gpu/colocated.sh
fi
echo "== building"
bazel build //daemon:refitd //client/tools:refitctl //client/tools:refit-layout //tests/workers:sim-worker 2>&1 |
  grep -E "ERROR|error:" || true
BIN=$(mktemp -d)
for p in daemon/refitd client/tools/refitctl client/tools/refit-layout tests/workers/sim-worker; do
  cp "bazel-bin/$p" "$BIN/"
done
RUN=$(mktemp -d)
source tools/cluster_lib.sh
trap 'stop_all; rm -rf "$BIN"' EXIT

model=tests/configs/qwen3-30b-a3b.json
echo "== layouts: $model, widths / $scale"
"$BIN/refit-layout" --config "$model" --scale-down "$scale" --side trainer --tp 2 --ep 2 --dp 2 \
  --gpus-per-node 2 -o "$RUN/trainer.json"
"$BIN/refit-layout" --config "$model" --scale-down "$scale" --side inference --tp 2 --dp 2 \
  --gpus-per-node 2 --first-node 2 -o "$RUN/inference.json"

echo "== starting 4 daemons and 8 worker processes"
# The stand-in workers check every byte at COMMIT (seconds on a small, busy machine; a real
# engine resumes at once), so the phases get more than the default 10 s.
for n in 0 1 2 3; do start_daemon "$n" --prepare-timeout 60 --commit-timeout 60; done
keys=()
while read -r name node; do start_worker "$name" "$node" policy trainer "$RUN/trainer.json" "$name"; keys+=("$name"); done < <(workers_of "$RUN/trainer.json")
while read -r name node; do start_worker "$name" "$node" policy inference "$RUN/inference.json" "$name"; keys+=("$name"); done < <(workers_of "$RUN/inference.json")
wait_registered "${keys[@]}"
ctl status
echo
ctl plan policy
echo
echo "== $rounds rounds"
for v in $(seq 1 "$rounds"); do
  if [ "$v" -eq 1 ]; then ctl refit policy "$v"; else ctl refit policy "$v" | tail -n 1; fi
  for r in "$RUN"/vllm-*.report; do
    grep -q "^commit $v ok" "$r" || { echo "demo: $(basename "$r" .report) did not verify version $v: $(tail -n 1 "$r")"; exit 1; }
  done
done
echo
echo "every inference worker checked every byte of every version:"
grep -h "ok" "$RUN"/vllm-*.report | tail -n 4 | sed 's/^/  /'
