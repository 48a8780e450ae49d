#!/usr/bin/env bash
# Builds a committed tree's GPU benchmark and tests on this (CPU) machine, so that a device call
# spends no time compiling: snapshot (scripts/snapshot_head.sh), CMake Release build of
# bench_gpu_prefill and kda_gpu_tests for sm_90a, then everything but those two executables
# removed (a device call carries at most 64 MiB). Then: scripts/ab_bench.sh with AB_PREBUILT=1.
#   scripts/prebuild.sh <ref> <dir>      e.g. scripts/prebuild.sh main .deps/base
# The executables link the CUDA runtime statically; GoogleTest comes from .deps/gtest
# (scripts/carry_gtest.sh) or the system.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?ref}
dir=${2:?dir under .deps/}
scripts/snapshot_head.sh "$ref" "$dir"
extra=()
[ -d "$PWD/.deps/gtest" ] && extra+=(-DCMAKE_PREFIX_PATH="$PWD/.deps/gtest")
(cd "$dir" && cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra[@]}" >/dev/null &&
  cmake --build build-gpu --parallel "$(nproc)" --target bench_gpu_prefill kda_gpu_tests >/dev/null)
find "$dir/build-gpu" -type f ! -path "*/bench/bench_gpu_prefill" ! -path "*/tests/kda_gpu_tests" -delete
du -sh "$dir/build-gpu" | sed "s|^|prebuild.sh: $ref -> |"
