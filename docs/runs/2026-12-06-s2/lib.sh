# The steps the calls of this run share, sourced after they set `logs` (where each step's log
# goes), `B` (the bundle's binaries), `T0` and `DEADLINE` (steps past it are skipped).
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  local left=$((DEADLINE - (SECONDS - T0)))
  if [ "$left" -lt 15 ]; then echo "$name skipped (deadline)"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  local t0=$SECONDS
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s: $(tail -n 1 "$logs/$name.log" | cut -c1-250)"
}

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

bench() {  # bench NAME PROG DIR SECONDS FLAGS...
  local name=$1 prog=$2 dir=$3 secs=$4; shift 4
  step "bench_$name" "$secs" "$prog" --src "$dir/t.json" --dst "$dir/i.json" --repeat 15 "$@"
  grep '^{' "$logs/bench_$name.log" 2>/dev/null | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l); d["case"] = sys.argv[1]; print(json.dumps(d))' "$name" >>"$logs/results.jsonl"
}
