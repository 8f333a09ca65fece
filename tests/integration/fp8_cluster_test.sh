#!/usr/bin/env bash
# fp8 engines through real daemons: 3 daemons on loopback (trainer nodes 0-1, engine
# node 2, host backend), two model groups whose engines are quantized on the way:
#   policy  Llama-3-8B structure, FSDP1 over 4 ranks (flat ranges: blocks cut between ranks are
#           gathered into the engine daemon's scratch) -> vLLM TP2, block fp8 32x32;
#   reward  Qwen3-30B-A3B structure (stacked experts), Megatron TP2 -> vLLM TP2 with expert
#           parallelism, MXFP8.
# Every round carries new values; every engine element (codes and scales) is compared with the
# CPU reference quantizing each weight whole (sim-worker --peer-layout), and the plan summary must
# show the conversion (fewer bytes than at bf16) and, for FSDP, the gathering.
set -uo pipefail
BIN=$(mktemp -d)
for p in daemon/refitd client/tools/refitctl client/tools/refit-layout client/tools/refit-plan tests/workers/sim-worker; do
  ln -s "$PWD/$p" "$BIN/"
done
RUN=$(mktemp -d)
source tools/cluster_lib.sh
trap 'stop_all; rm -rf "$BIN"' EXIT
fail() { echo "FAIL: $*"; for f in "$RUN"/daemon*.log; do echo "== $f"; tail -n 15 "$f"; done; exit 1; }

# The engines' block size comes from the config's quantization_config, as for DeepSeek-V3.
python3 - "$RUN/llama-fp8.json" <<'PY' || fail "config"
import json, sys
c = json.load(open("tests/configs/llama3-8b.json"))
c["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32], "modules_to_not_convert": ["lm_head"]}
json.dump(c, open(sys.argv[1], "w"))
PY
L="$BIN/refit-layout"
$L --config "$RUN/llama-fp8.json" --scale-down 16 --layers 2 --side trainer --fsdp 4 --gpus-per-node 2 -o "$RUN/policy-t.json" || fail layout
$L --config "$RUN/llama-fp8.json" --scale-down 16 --layers 2 --side inference --tp 2 --gpus-per-node 2 --first-node 2 \
  --dtype fp8-block -o "$RUN/policy-i.json" || fail "fp8 layout"
$L --config tests/configs/qwen3-30b-a3b.json --scale-down 16 --layers 1 --side trainer --tp 2 --gpus-per-node 2 -o "$RUN/reward-t.json" || fail layout
$L --config tests/configs/qwen3-30b-a3b.json --scale-down 16 --layers 1 --side inference --tp 2 --gpus-per-node 2 --first-node 2 \
  --expert-parallel --dtype mxfp8 -o "$RUN/reward-i.json" || fail "mxfp8 layout"
python3 - "$RUN" <<'PY' || fail "the engine layouts do not declare fp8 weights and their scales"
import json, sys
for group, fmt, suffix in (("policy", "block_fp8", "_scale_inv"), ("reward", "mxfp8", "_scale")):
    l = json.load(open(f"{sys.argv[1]}/{group}-i.json"))
    names = {t["name"]: t for t in l["tensors"]}
    q = [t for t in l["tensors"] if t.get("quantization")]
    assert q, group
    for t in q:
        assert t["dtype"] == "fp8_e4m3" and t["quantization"]["format"] == fmt, t
        assert t["quantization"]["scale"] == t["name"] + suffix and t["name"] + suffix in names, t
    for keep in ("model.embed_tokens.weight", "model.norm.weight"):
        assert not names[keep].get("quantization") and names[keep]["dtype"] == "bf16", keep
PY
# The plans, on their own: fewer bytes travel than at bf16; FSDP's cut blocks are gathered.
"$BIN/refit-plan" --src "$RUN/policy-t.json" --dst "$RUN/policy-i.json" --verify >"$RUN/policy-plan.out" 2>&1 || fail "policy plan: $(cat "$RUN/policy-plan.out")"
cat "$RUN/policy-plan.out"
grep -q "^converted: .* gathered for blocks cut between sources [1-9]" "$RUN/policy-plan.out" || fail "policy plan gathers nothing"
"$BIN/refit-plan" --src "$RUN/reward-t.json" --dst "$RUN/reward-i.json" --verify >"$RUN/reward-plan.out" 2>&1 || fail "reward plan: $(cat "$RUN/reward-plan.out")"
grep -q "^converted: " "$RUN/reward-plan.out" || fail "reward plan converts nothing"

for n in 0 1 2; do start_daemon "$n" --prepare-timeout 5 --transfer-timeout 20 --commit-timeout 5 || fail "daemon $n"; done
STARTED=()
start_side() {  # GROUP ROLE LAYOUT PEER_LAYOUT
  local group=$1 role=$2 layout=$3 peer=$4
  while read -r name node; do
    start_worker "$group-$name" "$node" "$group" "$role" "$layout" "$name" --peer-layout "$peer"
    STARTED+=("$group-$name")
  done < <(workers_of "$layout")
}
start_side policy trainer "$RUN/policy-t.json" "$RUN/policy-i.json"
start_side policy inference "$RUN/policy-i.json" "$RUN/policy-t.json"
start_side reward trainer "$RUN/reward-t.json" "$RUN/reward-i.json"
start_side reward inference "$RUN/reward-i.json" "$RUN/reward-t.json"
wait_registered "${STARTED[@]}" || fail "registration"
for g in policy reward; do
  for _ in $(seq 100); do ctl status | grep -Eq "^$g .*yes" && break; sleep 0.1; done
done

every_engine_ok() {  # GROUP VERSION
  local n=0
  for r in "$RUN/$1"-vllm-*.report; do
    grep -q "^commit $2 ok [1-9][0-9]* elements" "$r" || fail "$(basename "$r") did not verify version $2: $(tail -n 2 "$r")"
    n=$((n + 1))
  done
  [ "$n" -eq 2 ] || fail "expected 2 engine workers in $1, found $n"
}
for v in 1 2 3; do
  for g in policy reward; do
    ctl refit "$g" "$v" >"$RUN/$g-$v.out" 2>&1 || fail "$g round $v: $(cat "$RUN/$g-$v.out")"
    grep committed "$RUN/$g-$v.out"
    every_engine_ok "$g" "$v"
  done
done
echo "PASS: fp8 engines quantized on the way, checked against the CPU reference every round"
