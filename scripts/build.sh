#!/usr/bin/env bash
# Configures and builds library, CLI, tests and benchmarks into build/ (Release).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="$PATH:/usr/local/cuda/bin"
BUILD_DIR=${KDA_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${KDA_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" --parallel
