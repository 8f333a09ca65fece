#!/usr/bin/env bash
# refit-layout and refit-plan on the MoE families as a user runs them: DeepSeek-V2(-Lite),
# DeepSeek-V3 (as shipped, fp8), Kimi-K2 and Mixtral, each a small pair planned and verified; an
# fp8 checkpoint's engine layout is fp8 by default; configs whose tensors the tools cannot know are
# refused in one line naming the field, exit code 2.
set -uo pipefail
layout=client/tools/refit-layout
plan=client/tools/refit-plan
configs=tests/configs
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# plan_pair NAME CONFIG "TRAINER FLAGS" "ENGINE FLAGS": both layouts, then a verified plan.
plan_pair() {
  local name=$1 config=$2 trainer=$3 engine=$4
  # shellcheck disable=SC2086
  $layout --config "$config" --side trainer $trainer -o "$tmp/$name-src.json" || fail "$name: trainer layout"
  # shellcheck disable=SC2086
  $layout --config "$config" --side inference --first-node 1 $engine -o "$tmp/$name-dst.json" ||
    fail "$name: engine layout"
  local out
  out=$($plan --src "$tmp/$name-src.json" --dst "$tmp/$name-dst.json" --verify --json) || fail "$name: refit-plan: $out"
  echo "$out" | grep -q '"verified":true' || fail "$name: not verified: $out"
  echo "$name: planned and verified"
}

plan_pair v2-lite-megatron $configs/deepseek-v2-lite.json "--scale-down 16 --layers 3 --tp 2 --ep 2 --dp 2" \
  "--scale-down 16 --layers 3 --tp 2 --dp 2"
plan_pair v2-fsdp2-ep $configs/deepseek-v2.json "--scale-down 64 --layers 2 --fsdp2 4" \
  "--scale-down 64 --layers 2 --tp 2 --dp 2 --expert-parallel"
plan_pair kimi-fsdp1 $configs/kimi-k2.json "--scale-down 64 --layers 2 --fsdp 4" \
  "--scale-down 64 --layers 2 --tp 4"
plan_pair mixtral-megatron $configs/mixtral-8x7b.json "--scale-down 64 --layers 2 --tp 2 --ep 2 --dp 2" \
  "--scale-down 64 --layers 2 --tp 2 --dp 2"
plan_pair mixtral-fsdp2-ep $configs/mixtral-8x7b.json "--scale-down 64 --layers 2 --fsdp2 2" \
  "--scale-down 64 --layers 2 --tp 1 --dp 2 --expert-parallel"
# DeepSeek-V3 as shipped (quantization_config fp8, 128x128 blocks): the engine is fp8 by default.
# Planned scaled down by 64 with 8x8 blocks (the scaled widths are not whole 128-row blocks, which
# vLLM would refuse); the full-width layout of its first 4 layers is checked below.
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["quantization_config"]["weight_block_size"] = [8, 8]; json.dump(c, open(sys.argv[2], "w"))' \
  $configs/deepseek-v3-fp8.json "$tmp/v3-fp8-8x8.json"
plan_pair v3-fp8 "$tmp/v3-fp8-8x8.json" "--layers 4 --scale-down 64 --tp 1 --ep 2 --dp 2" \
  "--layers 4 --scale-down 64 --tp 1 --dp 2 --expert-parallel"
$layout --config $configs/deepseek-v3-fp8.json --side inference --layers 4 --tp 8 -o "$tmp/v3-full.json" ||
  fail "shipped DeepSeek-V3, full width, TP8"

# dtypes_of FILE: the sorted set of tensor dtypes of a layout, and its scale tensors' count.
dtypes_of() {
  python3 - "$1" <<'PY'
import json, sys
l = json.load(open(sys.argv[1]))
t = l["tensors"]
print(",".join(sorted({x["dtype"] for x in t})), sum(x["name"].endswith("weight_scale_inv") for x in t))
PY
}
for f in v3-fp8-dst v3-full; do
  read -r dtypes scales < <(dtypes_of "$tmp/$f.json")
  [ "$dtypes" = "bf16,fp32,fp8_e4m3" ] || fail "$f: dtypes $dtypes, expected fp8 weights"
  [ "$scales" -gt 0 ] || fail "$f: no weight_scale_inv tensors"
  grep -q '"model.layers.3.mlp.experts.0.down_proj.weight_scale_inv"' "$tmp/$f.json" ||
    fail "$f: no expert weight_scale_inv named as DeepSeek-V3 ships it"
done
grep -q '"block": *\[128, *128\]' "$tmp/v3-full.json" || fail "the shipped config's 128x128 blocks are not used"
read -r dtypes scales < <(dtypes_of "$tmp/v3-fp8-src.json")
[ "$scales" -eq 0 ] || fail "the trainer side of an fp8 config holds no scales ($dtypes)"
# --dtype bf16 overrides the quantization_config.
$layout --config $configs/deepseek-v3-fp8.json --side inference --layers 4 --tp 8 --dtype bf16 \
  -o "$tmp/v3-bf16.json" || fail "--dtype bf16"
read -r dtypes scales < <(dtypes_of "$tmp/v3-bf16.json")
[ "$scales" -eq 0 ] && [ "$dtypes" = "bf16,fp32" ] || fail "--dtype bf16 still quantizes: $dtypes, $scales scales"
# Without a quantization_config the engine keeps the weights' dtype.
read -r dtypes scales < <(dtypes_of "$tmp/v2-lite-megatron-dst.json")
[ "$dtypes" = "bf16" ] && [ "$scales" -eq 0 ] || fail "DeepSeek-V2-Lite engine: $dtypes, $scales scales"

expect_2() {  # expect exit code 2 and exactly one line on stderr that contains $1
  local want=$1; shift
  "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  [ $rc -eq 2 ] || fail "exit $rc, not 2, for: $* ($(cat "$tmp/err"))"
  [ "$(wc -l <"$tmp/err")" -eq 1 ] || fail "more than one line for: $*: $(cat "$tmp/err")"
  grep -q -- "$want" "$tmp/err" || fail "stderr lacks '$want': $(cat "$tmp/err")"
}
# without FIELD CONFIG OUT: CONFIG less FIELD.
without() {
  python3 -c 'import json, sys; c = json.load(open(sys.argv[2])); del c[sys.argv[1]]; json.dump(c, open(sys.argv[3], "w"))' \
    "$1" "$2" "$3"
}
without n_routed_experts $configs/deepseek-v3.json "$tmp/no-experts.json"
expect_2 'needs "n_routed_experts"' $layout --config "$tmp/no-experts.json" --side inference
without num_local_experts $configs/mixtral-8x7b.json "$tmp/no-local-experts.json"
expect_2 'needs "num_local_experts"' $layout --config "$tmp/no-local-experts.json" --side trainer --tp 2
without q_lora_rank $configs/deepseek-v2-lite.json "$tmp/no-q-lora.json"
expect_2 'needs "q_lora_rank"' $layout --config "$tmp/no-q-lora.json" --side inference
sed 's/"model_type": "deepseek_v3"/"model_type": "deepseek_v32"/' $configs/deepseek-v3.json >"$tmp/v32.json"
expect_2 'model_type "deepseek_v32" is not supported' $layout --config "$tmp/v32.json" --side inference
sed 's/"quant_method": "fp8"/"quant_method": "compressed-tensors"/' $configs/deepseek-v3-fp8.json >"$tmp/ct.json"
expect_2 'quantization_config.quant_method "compressed-tensors"' $layout --config "$tmp/ct.json" --side inference
echo "refit-layout families: OK"
