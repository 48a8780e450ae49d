#!/usr/bin/env bash
# Builds (if needed) and runs `kda demo` on the best available backend; extra flags pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
KDA_SKIP_PYTHON=1 scripts/deps.sh
scripts/build.sh
"./${KDA_BUILD_DIR:-build}/kda" demo "$@"
