#!/usr/bin/env bash
# decode_small_sweep.sh — the small-batch decode variants on one H200, from a built tree:
# targets.md's graph-of-20 decode table (bench_gpu_decode's G20_B* cases: softplus gate, B random
# slots of a pool of 2B, the same slots in every call) for B = 1, 8, 32, 256 and 1024, timed for the
# library's choice and for each variant (kernel, warp-kernel rows, L2 policy, PDL off), then the
# decode GPU tests. Every timed run is checked against the fp64 reference first. A table of
# microseconds per call (TB/s for B >= 32) comes last; under 3 minutes on an H200.
#
#   dev/decode_small_sweep.sh BUILD      BUILD/bench/bench_gpu_decode and BUILD/tests/kda_gpu_tests
#
# Env: OUT (logs and CSVs; default ./gpu_out), SWEEP_SMALL (+ SWEEP_SMALL_MORE) / SWEEP_LARGE (the
# --kernels lists of the B <= 32 and B >= 256 runs), SWEEP_TESTS=0 (skip the tests), SWEEP_ITERS
# (default 50).
# Exits non-zero if a check or a test fails.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${1:?usage: dev/decode_small_sweep.sh BUILD}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
bench=$B/bench/bench_gpu_decode
tests=$B/tests/kda_gpu_tests
[ -x "$bench" ] || { echo "decode_small_sweep: $bench not found"; exit 2; }
iters=${SWEEP_ITERS:-50}
small=${SWEEP_SMALL:-bulklat,staged,warp:rows=4,warp:rows=8,warp:rows=16,warp:cache=stream}
small=$small,${SWEEP_SMALL_MORE:-warp:cache=normal,auto:pdl=0,bulklat:pdl=0}
large=${SWEEP_LARGE:-warp:rows=16,warp:rows=8,auto:pdl=0}
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader 2>/dev/null

run_bench() {  # name filter kernels
  local t0=$(date +%s) rc
  timeout 100 "$bench" --filter "$2" --iters "$iters" --kernels "$3" --csv "$OUT/sweep_$1.csv" \
    >"$OUT/sweep_$1.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "== bench $1 ($2) rc=$rc ($(( $(date +%s) - t0 )) s)"
}
run_bench small 'G20_B1$,G20_B8$,G20_B32$' "$small"
run_bench large 'G20_B256$,G20_B1024$,copy' "$large"
grep -hE "FAILED|failed" "$OUT/sweep_small.log" "$OUT/sweep_large.log" | head -10
grep -h "ceiling" "$OUT/sweep_large.log"

if [ "${SWEEP_TESTS:-1}" != 0 ]; then
  if [ -x "$tests" ]; then
    t0=$(date +%s)
    timeout 120 "$tests" --gtest_brief=1 --gtest_filter='*GpuDecode*' >"$OUT/sweep_tests.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || status=1
    grep -E "^\[  FAILED|Failure" "$OUT/sweep_tests.log" | head -20
    summary=$(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test|tests? ran' "$OUT/sweep_tests.log")
    echo "== decode GPU tests rc=$rc ($(( $(date +%s) - t0 )) s): $(echo "$summary" | tr '\n' ' ')"
  else
    echo "== decode GPU tests: $tests not found"; status=1
  fi
fi

# The table: one row per kernel setting, one column per batch (us per call; TB/s from B = 32).
python3 - "$OUT/sweep_small.csv" "$OUT/sweep_large.csv" <<'PY'
import csv, os, sys
cols = ["G20_B1", "G20_B8", "G20_B32", "G20_B256", "G20_B1024"]
cells, order = {}, []
for path in sys.argv[1:]:
    if not os.path.exists(path):
        continue
    for r in csv.DictReader(open(path)):
        k = r["kernel"]
        if k not in order:
            order.append(k)
        us, tbps = float(r["median_us"]), float(r["effective_TBps"])
        mark = {"meets": "", "below": "-", "above": "-"}.get(r["verdict"], "")
        bad = "" if r["check"] == "ok" else " FAIL"
        text = f"{us:.2f}" if r["case"] in ("G20_B1", "G20_B8") else f"{us:.1f}/{tbps:.2f}"
        cells[(k, r["case"])] = text + mark + bad
print("\nus per call (B >= 32: us / TB/s); '-' misses the targets.md bar "
      "(B1 <= 3.0 us, B8 <= 8.0 us, B32 >= 3.8, B256 and B1024 >= 4.0 TB/s)")
print(f"{'kernel':28s}" + "".join(f"{c[4:]:>15s}" for c in cols))
for k in order:
    print(f"{k:28s}" + "".join(f"{cells.get((k, c), ''):>15s}" for c in cols))
PY
exit $status
