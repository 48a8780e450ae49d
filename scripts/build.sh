#!/usr/bin/env bash
# Configures and builds library, CLI, tests and benchmarks into build/ (Release).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="$PATH:/usr/local/cuda/bin"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${KDA_CMAKE_ARGS:-} >/dev/null
cmake --build build --parallel
