#!/usr/bin/env bash
# Installs what the build needs on a fresh Debian/Ubuntu machine (as root, or with sudo):
# a C++20 compiler, CMake, Ninja, GoogleTest; and the Python build/test packages from PyPI.
# CUDA (nvcc) is optional: when it is on PATH the CUDA backend is built too.
set -euo pipefail
need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
command -v python3 >/dev/null || need_apt+=(python3 python3-pip python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi
if [ "${KDA_SKIP_PYTHON:-0}" != 1 ]; then
  python3 -m pip install -q --disable-pip-version-check nanobind scikit-build-core numpy pytest
fi
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "note: nvcc found at /usr/local/cuda/bin; add it to PATH to build the CUDA backend" >&2
fi
