#!/usr/bin/env bash
# refit-layout and refit-plan as a user runs them: real configs in, JSON summary out, bad input
# (and, for refit-layout, a parallelism or model no framework runs) gets one line and exit code 2.
set -uo pipefail
layout=client/tools/refit-layout
plan=client/tools/refit-plan
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

$layout --config tests/configs/qwen3-30b-a3b.json --scale-down 16 --layers 2 --side trainer \
  --tp 2 --ep 2 --dp 2 -o "$tmp/src.json" || fail "refit-layout trainer"
$layout --config tests/configs/qwen3-30b-a3b.json --scale-down 16 --layers 2 --side inference \
  --tp 4 --first-node 1 -o "$tmp/dst.json" || fail "refit-layout inference"
out=$($plan --src "$tmp/src.json" --dst "$tmp/dst.json" --verify --json) || fail "refit-plan: $out"
for key in tensors pieces transfers messages bytes_total bytes_network bytes_nvlink bytes_local \
           max_nic_bytes predicted_seconds lower_bound_seconds planning_seconds; do
  echo "$out" | grep -q "\"$key\":" || fail "missing $key in $out"
done
echo "$out" | grep -q '"verified":true' || fail "not verified: $out"
echo "$out" | grep -q '"bytes_network":0,' && fail "expected network bytes: $out"
human=$($plan --src "$tmp/src.json" --dst "$tmp/dst.json" --verify) || fail "human summary"
echo "$human" | grep -q "^verified:" || fail "human summary lacks verification: $human"

expect_2() {  # expect exit code 2 and exactly one line on stderr that contains $1
  local want=$1; shift
  "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  [ $rc -eq 2 ] || fail "exit $rc, not 2, for: $* ($(cat "$tmp/err"))"
  [ "$(wc -l <"$tmp/err")" -eq 1 ] || fail "more than one line for: $*: $(cat "$tmp/err")"
  grep -q -- "$want" "$tmp/err" || fail "stderr lacks '$want': $(cat "$tmp/err")"
}
expect_2 "cannot open" $plan --src "$tmp/none.json" --dst "$tmp/dst.json"
echo '{"tensors": [' >"$tmp/broken.json"
expect_2 "not a layout" $plan --src "$tmp/broken.json" --dst "$tmp/dst.json"
# A destination that needs what no source holds: drop the trainer's last worker.
python3 - "$tmp/src.json" "$tmp/partial.json" <<'PY'
import json, sys
layout = json.load(open(sys.argv[1]))
layout["workers"] = layout["workers"][:-1]
json.dump(layout, open(sys.argv[2], "w"))
PY
expect_2 "have no source" $plan --src "$tmp/partial.json" --dst "$tmp/dst.json"
expect_2 "unknown flag" $plan --src "$tmp/src.json" --dst "$tmp/dst.json" --frobnicate
expect_2 "required" $plan --src "$tmp/src.json"
expect_2 "divide num_key_value_heads" $layout --config tests/configs/llama3-8b.json --side trainer --tp 16

# refit-layout refuses what no framework runs, in one line, with exit code 2.
llama=tests/configs/llama3-8b.json
expect_2 "vLLM needs tp (3) to divide num_attention_heads (32)" $layout --config $llama --side inference --tp 3
expect_2 "Megatron needs tp (3) to divide num_attention_heads (32)" $layout --config $llama --side trainer --tp 3
expect_2 "vLLM needs tp (7) and num_key_value_heads (4) to divide one another" \
  $layout --config tests/configs/qwen2.5-7b.json --side inference --tp 7
expect_2 "vLLM needs tp (16) to divide moe_intermediate_size (24)" \
  $layout --config tests/configs/qwen3-30b-a3b.json --scale-down 32 --side inference --tp 16
# Without --expert-parallel vLLM splits the experts' width over all dp * tp ranks.
expect_2 "vLLM needs dp \* tp (32) to divide moe_intermediate_size (48)" \
  $layout --config tests/configs/qwen3-30b-a3b.json --scale-down 16 --side inference --tp 4 --dp 8
expect_2 "\-\-pp is a trainer flag.*--expert-parallel" $layout --config $llama --side inference --tp 2 --pp 2
expect_2 "\-\-ep is a trainer flag.*--expert-parallel" $layout --config $llama --side inference --ep=2
expect_2 "\-\-cp is a trainer flag" $layout --config $llama --side inference --cp 2
expect_2 "\-\-fsdp2 is a trainer flag" $layout --config $llama --side inference --fsdp2 4
expect_2 "\-\-expert-parallel is an inference flag" $layout --config $llama --side trainer --expert-parallel
expect_2 "\-\-tp is a Megatron flag" $layout --config $llama --side trainer --fsdp 4 --tp 2
expect_2 "\-\-fsdp-use-orig-params is an FSDP1 flag" $layout --config $llama --side trainer --fsdp2 4 --fsdp-use-orig-params
for type in gpt_oss gemma2 gemma3 made_up; do
  sed "s/\"model_type\": \"llama\"/\"model_type\": \"$type\"/" $llama >"$tmp/$type.json"
  expect_2 "model_type \"$type\" is not supported.*supported: llama, qwen2" \
    $layout --config "$tmp/$type.json" --side trainer
done

# FSDP1 (use_orig_params), FSDP2 and HSDP trainers, planned and verified against vLLM engines.
for trainer in "--fsdp 4 --fsdp-use-orig-params --fsdp-param-dtype bf16" "--fsdp2 6" "--fsdp2 3 --dp 2"; do
  $layout --config tests/configs/qwen3-30b-a3b.json --scale-down 16 --layers 2 --side trainer $trainer \
    -o "$tmp/fsdp.json" || fail "refit-layout $trainer"
  out=$($plan --src "$tmp/fsdp.json" --dst "$tmp/dst.json" --verify --json) || fail "refit-plan $trainer: $out"
  echo "$out" | grep -q '"verified":true' || fail "not verified ($trainer): $out"
done
# DeepSeek-V3: vLLM TP2 DP2 without expert parallelism (experts' rows over the 4 ranks, shared
# experts over each replica's 2) holds gate.e_score_correction_bias in fp32, as Megatron does; an
# FSDP2 trainer (transformers 4.x) holds it in bf16. Both pairs plan and verify.
ds=tests/configs/deepseek-v3.json
$layout --config $ds --scale-down 64 --layers 4 --side inference --tp 2 --dp 2 --first-node 1 \
  -o "$tmp/ds-i.json" || fail "refit-layout DeepSeek-V3 inference"
$layout --config $ds --scale-down 64 --layers 4 --side trainer --tp 2 --ep 2 --dp 2 -o "$tmp/ds-m.json" ||
  fail "refit-layout DeepSeek-V3 Megatron"
$layout --config $ds --scale-down 64 --layers 4 --side trainer --fsdp2 4 -o "$tmp/ds-f.json" ||
  fail "refit-layout DeepSeek-V3 FSDP2"
python3 - "$tmp" <<'PY' || fail "DeepSeek-V3 layouts"
import json, sys
d = sys.argv[1]
def load(n): return json.load(open(f"{d}/{n}.json"))
bias = "model.layers.3.mlp.gate.e_score_correction_bias"
for name, want in (("ds-i", "fp32"), ("ds-m", "fp32"), ("ds-f", "bf16")):
    l = load(name)
    got = {t["name"]: t["dtype"] for t in l["tensors"]}
    assert got[bias] == want and got["model.layers.3.mlp.gate.weight"] == "bf16", (name, got[bias])
w = {w["name"]: w for w in load("ds-i")["workers"]}["vllm-dp1-tp0"]
b = {b["name"]: b for b in w["buffers"]}
assert b[bias]["dtype"] == "fp32", b[bias]
assert b["model.layers.3.mlp.experts.w13_weight"]["shape"] == [256, 2 * 32 // 4, 112], \
    b["model.layers.3.mlp.experts.w13_weight"]["shape"]
assert b["model.layers.3.mlp.shared_experts.gate_up_proj.weight"]["shape"] == [2 * 32 // 2, 112]
PY
for src in ds-m ds-f; do
  out=$($plan --src "$tmp/$src.json" --dst "$tmp/ds-i.json" --verify --json) || fail "refit-plan $src: $out"
  echo "$out" | grep -q '"verified":true' || fail "not verified ($src): $out"
done
echo "all refit-plan CLI checks passed"
