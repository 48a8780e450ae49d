#!/usr/bin/env bash
# emu_race.sh — race check of the CUDA prefill kernels without a GPU: builds the CPU emulator in
# its ThreadSanitizer mode (-DKDA_EMU_TSAN=ON, dev/prefill_emu/tsan.h: every CUDA thread a TSan
# fiber, the barriers, mbarriers, atomics with fences and asynchronous copies and products as the
# synchronizations of the CUDA memory model) and runs the emulated GPU prefill tests under it, with
# the value split and step length forced so that every recurrence variant runs: the 64- and
# 16-token wgmma steps with one and two warpgroups (vs = 64, 128; the stage refill by the last warp
# done), the K split, the fused kernel, the single launch, the segmented passes and the warm-up
# segments. The model's own cases (tsan_selftest.cpp: races it must report, orderings it must
# accept) run first.
#   dev/emu_race.sh [build dir]          (default build-emu-tsan)
# The emulation under TSan is slow: the smoke runs take 1-3 minutes each, the fused kernel's tests
# ~35 and the wgmma sweep over an hour (one core each). EMU_RACE_RUNS="vs128c64 fused ..." runs
# only those (names below). Prints one line per run (TSan warnings, tests passed) and exits
# non-zero on any warning or failure; the logs are in $EMU_RACE_LOGS (default build
# dir/race_logs).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-emu-tsan}
logs=${EMU_RACE_LOGS:-$build/race_logs}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKDA_ENABLE_CUDA=OFF \
  -DKDA_BUILD_EMULATOR=ON -DKDA_EMU_TSAN=ON >/dev/null || exit 1
cmake --build "$build" --target kda_emu_tests kda_emu_tsan_selftest >/dev/null || exit 1
mkdir -p "$logs"
# The model first: cases with a known verdict (tsan_selftest.cpp).
"$build/dev/prefill_emu/kda_emu_tsan_selftest" >"$logs/selftest.log" 2>&1 || {
  cat "$logs/selftest.log"
  exit 1
}
echo "model: $(tail -1 "$logs/selftest.log") in $(grep -c expect "$logs/selftest.log") cases"
export TSAN_OPTIONS="halt_on_error=0 history_size=3 report_signal_unsafe=0 ${TSAN_OPTIONS:-}"
t=$build/dev/prefill_emu/kda_emu_tests
failed=0
run() {  # name, then VAR=value ... and the gtest filter
  local name=$1 filter=${*: -1} vars=("${@:2:$#-2}")
  [ -n "${EMU_RACE_RUNS:-}" ] && [[ " $EMU_RACE_RUNS " != *" $name "* ]] && return
  env "${vars[@]}" "$t" --gtest_brief=1 --gtest_filter="$filter" >"$logs/$name.log" 2>&1
  local rc=$? warn
  warn=$(grep -c 'WARNING: ThreadSanitizer' "$logs/$name.log")
  printf '%-10s %-45s rc=%d tsan warnings=%d %s\n' "$name" "${vars[*]:-defaults}" "$rc" "$warn" \
    "$(grep -E '^\[  (PASSED|FAILED)' "$logs/$name.log" | tr '\n' ' ')"
  [ "$rc" -ne 0 ] || [ "$warn" -ne 0 ] && failed=1
}
run vs128c64 EMU_VS=128 KDA_CUDA_PREFILL_CHUNK=64 'GpuPrefillSmoke.*'
run vs128c16 EMU_VS=128 KDA_CUDA_PREFILL_CHUNK=16 'GpuPrefillSmoke.*'
run vs64c64 EMU_VS=64 KDA_CUDA_PREFILL_CHUNK=64 'GpuPrefillSmoke.*'
run vs64c16 EMU_VS=64 KDA_CUDA_PREFILL_CHUNK=16 'GpuPrefillSmoke.*'
run ksplit 'GpuPrefillKSplit.*'
run wgmma 'GpuPrefillWgmma.*:GpuPrefillChunk16.*'
run fused 'GpuPrefillFused.*'
run single 'GpuPrefillSingle.*'
run segments 'GpuPrefillSegments.*'
run warm 'GpuPrefillWarm.*'  # warm-up segments and their exact fallback (~35 minutes)
exit $failed
