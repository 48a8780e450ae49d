#!/usr/bin/env bash
# Materializes a committed tree (default HEAD) in a git-ignored folder (default .deps/head), so a
# device run can build exactly what is committed while the working tree is being edited:
#   scripts/snapshot_head.sh [ref [dir]]     e.g. scripts/snapshot_head.sh next/prefill-experiments .deps/exp
#   run: cd .deps/head && ln -sfn ../../.whl .whl && scripts/gpu_check.sh ...   (carry [".deps", ".whl"])
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:-HEAD}
dir=${2:-.deps/head}
case "$dir" in .deps/*) ;; *) echo "snapshot_head.sh: dir must be under .deps/ (git-ignored)" >&2; exit 2 ;; esac
rm -rf "$dir" && mkdir -p "$dir"
git archive "$ref" | tar -x -C "$dir"
