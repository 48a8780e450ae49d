#!/usr/bin/env bash
# Materializes the committed HEAD tree in .deps/head (git-ignored), so a device run can build
# exactly what is committed while the working tree is being edited:
#   run: cd .deps/head && ln -sfn ../../.whl .whl && scripts/gpu_check.sh ...   (carry [".deps", ".whl"])
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .deps/head && mkdir -p .deps/head
git archive HEAD | tar -x -C .deps/head
