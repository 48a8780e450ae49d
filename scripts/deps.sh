#!/usr/bin/env bash
# Installs what the build and CI need on a fresh Debian/Ubuntu machine (as root, or with sudo):
# a C++20 compiler, CMake, Ninja, GoogleTest, clang-format from Debian; ruff from PyPI; and, unless
# KDA_SKIP_PYTHON=1, the Python build and test packages from PyPI (nanobind, scikit-build-core,
# numpy, pytest, hypothesis, torch, einops, and fla-core 0.6.0 for the FLA reference functions).
# CUDA (nvcc) is optional: when it is on PATH the CUDA backend is built too.
set -euo pipefail
need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
command -v clang-format >/dev/null || need_apt+=(clang-format)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
command -v python3 >/dev/null || need_apt+=(python3 python3-pip python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi
pip_install() { python3 -m pip install -q --disable-pip-version-check "$@"; }
# has MODULE: the interpreter imports it.
has() { python3 -c "import $1" >/dev/null 2>&1; }
command -v ruff >/dev/null || pip_install ruff
if [ "${KDA_SKIP_PYTHON:-0}" != 1 ]; then
  pip_install nanobind scikit-build-core numpy pytest
  has hypothesis || pip_install hypothesis
  has einops || pip_install einops
  has torch || pip_install torch
  # FLA's pure-torch reference functions (fla.ops.kda.naive); its own dependencies (triton, ...)
  # are not needed for them.
  [ "$(python3 -c 'import importlib.metadata as m; print(m.version("fla-core"))' 2>/dev/null)" = 0.6.0 ] \
    || pip_install --no-deps fla-core==0.6.0
fi
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "note: nvcc found at /usr/local/cuda/bin; add it to PATH to build the CUDA backend" >&2
fi
