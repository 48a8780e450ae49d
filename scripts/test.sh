#!/usr/bin/env bash
# The project's test command: builds everything, runs the C++ tests (CTest; GPU tests skip
# without an sm_90 GPU), installs the Python package and runs its tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
ctest --test-dir "${KDA_BUILD_DIR:-build}" --output-on-failure -L "cpu|gpu"
if [ -f pyproject.toml ] && [ "${KDA_SKIP_PYTHON:-0}" != 1 ]; then
  python3 -m pip install -q --disable-pip-version-check --no-build-isolation .
  python3 -m pytest tests/python -q -rs
fi
