#!/usr/bin/env bash
# Materializes a committed tree (default HEAD) in a git-ignored folder (default .deps/head), so a
# GPU run can build exactly what is committed while the working tree is being edited:
#   dev/snapshot_head.sh [ref [dir]]     e.g. dev/snapshot_head.sh my-branch .deps/exp
#   then, on the GPU machine (with .deps/ and .whl/):
#   cd .deps/head && ln -sfn ../../.whl .whl && scripts/gpu_check.sh ...
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:-HEAD}
dir=${2:-.deps/head}
case "$dir" in .deps/*) ;; *) echo "snapshot_head.sh: dir must be under .deps/ (git-ignored)" >&2; exit 2 ;; esac
rm -rf "$dir" && mkdir -p "$dir"
git archive "$ref" | tar -x -C "$dir"
