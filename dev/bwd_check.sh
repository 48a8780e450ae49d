#!/usr/bin/env bash
# bwd_check.sh — on the GPU machine, the CUDA backward of trees built here by dev/prebuild.sh
# (PREBUILD_BACKWARD=1 PREBUILD_CUDA_FLAGS=-lineinfo) and packed into one archive:
#   tar cJf .deps/bwd.tar.xz .deps/base/build-gpu/bench/bench_gpu_backward \
#     .deps/new/build-gpu/bench/bench_gpu_backward .deps/new/build-gpu/tests/kda_gpu_tests
#   then, on the GPU machine: dev/bwd_check.sh .deps/base .deps/new
# In order of value, each step skipped once the script has run BUDGET_S seconds (default 170),
# so that a short device lease still returns the first figures:
#   NEW's GpuBackward tests (the SoftplusTwoChunks errors against fp64 printed);
#   bench_gpu_backward on CASE (default T1), both trees, then NEW's per-kernel times (ncu);
#   racecheck on WgmmaPasses, memcheck on WgmmaPasses and SoftplusTwoChunks;
#   a second round of both benchmarks (interleaved, the other order), NEW on T2;
#   per-SASS-line stall samples (ncu source page, gzipped CSV) of PROFILE_KERNELS (default
#   bwd_chunk bwd_prepare), for dev/sass_stalls.py.
# Logs under $OUT (tarred into logs.tgz at the end).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PATH="$PATH:/usr/local/cuda/bin"
[ -f .deps/bwd.tar.xz ] && tar xJf .deps/bwd.tar.xz
base=${1:?base tree}; new=${2:?new tree}
budget=${BUDGET_S:-170}; case_=${CASE:-T1}
nvidia-smi --query-gpu=name --format=csv,noheader
t=$new/build-gpu/tests/kda_gpu_tests
timeout 60 "$t" --gtest_brief=1 --gtest_filter='GpuBackward.*' >"$OUT/tests.log" 2>&1
echo "tests rc=$? t=$SECONDS"; grep -E "PASSED|FAILED|Failure" "$OUT/tests.log" | tail -3
grep -A8 "SoftplusTwoChunks" "$OUT/tests.log" | grep rel_l2 | awk '{print $3, $5}' | tr '\n' ' '
echo
bench() {  # tree label round case
  timeout 40 "$1/build-gpu/bench/bench_gpu_backward" --case "$4" --iters 5 >"$OUT/bench_$2_$3_$4.log" 2>&1
  echo "== $2 round $3 rc=$? t=$SECONDS"; grep -E "^T[12]" "$OUT/bench_$2_$3_$4.log"
}
bench "$base" base 1 "$case_"
bench "$new" new 1 "$case_"
timeout 50 ncu --clock-control none -k regex:bwd_ -c 7 --metrics gpu__time_duration.sum \
  "$new/build-gpu/bench/bench_gpu_backward" --case "$case_" --iters 1 >"$OUT/ncu_new.log" 2>&1
echo "== ncu new rc=$? t=$SECONDS"
grep -E "gpu__time_duration|\(BwdParams" "$OUT/ncu_new.log" | sed -E 's/\(BwdParams.*//' | paste - - |
  awk '{print $1, $2, $(NF-1), $NF}'
timeout 30 compute-sanitizer --tool racecheck --error-exitcode 9 "$t" --gtest_brief=1 \
  --gtest_filter='GpuBackward.WgmmaPasses' >"$OUT/racecheck.log" 2>&1
echo "racecheck rc=$? t=$SECONDS"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY" "$OUT/racecheck.log" | tail -1
timeout 30 compute-sanitizer --tool memcheck --error-exitcode 9 "$t" --gtest_brief=1 \
  --gtest_filter='GpuBackward.WgmmaPasses:GpuBackward.SoftplusTwoChunks' >"$OUT/memcheck.log" 2>&1
echo "memcheck rc=$? t=$SECONDS"; grep -E "ERROR SUMMARY" "$OUT/memcheck.log" | tail -1
if [ $SECONDS -lt $((budget * 7 / 10)) ]; then
  bench "$new" new 2 "$case_"
  bench "$base" base 2 "$case_"
fi
[ $SECONDS -lt $((budget * 8 / 10)) ] && bench "$new" new 1 T2
for k in ${PROFILE_KERNELS:-bwd_chunk bwd_prepare}; do
  [ $SECONDS -lt "$budget" ] || break
  timeout 40 ncu --clock-control none --section SourceCounters --section WarpStateStats -k "regex:$k" \
    --launch-count 1 -f -o "$OUT/src_$k" "$new/build-gpu/bench/bench_gpu_backward" --case "$case_" \
    --iters 1 >"$OUT/src_$k.log" 2>&1
  ncu --import "$OUT/src_$k.ncu-rep" --page source --csv --print-source sass 2>/dev/null |
    gzip >"$OUT/src_${k}_sass.csv.gz"
  echo "== source profile $k rc=$? t=$SECONDS"; rm -f "$OUT/src_$k.ncu-rep"
done
echo "t=$SECONDS"
(cd "$OUT" && tar czf logs.tgz ./*.log 2>/dev/null && rm -f ./*.log)
