#!/usr/bin/env bash
# Builds ONNX (once), configures (once) and builds pipec incrementally in build/.
# Usage: tools/build.sh [extra cmake -D options...]
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="${PIPEC_JOBS:-2}"
# ONNX 1.23 from its pinned sdist into build/_deps/onnx-install (once).
tools/build-onnx.sh
# OpenBLAS 0.3.34 from its pinned PyPI wheel into build/_deps/openblas (once).
tools/fetch-openblas.sh
# MKL 2026.2.1 from its pinned PyPI wheel into build/_deps/mkl (once): pipec
# calls it instead of OpenBLAS where it measures faster (support/Blas.h).
tools/fetch-mkl.sh
if [ ! -f build/build.ninja ] || [ $# -gt 0 ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
fi
cmake --build build -j "$jobs"
