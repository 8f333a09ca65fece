#!/usr/bin/env bash
# Every benchmark of the 2-GPU machine in one run, machine-readable.
#   here:   bash tools/gpu_run.sh --bundle          (builds, bundles into .device/)
#   there:  bash tools/gpu_bench.sh                 (results under $OUT, default out/bench)
# Writes: machine.txt, ceilings.jsonl (peer_bench: copy engine, NCCL, local copy), baselines.jsonl
# (tests/bench/baselines.py: gather + broadcast, per-tensor send/recv, PyTorch's NCCL ceiling),
# refit.jsonl (tests/bench/gpu_refit.sh, one line per case) and each case's daemon logs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/bench}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/machine.txt" 2>&1
nvidia-smi topo -m >>"$out/machine.txt" 2>&1
status=0
ceiling() {
  .device/bin/peer_bench --repeat 10 >>"$out/ceilings.jsonl" 2>>"$out/ceilings.err" || status=1
  .device/bin/nccl_pair_bench --repeat 10 >>"$out/ceilings-2proc.jsonl" 2>>"$out/ceilings.err" || status=1
}
ceiling
# (dis-s16 replaced dis-s12 once refit-layout refused Megatron TP4 on its intermediate size 1194.)
# CASES: "label MODE CONFIG SCALE LAYERS MSG STAGING [ROUTING [ZERO_COPY_MIN [REGISTER [ENV,ENV]]]]" per line
# (CASES env overrides the list; ENV: NCCL variables for the daemons, comma-separated).
G=$((1 << 30)); M=$((1 << 20))
default_cases="dis-8b disaggregated llama3-8b 1 0 $((64 * M)) $((2 * G))
col-8b colocated llama3-8b 1 0 $((64 * M)) $((2 * G))
dis-8b-staging256m disaggregated llama3-8b 1 0 $((64 * M)) $((256 * M))
dis-s16 disaggregated llama3-8b 16 0 $((64 * M)) $((2 * G))
dis-s8 disaggregated llama3-8b 8 0 $((64 * M)) $((2 * G))
dis-s4 disaggregated llama3-8b 4 0 $((64 * M)) $((2 * G))
dis-s2 disaggregated llama3-8b 2 0 $((64 * M)) $((2 * G))
dis-l16 disaggregated llama3-8b 1 16 $((64 * M)) $((2 * G))
dis-small8k disaggregated many-small-moe 2 0 $((64 * M)) $((2 * G))
dis-30b disaggregated qwen3-30b-a3b 1 0 $((64 * M)) $((2 * G))"
# On a 4-GPU machine (SET=four): routing on and off with the daemons' NCCL on sockets,
# and the 2-GPU cases with 2 GPUs per daemon.
four_gpu_cases="rep4-routing replicas4 llama3-8b 4 0 $((64 * M)) $((256 * M)) 1
rep4-norouting replicas4 llama3-8b 4 0 $((64 * M)) $((256 * M)) 0
dis4-8b disaggregated4 llama3-8b 1 0 $((64 * M)) $((2 * G)) 1
col4-8b colocated4 llama3-8b 1 0 $((64 * M)) $((2 * G)) 1"
# SET=next: NCCL's stream at the GPU's highest priority against the same
# run without, and the smaller sizes with the 8-step minimum.
next_cases="dis-8b disaggregated llama3-8b 1 0 $((64 * M)) $((2 * G)) 1
dis-8b-prio disaggregated llama3-8b 1 0 $((64 * M)) $((2 * G)) 1 $((16 * M)) 0 PRIORITY=1
dis-small8k disaggregated many-small-moe 2 0 $((64 * M)) $((2 * G)) 1
dis-small8k-prio disaggregated many-small-moe 2 0 $((64 * M)) $((2 * G)) 1 $((16 * M)) 0 PRIORITY=1
dis-s16 disaggregated llama3-8b 16 0 $((64 * M)) $((2 * G)) 1
dis-s8 disaggregated llama3-8b 8 0 $((64 * M)) $((2 * G)) 1
dis-s2 disaggregated llama3-8b 2 0 $((64 * M)) $((2 * G)) 1"
# The largest refit that fits 2 x H200 (SET=large; also the last default case): Qwen3-30B-A3B, 61 GB
# in bf16, 18,867 tensors, TP=4 on GPU 0 -> TP=2 on GPU 1. Needs 64 GB per GPU and about 190 GB of
# host memory (the stand-in workers keep host copies to check every byte); about 140 s.
large_cases="dis-30b disaggregated qwen3-30b-a3b 1 0 $((64 * M)) $((2 * G)) 1"
[ "${SET:-two}" = large ] && default_cases=$large_cases
[ "${SET:-two}" = four ] && default_cases=$four_gpu_cases
[ "${SET:-two}" = next ] && default_cases=$next_cases
while read -r label mode config scale layers msg staging routing zero_copy register case_env; do
  [ -n "$label" ] || continue
  # BUDGET_S: start no case after this many seconds (the device tool's call limit; what ran is kept).
  if [ -n "${BUDGET_S:-}" ] && [ $SECONDS -gt "$BUDGET_S" ]; then echo "== $label: skipped (BUDGET_S)"; continue; fi
  echo "== $label"
  t0=$(date +%s)
  env ${case_env//,/ } CASE_ENV=${case_env:-} REGISTER=${register:-0} \
    RUN=/tmp/bench-$label ROUTING=${routing:-1} ZERO_COPY=${zero_copy:-$((16 * M))} MODE=$mode CONFIG=tests/configs/$config.json SCALE=$scale LAYERS=$layers MSG=$msg STAGING=$staging \
    BIN=.device/bin bash tests/bench/gpu_refit.sh >"$out/$label.json" 2>"$out/$label.err" || status=1
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); d["label"]=sys.argv[2]; print(json.dumps(d))' \
    "$out/$label.json" "$label" >>"$out/refit.jsonl" 2>/dev/null
  for f in /tmp/bench-$label/daemon*.log; do cp "$f" "$out/$label-$(basename "$f")" 2>/dev/null; done
  tail -c 700 "$out/$label.json"; tail -n 3 "$out/$label.err"; echo " ($(( $(date +%s) - t0 )) s)"
done <<<"${CASES:-$default_cases}"
if [ "${BASELINES:-1}" -eq 1 ]; then
  echo "== baselines"
  python3 tests/bench/baselines.py --config tests/configs/llama3-8b.json --rounds 5 --warmup 2 \
    >"$out/baselines.jsonl" 2>"$out/baselines.err" || status=1
  cat "$out/baselines.jsonl"; tail -n 3 "$out/baselines.err"
fi
ceiling  # again at the end: the ceiling of the same run, before and after
# PACK=1: one tarball instead of many files (the device tool brings back only a few files).
if [ "${PACK:-0}" -eq 1 ]; then
  tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"
fi
exit $status
