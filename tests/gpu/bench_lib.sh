# Steps that GPU runs of the copy kernels share (sourced by a run's script, from the bundle's tree
# on the GPU machine). The script sets `logs` (where each step's log goes), `B` (the bundle's
# binaries), `T0` and `DEADLINE` (seconds after T0 past which steps are skipped, so that the logs
# can still be packed inside the call's limit). Every result is one JSON line in
# $logs/results.jsonl with the step's name as "case"; `summary` prints them as a table.

step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  local left=$((DEADLINE - (SECONDS - T0)))
  if [ "$left" -lt 15 ]; then echo "$name skipped (deadline)"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  local t0=$SECONDS
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s: $(tail -n 1 "$logs/$name.log" | cut -c1-250)"
}

# The JSON lines of step NAME's log into results.jsonl, tagged with the step's name.
collect() {  # collect NAME
  grep '^{' "$logs/$1.log" 2>/dev/null | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l); d["case"] = sys.argv[1]; print(json.dumps(d))' "$1" >>"$logs/results.jsonl"
}

# Colocated layouts on GPU 0: a trainer FSDP=2 and an engine TP=2 of a tests/configs model.
layouts() {  # layouts DIR CONFIG [DTYPE]
  local dir=$1 config=$2 dtype=${3:-}
  mkdir -p "$dir"
  local L=("$B/refit-layout" --config "tests/configs/$config.json" --scale-down 1)
  "${L[@]}" --side trainer --fsdp 2 --gpus-per-node 2 -o "$dir/t.json" || return 1
  "${L[@]}" --side inference --tp 2 --gpus-per-node 2 ${dtype:+--dtype "$dtype"} -o "$dir/i.json" || return 1
  for f in "$dir/t.json" "$dir/i.json"; do
    python3 -c 'import json,sys; l=json.load(open(sys.argv[1])); [w.update(node=0, gpu=0) for w in l["workers"]]; json.dump(l, open(sys.argv[1], "w"))' "$f" || return 1
  done
}

# local_copy_bench (or a build of it) on layouts DIR: medians of 15 after its warm-ups.
bench() {  # bench NAME PROG DIR SECONDS FLAGS...
  local name=$1 prog=$2 dir=$3 secs=$4; shift 4
  step "bench_$name" "$secs" "$prog" --src "$dir/t.json" --dst "$dir/i.json" --repeat 15 "$@"
  collect "bench_$name"
}

# refitd's colocated refit of a model (tests/gpu/colocated_bench.sh, every round byte-checked)
# with the programs in BIN.
refit() {  # refit NAME BIN CONFIG [DTYPE]
  local name=$1 bin=$2 model=$3 dtype=${4:-}
  rm -rf "/tmp/lp-$name"
  step "refit_$name" 120 env BIN="$bin" RUN="/tmp/lp-$name" CONFIG="tests/configs/$model.json" SCALE=1 \
    INFER_DTYPE="$dtype" bash tests/gpu/colocated_bench.sh
  cp "/tmp/lp-$name/daemon0.log" "$logs/refit_${name}_daemon0.log" 2>/dev/null
  collect "refit_$name"
}

# Local-memory instructions (spills, stack) per function of a program's SASS, and its SASS packed.
sass_locals() {  # sass_locals NAME PROG
  command -v cuobjdump >/dev/null || { echo "sass_locals: no cuobjdump"; return; }
  cuobjdump -sass "$2" >"$logs/sass_$1.txt" 2>&1
  awk '/Function :/ {f = $3} /[^A-Z](LDL|STL)/ {n[f]++} END {for (k in n) print n[k], k}' \
    "$logs/sass_$1.txt" | sort -rn >"$logs/sass_$1_locals.txt"
  gzip -f "$logs/sass_$1.txt"
}

summary() {
  python3 - "$logs/results.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if d.get("bench") == "local_copy_kernel":
        print(d["case"], d.get("fill"), "plain", d.get("plain"), "units", d["units"], "k", d["kernel_ms"],
              "d2d", d["memcpy_d2d_ms"], "bound", d["traffic_bound_ms"], "ofb", d["of_traffic_bound"],
              "vs_d2d", d["kernel_vs_memcpy"])
    elif d.get("mode") == "colocated-1gpu":
        print(d["case"], "transfer_ms", round(d["median_transfer_s"] * 1e3, 3), "data_plane_ms",
              d.get("median_data_plane_ms"), "all", d["transfer_s"])
PY
}
