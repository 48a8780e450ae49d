#!/usr/bin/env bash
# Builds a committed tree's GPU benchmark and tests on this (CPU) machine, so that the GPU machine
# spends no time compiling: snapshot (dev/snapshot_head.sh), CMake Release build of
# bench_gpu_prefill and kda_gpu_tests for sm_90a, then everything but those two executables
# removed (a tree of ~12 MB to copy). Then: dev/ab_bench.sh with AB_PREBUILT=1.
#   dev/prebuild.sh <ref> <dir>      e.g. dev/prebuild.sh main .deps/base
# PREBUILD_ALL=1 also keeps the demo CLI (kda) and the decode benchmark, so that
# `scripts/gpu_check.sh demo tests sanitize racecheck bench` runs from the copied tree without its
# build stage (~24 MB a tree instead of ~12); PREBUILD_BACKWARD=1 also keeps bench_gpu_backward.
# The executables link the CUDA runtime statically; GoogleTest comes from .deps/gtest
# (dev/carry_gtest.sh) or the system. PREBUILD_CUDA_FLAGS: extra nvcc flags (e.g. -lineinfo).
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?ref}
dir=${2:?dir under .deps/}
dev/snapshot_head.sh "$ref" "$dir"
extra=()
[ -d "$PWD/.deps/gtest" ] && extra+=(-DCMAKE_PREFIX_PATH="$PWD/.deps/gtest")
keep=(bench/bench_gpu_prefill tests/kda_gpu_tests)  # executables kept; their CMake targets:
targets=(bench_gpu_prefill kda_gpu_tests)
[ "${PREBUILD_ALL:-0}" = 1 ] && keep+=(kda bench/bench_gpu_decode bench/bench_host_cost) &&
  targets+=(kda_cli bench_gpu_decode bench_host_cost)
[ "${PREBUILD_BACKWARD:-0}" = 1 ] && keep+=(bench/bench_gpu_backward) && targets+=(bench_gpu_backward)
[ -n "${PREBUILD_CUDA_FLAGS:-}" ] && extra+=(-DCMAKE_CUDA_FLAGS="$PREBUILD_CUDA_FLAGS")
(cd "$dir" && cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release "${extra[@]}" >/dev/null &&
  cmake --build build-gpu --parallel "$(nproc)" --target "${targets[@]}" >/dev/null)
args=(); for k in "${keep[@]}"; do args+=(! -path "$dir/build-gpu/$k"); done
find "$dir/build-gpu" -type f "${args[@]}" -delete
du -sh "$dir/build-gpu" | sed "s|^|prebuild.sh: $ref -> |"
