#!/usr/bin/env bash
# GPU machine, one call: the colocated refit on one GPU against its ceiling and the
# baseline users run, and bf16 -> fp8 against bf16 -> bf16, from the bundle tests/gpu/cuda_split.sh
# makes (with REFITD_BEFORE: an older refitd to alternate with).
#   there:  OUT=DIR CASES="llama3-8b:1 llama3-8b:4" RUNS="after before" bash tests/gpu/local_path.sh
# Per case CONFIG:SCALE[:DTYPE] (DTYPE: the engines' --dtype, e.g. fp8-block): RUNS of
# tests/gpu/colocated_bench.sh (refit's transfer phase, medians of 6 rounds after 2), with this
# refitd ("after") and the older one ("before"), then tests/bench/local_path_bench.py on the same
# layouts (one device-to-device copy of the same bytes: the ceiling; a per-piece copy_ loop: the
# baseline). Also runs kernels/copy_kernels_test when KERNELS=1, and with IPC_BENCH=1
# tests/bench/ipc_copy_bench on each case's layouts. KERNEL_FLAGS: more local_copy_bench flags
# (--tile-run-bytes, --split); a bundled local_copy_bench-before (an older kernel) runs beside it.
# RUNS may also name "general" (the general copy kernel only) and "unarmed" (--arm-rounds never).
# MPS=1: every process of the call (refitd, the workers, the baseline) a client of one MPS server,
# from a control daemon started here with pipe and log folders of its own and quit at the end
# (one context on the GPU for all: no switch between processes' contexts). One JSON line per
# result in $OUT/local_path/results.jsonl, logs packed into $OUT/local_path.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-out/gpu}
logs=$out/local_path
mkdir -p "$logs"
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
status=0
step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$name rc=$rc $((SECONDS - t0))s: $(tail -n 1 "$logs/$name.log" | cut -c1-300)"
}
{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
  nproc; cat .device/commit.txt 2>/dev/null; } >"$logs/machine.txt" 2>&1
source tests/gpu/mps_lib.sh
if [ "${MPS:-0}" = 1 ] && ! start_mps /tmp/refit-mps >"$logs/mps_start.log" 2>&1; then
  echo "MPS: the control daemon did not start: $(tail -n 2 "$logs/mps_start.log")"
  tar czf "$out/local_path.tgz" -C "$out" local_path
  exit 1
fi
trap stop_mps EXIT
[ "${KERNELS:-0}" = 1 ] && step copy_kernels_test 300 .device/bin/copy_kernels_test --durations yes
mkdir -p /tmp/bin-before
for f in .device/bin/*; do ln -sf "$PWD/$f" /tmp/bin-before/; done
[ -x .device/bin/refitd-before ] && ln -sf "$PWD/.device/bin/refitd-before" /tmp/bin-before/refitd
for case in ${CASES:-llama3-8b:1}; do
  IFS=: read -r model scale dtype <<<"$case"
  tag=$model-s$scale${dtype:+-$dtype}
  for run in ${RUNS:-after}; do
    if [ -n "${BUDGET_S:-}" ] && [ $SECONDS -gt "$BUDGET_S" ]; then echo "$tag $run: skipped (BUDGET_S)"; continue; fi
    [ "$run" = before ] && [ ! -x .device/bin/refitd-before ] && continue
    bin=.device/bin; [ "$run" = before ] && bin=/tmp/bin-before
    # "general": this refitd with the general copy kernel only (the A/B of the aligned one);
    # "unarmed": this refitd never arming rounds (the A/B of DAEMON_FLAGS="--arm-rounds auto").
    flags=${DAEMON_FLAGS:-}; [ "$run" = general ] && flags="$flags --aligned-copy-kernel=false"
    [ "$run" = unarmed ] && flags="$flags --arm-rounds never"
    rm -rf "/tmp/lp-$tag-$run"
    step "refit_${tag}_$run" 240 env BIN="$bin" RUN="/tmp/lp-$tag-$run" CONFIG="tests/configs/$model.json" SCALE="$scale" \
      INFER_DTYPE="${dtype:-}" DAEMON_FLAGS="$flags" bash tests/gpu/colocated_bench.sh
    cp "/tmp/lp-$tag-$run/daemon0.log" "$logs/refit_${tag}_${run}_daemon0.log" 2>/dev/null
    cat /tmp/lp-$tag-$run/*.report >"$logs/refit_${tag}_${run}_reports.txt" 2>/dev/null
    grep '^{' "$logs/refit_${tag}_$run.log" | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l); d.update(case=sys.argv[1], run=sys.argv[2], mps=sys.argv[3] == "1"); print(json.dumps(d))' \
      "$tag" "$run" "${MPS:-0}" >>"$logs/results.jsonl"
  done
  layouts=$(ls -d /tmp/lp-$tag-* 2>/dev/null | head -n 1)
  if [ "${KERNEL_BENCH:-1}" = 1 ] && [ -f "$layouts/t.json" ] && [ -x .device/bin/local_copy_bench ]; then
    for aligned in ${ALIGNED_KERNEL:-1}; do  # ALIGNED_KERNEL="1 0": the aligned kernel against the general one
      for build in after before; do
        prog=.device/bin/local_copy_bench; [ "$build" = before ] && prog=.device/bin/local_copy_bench-before
        [ -x "$prog" ] || continue
        step "kernel_${tag}_aligned${aligned}_$build" 240 "$prog" --src "$layouts/t.json" --dst "$layouts/i.json" \
          --repeat 10 --segments "${SEGMENTS:-16384,65536,262144}" --aligned-kernel "$aligned" ${KERNEL_FLAGS:-}
        grep '^{' "$logs/kernel_${tag}_aligned${aligned}_$build.log" | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l); d.update(case=sys.argv[1], build=sys.argv[2]); print(json.dumps(d))' "$tag" "$build" >>"$logs/results.jsonl"
      done
    done
  fi
  # IPC_BENCH=1: the copy kernel on this case's layouts through memory another process exported
  # (CUDA IPC, the allocation as is and rounded to 2 MiB) against its own, and how soon the host
  # sees GPU work done (tests/bench/ipc_copy_bench).
  if [ "${IPC_BENCH:-0}" = 1 ] && [ -f "$layouts/t.json" ] && [ -x .device/bin/ipc_copy_bench ]; then
    step "ipc_$tag" 240 .device/bin/ipc_copy_bench --sizes-mib 1024 --max-mib 1024 --repeat 7 \
      --src "$layouts/t.json" --dst "$layouts/i.json"
    grep '^{' "$logs/ipc_$tag.log" | python3 -c '
import json, sys
for l in sys.stdin:
    d = json.loads(l); d.update(case=sys.argv[1]); print(json.dumps(d))' "$tag" >>"$logs/results.jsonl"
  fi
  if [ "${BASELINE:-1}" = 1 ] && [ -z "$dtype" ] && [ -f "$layouts/t.json" ]; then
    step "baseline_$tag" 300 python3 tests/bench/local_path_bench.py --source "$layouts/t.json" --destination "$layouts/i.json" \
      --rounds 7 --warmup 2 --label "$tag" --idle-s "${IDLE_S:-0}"
    grep '^{' "$logs/baseline_$tag.log" >>"$logs/results.jsonl"
  fi
done
# The summary: refit's transfer phase against the ceiling and the baseline of the same case.
python3 - "$logs/results.jsonl" <<'PY' | tee "$logs/summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
base = {r["label"]: r for r in rows if r.get("bench") == "local_path"}
for r in rows:
    if r.get("mode") != "colocated-1gpu":
        continue
    b = base.get(r["case"].split("-fp8")[0].split("-mxfp8")[0])
    t = r["median_transfer_s"]
    line = {"case": r["case"], "run": r["run"], "mps": r.get("mps", False), "bytes": r["bytes"], "transfer_ms": round(t * 1e3, 3),
            "data_plane_ms": round(r["median_data_plane_ms"], 3) if r.get("median_data_plane_ms") else None}
    if r.get("median_round_s") is not None:
        line.update(round_ms=round(r["median_round_s"] * 1e3, 3), prepare_ms=round(r["median_prepare_s"] * 1e3, 3))
    if (r.get("transfer_breakdown") or {}).get("node_after_ms") is not None:
        line.update(node_after_ms=r["transfer_breakdown"]["node_after_ms"])
    if b and b["label"] != r["case"]:  # an fp8 case: the bf16 case's copy of 16-bit bytes, for scale only
        line.update(bf16_ceiling_ms=round(b["median_ceiling_s"] * 1e3, 3), bf16_per_piece_ms=round(b["median_per_piece_s"] * 1e3, 3))
    elif b:
        line.update(ceiling_ms=round(b["median_ceiling_s"] * 1e3, 3), per_piece_ms=round(b["median_per_piece_s"] * 1e3, 3),
                    ceiling_bytes=b["bytes"], of_ceiling=round(b["median_ceiling_s"] * r["bytes"] / b["bytes"] / t, 3),
                    vs_per_piece=round(b["median_per_piece_s"] / t, 3),
                    fixed_cost_ms=round((t - b["median_ceiling_s"] * r["bytes"] / b["bytes"]) * 1e3, 3))
    print(json.dumps(line))
PY
echo "status=$status"
stop_mps "$logs/mps_log"
tar czf "$out/local_path.tgz" -C "$out" local_path && cp "$logs/summary.txt" "$out/summary.txt" && rm -rf "$logs"
exit $status
