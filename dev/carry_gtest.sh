#!/usr/bin/env bash
# Copies this machine's GoogleTest (Debian libgtest-dev) into .deps/gtest, to be copied along to a
# GPU machine that has none (scripts/gpu_check.sh and dev/ab_bench.sh use it from there).
set -euo pipefail
cd "$(dirname "$0")/.."
D=.deps/gtest
L=/usr/lib/x86_64-linux-gnu
mkdir -p $D/include $D/lib/x86_64-linux-gnu/cmake
cp -r /usr/include/gtest /usr/include/gmock $D/include/
cp $L/libgtest*.a $L/libgmock*.a $D/lib/x86_64-linux-gnu/
cp -r $L/cmake/GTest $D/lib/x86_64-linux-gnu/cmake/
