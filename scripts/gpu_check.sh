#!/usr/bin/env bash
# On an H100/H200: build, GPU tests, sanitizer, benchmarks (ours and FLA's), Python torch tests.
# Usage: scripts/gpu_check.sh [stage ...]   stages: build demo tests sanitize bench mempattern fla python
# hostcost racecheck backward profile srcprofile fused (default: build demo tests sanitize bench fla python
# hostcost). backward: the CUDA backward's tests under memcheck, racecheck and synccheck, the C++
# forward + backward benchmark (bench_gpu_backward), then forward + backward against FLA with
# kda's per-kernel GPU times (bench/peers/fla_train_bench.py --profile; TRAIN_ACCURACY=1 adds the
# gradient error table; needs the kda package installed, e.g. by the python stage first).
# Env: GPU_TEST_FILTER (gtest filter for the tests stage), FLA_BENCHES (decode prefill), FLA_CASES
# (prefill cases, default P1..P7), FUSED_CASES / FUSED_SANITIZE (the fused stage's benchmark cases
# and sanitizer tools), BUILD_TARGETS (the build stage's CMake targets; default all),
# DECODE_KERNELS (kernel sweep of the decode benchmark). FLA's
# benchmarks (bench/peers/) need its wheel in .whl/; a carried .deps/triton_cache.tgz skips their
# Triton compilation. Logs go to $OUT (or ./gpu_out); a short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
stages=${*:-build demo tests sanitize bench fla python hostcost}
has() { [[ " $stages " == *" $1 "* ]]; }
summary=()
note() { summary+=("$1"); echo "== $1"; }
export PATH="$PATH:/usr/local/cuda/bin"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv,noheader || true
# Python packages carried as wheels in .whl/ (fla-core, einops, hypothesis, ...): installed once into
# $site, which the fla, python and hostcost stages put on PYTHONPATH.
site=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && site=/tmp/site
fi
# Triton's kernel cache (FLA's kernels compile for minutes): .deps/triton_cache.tgz, when carried,
# is unpacked and used; the cache as it is at the end goes to $OUT/triton_cache.tgz (copy it to
# .deps/ for the next run).
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .deps/triton_cache.tgz ] && tar xzf .deps/triton_cache.tgz -C "$TRITON_CACHE_DIR"

if has build; then
  t0=$(date +%s)
  extra=()
  # Without a system GoogleTest, use the copy in .deps/gtest (dev/carry_gtest.sh).
  [ -f /usr/include/gtest/gtest.h ] || extra+=(-DCMAKE_PREFIX_PATH="$PWD/.deps/gtest")
  if cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKDA_PTXAS_VERBOSE=ON "${extra[@]}" >"$OUT/build.log" 2>&1 &&
     cmake --build build-gpu --parallel ${BUILD_TARGETS:+--target $BUILD_TARGETS} >>"$OUT/build.log" 2>&1; then
    note "build ok ($(( $(date +%s) - t0 )) s)"
  else
    note "build FAILED"; tail -40 "$OUT/build.log"; exit 1
  fi
  grep -E "registers|spill" "$OUT/build.log" | grep -B1 -E "spill stores [1-9]|bytes stack frame, [1-9]" | head -10
fi
B=build-gpu

if has demo; then
  ./$B/kda info 2>&1 | tail -3
  ./$B/kda demo 2>&1 | tee "$OUT/demo.log" | tail -6
  note "demo rc=${PIPESTATUS[0]}: $(grep -E 'rel L2' "$OUT/demo.log" | head -1)"
fi

if has tests; then
  timeout 300 ./$B/tests/kda_gpu_tests --gtest_brief=1 --gtest_filter="${GPU_TEST_FILTER:-*}" >"$OUT/gpu_tests.log" 2>&1
  rc=$?
  grep -E "^\[  FAILED|Failure|error" "$OUT/gpu_tests.log" | head -30
  note "gpu tests rc=$rc: $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test|tests? ran' "$OUT/gpu_tests.log" | tr '\n' ' ')"
  # The prefill feature matrix again with the value split forced: vs = 128 and 64 run the wgmma
  # recurrence (the small test shapes otherwise take vs = 16 / 32, the mma.sync K split).
  for vs in 128 64; do
    KDA_CUDA_PREFILL_VS=$vs timeout 300 ./$B/tests/kda_gpu_tests --gtest_brief=1 \
      --gtest_filter='*GpuPrefillSweep*:*PrefillSmoke*:GpuPrefill.*:GpuPrefillDecode.*:GpuPrefillWgmma.*:GpuPrefillAccuracy.CaseA*' >"$OUT/gpu_tests_vs$vs.log" 2>&1
    rc=$?
    grep -E "^\[  FAILED|Failure" "$OUT/gpu_tests_vs$vs.log" | head -10
    note "gpu prefill tests, KDA_CUDA_PREFILL_VS=$vs, rc=$rc: $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test' "$OUT/gpu_tests_vs$vs.log" | tr '\n' ' ')"
  done
fi

if has sanitize; then
  if command -v compute-sanitizer >/dev/null; then
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 ./$B/tests/kda_gpu_tests --gtest_filter='*Smoke*:GpuPrefillChunk16.*' --gtest_brief=1 >"$OUT/sanitizer.log" 2>&1
    rc=$?
    grep -E "ERROR SUMMARY|Invalid|PASSED|FAILED" "$OUT/sanitizer.log" | head -8
    note "memcheck (Smoke, chunk 16) rc=$rc: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
    # The wgmma recurrence with two warpgroups (vs = 128: the chunk-16 path) and one (vs = 64:
    # chunk 64); strided inputs take the plain-load v path.
    for vs in 128 64; do
      KDA_CUDA_PREFILL_VS=$vs timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 ./$B/tests/kda_gpu_tests \
        --gtest_filter='*PrefillSmoke*:*GpuPrefillSweep*strided*' --gtest_brief=1 >"$OUT/sanitizer_vs$vs.log" 2>&1
      rc=$?
      note "memcheck (prefill smoke + strided, vs = $vs: wgmma) rc=$rc: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_vs$vs.log" | tail -1)"
    done
  else
    note "memcheck: compute-sanitizer not found"
  fi
fi

if has racecheck; then
  # Shared-memory hazards of the prefill recurrence (K split, both layouts) and the prepare kernel.
  if command -v compute-sanitizer >/dev/null; then
    timeout 300 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
      ./$B/tests/kda_gpu_tests --gtest_filter="${RACECHECK_FILTER:-GpuPrefillKSplit.*:*PrefillSmoke*}" --gtest_brief=1 >"$OUT/racecheck.log" 2>&1
    rc=$?
    grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|PASSED|FAILED" "$OUT/racecheck.log" | head -8
    note "racecheck rc=$rc: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" | tail -1)"
    # The wgmma recurrence (named barriers, empty/full mbarriers) with the value split forced to 128
    # and 64 (racecheck sees the shared-memory accesses of threads, not those of bulk copies or
    # wgmma: the record's refill protocol is checked by the emulator's mbarriers, dev/prefill_emu).
    for vs in 128 64; do
      KDA_CUDA_PREFILL_VS=$vs timeout 200 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
        ./$B/tests/kda_gpu_tests --gtest_filter='*PrefillSmoke*:GpuPrefillWgmma.*' --gtest_brief=1 >"$OUT/racecheck_vs$vs.log" 2>&1
      rc=$?
      note "racecheck (vs = $vs: wgmma) rc=$rc: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck_vs$vs.log" | tail -1)"
    done
    # The segmented prefill (forced 64-token segments: pass 1 / 2 and the scan), and the scan alone
    # (its stages are refilled by bulk copies, which racecheck does not model for the passes).
    KDA_CUDA_PREFILL_SEGMENT=64 timeout 200 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
      --kernel-name kns=segment_scan ./$B/tests/kda_gpu_tests --gtest_filter='*PrefillSmoke*' --gtest_brief=1 >"$OUT/racecheck_scan.log" 2>&1
    rc=$?
    note "racecheck (segment scan) rc=$rc: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck_scan.log" | tail -1)"
    KDA_CUDA_PREFILL_SEGMENT=64 timeout 200 compute-sanitizer --tool synccheck --error-exitcode 9 \
      ./$B/tests/kda_gpu_tests --gtest_filter='*PrefillSmoke*:GpuPrefillSegments.*' --gtest_brief=1 >"$OUT/synccheck_seg.log" 2>&1
    rc=$?
    note "synccheck (segments) rc=$rc: $(grep -E 'ERROR SUMMARY' "$OUT/synccheck_seg.log" | tail -1)"
  else
    note "racecheck: compute-sanitizer not found"
  fi
fi

if has backward; then
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck synccheck; do
      extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
      timeout 300 compute-sanitizer --tool $tool "${extra[@]}" --error-exitcode 9 ./$B/tests/kda_gpu_tests \
        --gtest_filter='GpuBackward.*' --gtest_brief=1 >"$OUT/backward_$tool.log" 2>&1
      rc=$?
      note "$tool (backward) rc=$rc: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/backward_$tool.log" | tail -1)"
    done
  fi
  [ -x ./$B/bench/bench_gpu_backward ] && timeout 120 ./$B/bench/bench_gpu_backward >"$OUT/bench_backward.log" 2>&1
  note "backward bench (C++) rc=$?: $(grep -E '^T[12] ' "$OUT/bench_backward.log" | tr -s ' ' | tr '\n' ';')"
  args=(--profile); [ "${TRAIN_ACCURACY:-0}" = 1 ] && args+=(--accuracy)
  PYTHONPATH=$site timeout 500 python3 bench/peers/fla_train_bench.py "${args[@]}" --json "$OUT/train.json" >"$OUT/fla_train.log" 2>&1
  note "train bench rc=$?"
fi

if has bench; then
  for b in decode prefill; do
    if [ -x ./$B/bench/bench_gpu_$b ]; then
      # DECODE_KERNELS=staged,bulk,...: the decode benchmark also times each case with that kernel forced.
      args=(); [ "$b" = decode ] && [ -n "${DECODE_KERNELS:-}" ] && args=(--kernels "$DECODE_KERNELS")
      timeout 300 ./$B/bench/bench_gpu_$b "${args[@]}" >"$OUT/bench_$b.log" 2>&1
      note "bench $b rc=$?"
    fi
  done
fi

if has mempattern && [ -x ./$B/bench/bench_gpu_mempattern ]; then
  timeout 120 ./$B/bench/bench_gpu_mempattern >"$OUT/mempattern.log" 2>&1
  note "mempattern rc=$?"; cat "$OUT/mempattern.log"
fi

if has fla; then
  if [ -n "$site" ]; then
    export PYTHONPATH=$site
    for b in ${FLA_BENCHES:-decode prefill}; do
      [ -f bench/peers/fla_${b}_bench.py ] || continue
      if [ "$b" = prefill ]; then
        # One case per process, each with its own limit: Triton compiles FLA's kernels for every
        # case (P1 and P2 take most of 200 s, P3-P7 one by one ~350 s; FLA_CASES picks a subset).
        rcs=""
        for c in ${FLA_CASES:-P1 P2 P3 P4 P5 P6 P7}; do
          timeout 150 python3 bench/peers/fla_prefill_bench.py --case "$c" >"$OUT/fla_case.log" 2>&1
          rcs="$rcs $c:$?"
          [ -s "$OUT/fla_prefill.log" ] || head -2 "$OUT/fla_case.log" | grep -E "^(device|case)" >"$OUT/fla_prefill.log"
          grep -E "^P[0-9]" "$OUT/fla_case.log" >>"$OUT/fla_prefill.log"
        done
        rm -f "$OUT/fla_case.log"
        note "fla prefill rc per case:$rcs"
      else
        timeout 200 python3 bench/peers/fla_${b}_bench.py >"$OUT/fla_$b.log" 2>&1
        note "fla $b rc=$?"
      fi
    done
  else
    note "fla: no wheel in .whl (carry .whl)"
  fi
fi

if has python; then
  if python3 -m pip install -q --no-build-isolation --no-deps --no-index . >"$OUT/python.log" 2>&1; then
    PYTHONPATH=$site PYTHONFAULTHANDLER=1 timeout 400 python3 -m pytest tests/python -q -rs -p no:cacheprovider >>"$OUT/python.log" 2>&1
    rc=$?
    grep -E "FAILED|Error|error|Fatal|File \"|passed|failed" "$OUT/python.log" | grep -v "^  " | head -25
    note "python tests rc=$rc: $(grep -E 'passed|failed' "$OUT/python.log" | tail -1)"
    if [ $rc -ge 128 ] && command -v cuda-gdb >/dev/null; then  # a crash: native backtrace
      PYTHONPATH=$site timeout 120 cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args \
        python3 -m pytest tests/python -x -q -p no:cacheprovider >"$OUT/python_gdb.log" 2>&1
      grep -E "^#[0-9]+|signal|SIGSEGV" "$OUT/python_gdb.log" | head -30
    fi
  else
    note "python install FAILED"; tail -20 "$OUT/python.log"
  fi
fi

if [[ " $stages " == *" profile "* ]] && command -v ncu >/dev/null; then
  # PROFILE_CASES: prefill cases (P1..P7); PROFILE_DECODE: decode bench filters (e.g. T1_B256);
  # PROFILE_SECTIONS: ncu sections (default SpeedOfLight; add WarpStateStats Occupancy ... for stalls).
  secs=(); for s in ${PROFILE_SECTIONS:-SpeedOfLight}; do secs+=(--section "$s"); done
  [ -n "${PROFILE_DETAILS:-}" ] && secs+=(--print-details all)  # stall-reason breakdown etc.
  for c in ${PROFILE_CASES-P1}; do
    timeout 150 ncu --clock-control none "${secs[@]}" --launch-skip 2 --launch-count 2 \
      ./$B/bench/bench_gpu_prefill --case $c --no-check --iters 20 >"$OUT/ncu_$c.log" 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Issued Warp|No Eligible" "$OUT/ncu_$c.log" | head -24
  done
  for c in ${PROFILE_DECODE-}; do
    timeout 150 ncu --clock-control none "${secs[@]}" --launch-skip 5 --launch-count 1 \
      ./$B/bench/bench_gpu_decode --filter $c --no-check --iters 10 --warmup 2 >"$OUT/ncu_dec_$c.log" 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Issued Warp|No Eligible" "$OUT/ncu_dec_$c.log" | head -12
  done
fi

if has fused; then
  # The fused prefill kernel (KDA_CUDA_PREFILL_FUSED=1; docs/design.md section 6): its tests, case
  # A on it, the benchmark forced onto it against the default path, then its tests under memcheck,
  # racecheck and synccheck.
  timeout 150 ./$B/tests/kda_gpu_tests --gtest_brief=1 --gtest_filter='GpuPrefillFused.*' >"$OUT/fused_tests.log" 2>&1
  note "fused tests rc=$?: $(grep -E '^\[  PASSED|^\[  FAILED' "$OUT/fused_tests.log" | tr '\n' ' ')"
  KDA_CUDA_PREFILL_FUSED=1 timeout 150 ./$B/tests/kda_gpu_tests --gtest_brief=1 --gtest_filter='GpuPrefillAccuracy.CaseALowerBound' >"$OUT/fused_case_a.log" 2>&1
  note "fused case A rc=$?: $(grep 'case A' "$OUT/fused_case_a.log")"
  for mode in 1 0; do
    KDA_CUDA_PREFILL_FUSED=$mode timeout 200 ./$B/bench/bench_gpu_prefill --iters 20 --no-check ${FUSED_CASES:+--case $FUSED_CASES} >"$OUT/fused_bench_$mode.log" 2>&1
    note "bench, KDA_CUDA_PREFILL_FUSED=$mode: $(grep -E '^[PS][0-9]+ ' "$OUT/fused_bench_$mode.log" | cut -c1-45 | tr -s ' ' | tr '\n' ';')"
  done
  for tool in ${FUSED_SANITIZE-memcheck racecheck synccheck}; do
    extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
    timeout 150 compute-sanitizer --tool $tool "${extra[@]}" --error-exitcode 9 ./$B/tests/kda_gpu_tests \
      --gtest_filter='GpuPrefillFused.*' --gtest_brief=1 >"$OUT/fused_$tool.log" 2>&1
    note "fused $tool rc=$?: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/fused_$tool.log" | tail -1)"
  done
fi

if has srcprofile && command -v ncu >/dev/null; then
  # Per-SASS-instruction stall samples of one kernel (PROFILE_KERNEL regex, default prepare) on
  # PROFILE_CASES, exported as CSV (source page; dev/sass_stalls.py sums them per source line
  # through the binary's -lineinfo line table).
  # Cases T1 / T2 run the backward benchmark (e.g. PROFILE_CASES=T1 PROFILE_KERNEL=bwd_chunk).
  for c in ${PROFILE_CASES-P1}; do
    run=(./$B/bench/bench_gpu_prefill --case $c --no-check --iters 20); skip=1
    [[ $c == T* ]] && { run=(./$B/bench/bench_gpu_backward --case $c --iters 3); skip=0; }
    timeout 200 ncu --clock-control none --section SourceCounters --section WarpStateStats -k "regex:${PROFILE_KERNEL:-prepare}" \
      --launch-skip $skip --launch-count 1 -f -o "$OUT/src_$c" "${run[@]}" >"$OUT/src_$c.log" 2>&1
    ncu --import "$OUT/src_$c.ncu-rep" --page source --csv --print-source sass >"$OUT/src_${c}_sass.csv" 2>>"$OUT/src_$c.log"
    note "source profile $c (${PROFILE_KERNEL:-prepare}): $(wc -l <"$OUT/src_${c}_sass.csv") lines"
    rm -f "$OUT/src_$c.ncu-rep"
  done
fi

if has hostcost; then
  # Host time of one call (targets.md "Host cost of one call"): the C++ API and Python with torch
  # CUDA tensors (kda, and FLA / FlashKDA where importable: carry .whl for FLA).
  # Both print a breakdown table last (bare launches, validation, argument reading, allocation,
  # streams); the summary keeps the whole calls.
  [ -x ./$B/bench/bench_host_cost ] && timeout 120 ./$B/bench/bench_host_cost >"$OUT/host_cost_cpp.log" 2>&1
  note "host cost, C++ rc=$?: $(grep -E '^kda::(prefill|decode) ' "$OUT/host_cost_cpp.log" 2>/dev/null | tr -s ' ' | tr '\n' ';')"
  PYTHONPATH=$site timeout 240 python3 bench/host_cost.py >"$OUT/host_cost_py.log" 2>&1
  note "host cost, Python rc=$?: $(grep -E '^kda\.(prefill|fwd|decode) ' "$OUT/host_cost_py.log" 2>/dev/null | tr -s ' ' | tr '\n' ';')"
fi

[ -n "$(ls -A "$TRITON_CACHE_DIR" 2>/dev/null)" ] && tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" .
echo
for f in bench_decode bench_prefill fla_decode fla_prefill fla_train host_cost_cpp host_cost_py; do
  n=14; [[ $f == host_cost_* ]] && n=24  # the breakdown tables
  [ -f "$OUT/$f.log" ] && { echo "---- $f"; tail -$n "$OUT/$f.log"; }
done
echo "---- summary"
printf '%s\n' "${summary[@]}"
