#!/usr/bin/env bash
# Copies this machine's GoogleTest (Debian libgtest-dev) into .deps/gtest, to be carried to a
# device machine whose image has none (device runs: carry [".deps", ".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
D=.deps/gtest
L=/usr/lib/x86_64-linux-gnu
mkdir -p $D/include $D/lib/x86_64-linux-gnu/cmake
cp -r /usr/include/gtest /usr/include/gmock $D/include/
cp $L/libgtest*.a $L/libgmock*.a $D/lib/x86_64-linux-gnu/
cp -r $L/cmake/GTest $D/lib/x86_64-linux-gnu/cmake/
