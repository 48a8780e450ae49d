#!/usr/bin/env bash
# prebuilt_check.sh — on the GPU machine, from trees built here by dev/prebuild.sh (PREBUILD_ALL=1)
# and packed into one archive (the carry limit is 64 MiB; the executables compress ~3x):
#   tar cJf .deps/prebuilt.tar.xz .deps/base/build-gpu/bench/{bench_gpu_prefill,bench_host_cost} \
#     .deps/new/build-gpu/bench/{bench_gpu_prefill,bench_host_cost,bench_gpu_decode} \
#     .deps/new/build-gpu/tests/kda_gpu_tests
#   then, on the GPU machine: dev/prebuilt_check.sh .deps/base .deps/new
# Runs NEW's GPU tests (CHECK_FILTER) and compute-sanitizer memcheck / racecheck / synccheck
# (SANITIZE_FILTER), then ROUNDS interleaved rounds of both trees' host cost (bench_host_cost)
# and prefill benchmark (CHECK_CASES), NEW's also under each AB_VARIANTS setting (VAR=value, or
# several joined by commas), and NEW's decode benchmark (DECODE_FILTER). HOST_ARGS: extra
# bench_host_cost arguments (e.g. `--T 2048 --H 12` for a segmented call). PY_KDA: a directory
# holding a `kda` package built for the GPU machine's Python (e.g. .deps/py312/python, packed
# too): then bench/host_cost.py also runs for NEW under each setting (rows `py kda.prefill`,
# `py kda.fwd`, `py kda.decode`: those calls alone, not their variants with outputs given or on
# a side stream). Logs in $OUT, one per tree, round and setting; the medians over the rounds last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PATH="$PATH:/usr/local/cuda/bin"
[ -f .deps/prebuilt.tar.xz ] && tar xJf .deps/prebuilt.tar.xz
base=${1:?base tree}; new=${2:?new tree}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t=$new/build-gpu/tests/kda_gpu_tests
timeout 300 "$t" --gtest_brief=1 --gtest_filter="${CHECK_FILTER:-*Prefill*}" >"$OUT/tests.log" 2>&1
echo "tests rc=$?: $(grep -E '^\[  (PASSED|FAILED)' "$OUT/tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED' "$OUT/tests.log" | head -10
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  timeout 240 compute-sanitizer --tool "$tool" "$t" --gtest_brief=1 \
    --gtest_filter="${SANITIZE_FILTER:-GpuPrefillSmoke.*}" >"$OUT/$tool.log" 2>&1
  echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY|hazard|PASSED|FAILED' "$OUT/$tool.log" | tail -2 | tr '\n' ' ')"
done
read -ra variants <<<"${AB_VARIANTS:-}"
: >"$OUT/medians.tsv"
for r in $(seq 1 "${ROUNDS:-2}"); do
  for tree in "$base" "$new"; do
    n=$(basename "$tree")
    settings=(""); [ "$tree" = "$new" ] && settings+=("${variants[@]}")
    for var in "${settings[@]}"; do
      tag=${n}_$r${var:+_${var//[^A-Za-z0-9]/_}}
      env ${var//,/ } "$tree/build-gpu/bench/bench_host_cost" ${HOST_ARGS:-} >"$OUT/host_$tag.log" 2>&1
      awk -v c="$n${var:+ $var}" '$1 ~ /^kda::(prefill|decode)$/ {print c "\t" $1 " " $2 "\t" $3}' \
        "$OUT/host_$tag.log" >>"$OUT/medians.tsv"
      if [ -n "${PY_KDA:-}" ] && [ "$tree" = "$new" ]; then
        env ${var//,/ } PYTHONPATH="$PY_KDA" timeout 120 python3 bench/host_cost.py \
          >"$OUT/py_$tag.log" 2>&1
        awk -v c="$n${var:+ $var}" 'NF == 2 && $1 ~ /^kda\.(prefill|fwd|decode)$/ && $2 ~ /^[0-9.]+$/ {print c "\tpy " $1 "\t" $NF}' \
          "$OUT/py_$tag.log" >>"$OUT/medians.tsv"
      fi
      env ${var//,/ } "$tree/build-gpu/bench/bench_gpu_prefill" --case "${CHECK_CASES:-S1,S2,S10,P7}" \
        --iters 50 $([ "$r" -gt 1 ] && echo --no-check) >"$OUT/bench_$tag.log" 2>&1
      [ "$r" = 1 ] && grep -E "^[PS][0-9]" "$OUT/bench_$tag.log" | sed "s|^|$n ${var} |"
      awk -v c="$n${var:+ $var}" '/^[PS][0-9]/ {for (i = 2; i <= NF; ++i) if ($i ~ /^[0-9]+\.[0-9]+$/ && $(i+1) ~ /^[0-9]+\.[0-9]+$/) {print c "\t" $1 "\t" $i; break}}' \
        "$OUT/bench_$tag.log" >>"$OUT/medians.tsv"
    done
  done
done
if [ -n "${DECODE_FILTER:-}" ]; then
  "$new/build-gpu/bench/bench_gpu_decode" --filter "$DECODE_FILTER" >"$OUT/decode.log" 2>&1
  tail -12 "$OUT/decode.log"
fi
echo "---- medians over rounds (host: us per call; prefill: ms)"
python3 - "$OUT/medians.tsv" <<'PY'
import collections, statistics, sys
runs = collections.OrderedDict()
for line in open(sys.argv[1]):
    col, case, v = line.rstrip("\n").split("\t")
    runs.setdefault(case, collections.OrderedDict()).setdefault(col, []).append(float(v))
cols = list(dict.fromkeys(c for per in runs.values() for c in per))
print("case".ljust(22) + "".join(c[:26].rjust(28) for c in cols))
for case, per in runs.items():
    print(case.ljust(22) + "".join(
        (f"{statistics.median(per[c]):.4g}" if c in per else "-").rjust(28) for c in cols))
PY
