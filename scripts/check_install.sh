#!/usr/bin/env bash
# Installs the build in ${KDA_BUILD_DIR:-build} into a temporary prefix, then configures, builds
# and runs examples/ against it through find_package(kda): the package check that CI runs.
# Also runs the installed `kda info`.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${KDA_BUILD_DIR:-build}
[ -f "$BUILD_DIR/CMakeCache.txt" ] || { echo "check_install: no build in $BUILD_DIR" >&2; exit 1; }
# Install what is current, never a stale build.
if ! log=$(cmake --build "$BUILD_DIR" --parallel 2 2>&1); then
  printf '%s\n' "$log" | tail -n 30
  echo "check_install: the build in $BUILD_DIR failed" >&2
  exit 1
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/kda-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
cmake --install "$BUILD_DIR" --prefix "$prefix" --component kda >/dev/null
echo "check_install: installed into $prefix:"
(cd "$prefix" && find . -type f | sort | sed 's/^/  /')
"$prefix/bin/kda" info
# A consumer with no CUDA on PATH and no flags but the prefix: kdaConfig.cmake finds what it needs.
cmake -S examples -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work/build" --parallel 2 >/dev/null
"$work/build/prefill_decode"
echo "check_install: the example built against the installed package passed"
