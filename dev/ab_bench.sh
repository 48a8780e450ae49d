#!/usr/bin/env bash
# A/B timing of prefill builds on one GPU machine: builds the benchmark (and the GPU tests) of each
# tree in parallel, then times them interleaved, ROUNDS times, so that clock drift hits all alike.
#   dev/snapshot_head.sh; dev/snapshot_head.sh <ref> .deps/exp
#   then, on the GPU machine (with .deps/): dev/ab_bench.sh .deps/head .deps/exp
# Round 1 checks against the reference, later rounds only time; a table of the medians over the
# rounds (and their ratios to the first tree) comes last. Env: ROUNDS (default 2), BENCH_ARGS
# (extra bench_gpu_prefill arguments), AB_ENV (space-separated VAR=value list applied to every
# timing); AB_TESTS, AB_PROFILE, AB_NCU: see the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"; rm -f "$OUT/ab_medians.tsv"
export PATH="$PATH:/usr/local/cuda/bin"
root=$PWD
trees=("$@")
jobs=$(( $(nproc) / ${#trees[@]} )); [ $jobs -lt 1 ] && jobs=1
for t in "${trees[@]}"; do
  # AB_PREBUILT=1: trees whose build-gpu was built beforehand (dev/prebuild.sh, on a CPU machine)
  # are used as they are, so that no GPU time is spent compiling.
  [ "${AB_PREBUILT:-0}" = 1 ] && [ -x "$t/build-gpu/bench/bench_gpu_prefill" ] && continue
  ( cd "$t" && n=$(basename "$t") &&
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$root/.deps/gtest" >"$OUT/build_$n.log" 2>&1 &&
    cmake --build build-gpu --parallel $jobs --target bench_gpu_prefill kda_gpu_tests >>"$OUT/build_$n.log" 2>&1 ||
    { echo "build $t FAILED"; tail -30 "$OUT/build_$n.log"; } ) &
done
wait
# AB_VARIANTS: space-separated settings, each VAR=value or several joined by commas
# (VAR=a,VAR2=b); every tree is then timed once per setting (e.g. a launch knob's sweep within one
# build).
read -ra variants <<<"${AB_VARIANTS:-}"; [ ${#variants[@]} -eq 0 ] && variants=("")
for r in $(seq 1 "${ROUNDS:-2}"); do
  for t in "${trees[@]}"; do
    for var in "${variants[@]}"; do
      n=$(basename "$t")
      extra=(); [ "$r" -gt 1 ] && extra=(--no-check)  # errors from round 1
      env ${AB_ENV:-} ${var//,/ } timeout 120 "$t/build-gpu/bench/bench_gpu_prefill" ${BENCH_ARGS:-} "${extra[@]}" >"$OUT/round.log" 2>&1
      echo "---- $n ${var:+$var }round $r (rc=$?)"; grep -E "^[PS][0-9]" "$OUT/round.log"
      # case and median ms per run, for the table at the end (columns: tree, setting)
      awk -v col="$n${var:+ $var}" '/^[PS][0-9]/ {for (i = 2; i <= NF; ++i) if ($i ~ /^[0-9]+\.[0-9]+$/ && $(i+1) ~ /^[0-9]+\.[0-9]+$/) {print col "\t" $1 "\t" $i; break}}' "$OUT/round.log" >>"$OUT/ab_medians.tsv"
      cat "$OUT/round.log" >>"$OUT/bench_$n.log"; rm -f "$OUT/round.log"  # one log per tree, few files in $OUT
    done
  done
done
# Table: per case, each tree / setting's median over the rounds (ms) and its ratio to the first column.
if [ -s "$OUT/ab_medians.tsv" ]; then
  echo "---- medians over rounds (ms; ratio to the first column)"
  python3 - "$OUT/ab_medians.tsv" <<'PY'
import collections, statistics, sys
runs = collections.OrderedDict()
for line in open(sys.argv[1]):
    col, case, ms = line.rstrip("\n").split("\t")
    runs.setdefault(col, collections.defaultdict(list))[case].append(float(ms))
cols = list(runs)
cases = sorted({c for r in runs.values() for c in r})
print("case  " + "  ".join(f"{c[:24]:>24}" for c in cols))
for case in cases:
    base = statistics.median(runs[cols[0]][case]) if runs[cols[0]].get(case) else None
    cells = []
    for c in cols:
        v = runs[c].get(case)
        if not v: cells.append(f"{'-':>24}"); continue
        m = statistics.median(v)
        cells.append(f"{m:>14.3f} ({m / base:5.3f})" if base else f"{m:>24.3f}")
    print(f"{case:5} " + "  ".join(cells))
PY
fi
# The last tree (the candidate) only: its prefill GPU tests (AB_TESTS=1; value splits AB_TEST_VS,
# default the automatic one) and a per-instruction source profile of its prepare kernel
# (AB_PROFILE=P1 ...: ncu SourceCounters exported as CSV).
t=${trees[$((${#trees[@]} - 1))]}; n=$(basename "$t")
if [ "${AB_TESTS:-0}" = 1 ]; then
  for vs in ${AB_TEST_VS:-auto}; do
    [ "$vs" = auto ] && v= || v=$vs
    KDA_CUDA_PREFILL_VS=$v timeout 200 "$t/build-gpu/tests/kda_gpu_tests" --gtest_brief=1 \
      --gtest_filter="${AB_TEST_FILTER:-*Prefill*}" >"$OUT/tests_${n}_vs$vs.log" 2>&1
    echo "tests $n vs=$vs rc=$?: $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test' "$OUT/tests_${n}_vs$vs.log" | tr '\n' ' ')"
    grep -E "^\[  FAILED|case A" "$OUT/tests_${n}_vs$vs.log" | head -8
  done
fi
if [ -n "${AB_PROFILE:-}" ]; then  # the tree's own srcprofile stage (its build-gpu), logs into $OUT
  (cd "$t" && OUT=$OUT PROFILE_CASES="$AB_PROFILE" scripts/gpu_check.sh srcprofile | grep -E "^== source profile")
fi
# AB_NCU="P4 P6": duration, DRAM traffic and throughput of each kernel of the last tree on those
# cases (ncu, clocks not locked; AB_NCU_ENV: settings for these runs).
if [ -n "${AB_NCU:-}" ] && command -v ncu >/dev/null; then
  for c in $AB_NCU; do
    env ${AB_NCU_ENV:-} timeout 120 ncu --clock-control none -k "regex:prepare|recurrence" --launch-count 4 --csv \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active \
      "$t/build-gpu/bench/bench_gpu_prefill" --case "$c" --no-check --iters 1 >"$OUT/ncu_$c.csv" 2>&1
    echo "---- ncu $c (rc=$?)"
    python3 - "$OUT/ncu_$c.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: sys.exit(print(open(sys.argv[1]).read()[-1500:]))
h = rows[0]; ki, mi, vi, ui = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Value"), h.index("Metric Unit")
for r in rows[1:]:
    print(f"{r[ki][:40]:40s} {r[mi]:58s} {r[vi]:>14s} {r[ui]}")
PY
  done
fi
