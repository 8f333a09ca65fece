#!/usr/bin/env bash
# GPU machine, one call (one H200, under 4 minutes): fp8 on the way at the memory limit. First the
# quantizing kernels bit for bit against the host twin (kernels/copy_kernels_test "[fp8]": the
# copy kernel's units and the quantizing kernel's, every finite fp32 through the hardware's e4m3
# conversion), then kernels/local_copy_bench on the colocated refit's layouts (Llama-3-8B, trainer
# FSDP=2 -> engine TP=2, every rank on GPU 0; the sources filled with weight-like bf16 values):
# bf16 -> block fp8 (128 x 128) and bf16 -> MXFP8, each as LaunchCopyItems runs it with
# quantizing = HasQuantizing (auto: block fp8 through the quantizing kernel, both register plans;
# MXFP8's one-row blocks stay in the copy kernel either way) and through the copy kernel alone
# (quantizing 0), beside bf16 -> bf16 and many-small-moe; each line against the
# device-to-device copy of the same run (kernel_vs_memcpy) and the memory bound at its rate
# (of_traffic_bound: bytes read plus bytes written at the copy's rate, over the kernel's time).
#   here:   bash tests/gpu/fp8_speed.sh --bundle     (builds into .device/fp8speed; /.device is ignored)
#   there:  OUT=DIR bash tests/gpu/fp8_speed.sh      (device tool: carry .device/fp8speed)
# JSON lines in $OUT/fp8_speed/results.jsonl (and on stdout), logs packed into $OUT/fp8_speed.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=.device/fp8speed
if [ "${1:-}" = "--bundle" ]; then
  bazel build //kernels:copy_kernels_test //kernels:local_copy_bench //client/tools:refit-layout 2>&1 | grep -E "ERROR|error:" && exit 1
  bin=$(bazel info bazel-bin 2>/dev/null) || exit 1
  ../shared/device/bundle "$dest" "$bin/kernels/copy_kernels_test" "$bin/kernels/local_copy_bench" "$bin/client/tools/refit-layout" || exit 1
  git log -1 --format='%H %s' >"$dest/commit.txt"; git status --short >>"$dest/commit.txt"
  exit 0
fi
for p in copy_kernels_test local_copy_bench refit-layout; do
  [ -x "$dest/bin/$p" ] || { echo "no $dest/bin/$p: run --bundle here first, and carry $dest" >&2; exit 2; }
done
out=${OUT:-out/gpu}
logs=$out/fp8_speed
mkdir -p "$logs"
export LD_LIBRARY_PATH=$PWD/$dest/lib:/usr/local/cuda/lib64
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader; cat "$dest/commit.txt"; } >"$logs/machine.txt" 2>&1
status=0
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$name rc=$rc $((SECONDS - t0))s: $(tail -n 1 "$logs/$name.log" | cut -c1-300)"
}
step fp8_kernels_test 150 "$dest/bin/copy_kernels_test" "[fp8]" --durations yes
layouts() {  # layouts DIR CONFIG [DTYPE]: trainer FSDP=2 and engine TP=2, every rank on GPU 0
  local dir=$1 config=$2 dtype=${3:-}
  mkdir -p "$dir"
  local L=("$dest/bin/refit-layout" --config "tests/configs/$config.json" --scale-down 1)
  "${L[@]}" --side trainer --fsdp 2 --gpus-per-node 2 -o "$dir/t.json" || return 1
  "${L[@]}" --side inference --tp 2 --gpus-per-node 2 ${dtype:+--dtype "$dtype"} -o "$dir/i.json" || return 1
  for f in "$dir/t.json" "$dir/i.json"; do
    python3 -c 'import json,sys; l=json.load(open(sys.argv[1])); [w.update(node=0, gpu=0) for w in l["workers"]]; json.dump(l, open(sys.argv[1], "w"))' "$f" || return 1
  done
}
bench() {  # bench CASE CONFIG DTYPE SECONDS FLAGS...
  local name=$1 config=$2 dtype=$3 secs=$4; shift 4
  local dir=/tmp/fp8speed-$name
  if ! layouts "$dir" "$config" "$dtype" >"$logs/layout_$name.log" 2>&1; then
    echo "$name: layouts failed: $(tail -n 2 "$logs/layout_$name.log")"; status=1; return
  fi
  step "bench_$name" "$secs" "$dest/bin/local_copy_bench" --src "$dir/t.json" --dst "$dir/i.json" --repeat 10 "$@"
  grep '^{' "$logs/bench_$name.log" | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l); d["case"] = sys.argv[1]; print(json.dumps(d))' "$name" | tee -a "$logs/results.jsonl"
}
bench llama3-8b-fp8-block llama3-8b fp8-block 60 --quantizing auto,0 --quant-min-blocks 2,3
bench llama3-8b-mxfp8 llama3-8b mxfp8 60 --quantizing auto,0 --quant-min-blocks 2,3
bench llama3-8b-bf16 llama3-8b "" 30
bench many-small-moe many-small-moe "" 40
echo "status=$status"
tar czf "$out/fp8_speed.tgz" -C "$out" fp8_speed
exit $status
