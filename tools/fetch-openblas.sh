#!/usr/bin/env bash
# Fetches pipec's BLAS: OpenBLAS 0.3.34 as PyPI's scipy-openblas32 wheel
# (pinned by hash; its symbols are prefixed scipy_, DYNAMIC_ARCH, no Fortran
# runtime) into build/_deps/openblas/{include,lib}. Debian 12's OpenBLAS is
# 0.3.21, which runs its SSE kernels on CPUs newer than it (Intel family 6
# model 207, for one); docs/PERFORMANCE.md compares the candidates.
# Safe to run again: it exits at once when the stamp names this wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.3.34.481.3
wheel=scipy_openblas32-$version-py3-none-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
wheel_sha256=0595f94cd58c1f8a0d90c975621f4587337a003916b1979e834ebdf2cb5d9504

. tools/wheel-stamp.sh
skip_if_unpacked openblas "$wheel_sha256"
if [ "$(uname -m)" != x86_64 ]; then
  echo "fetch-openblas: no pinned wheel for $(uname -m); configure with -DPIPEC_BLAS=system" >&2
  exit 1
fi

tools/fetch-wheel.sh "scipy-openblas32==$version" "$wheel" "$wheel_sha256"
rm -rf "$prefix" "$deps/openblas-unpack"
"$python" -m zipfile -e "$deps/$wheel" "$deps/openblas-unpack"
mkdir -p "$prefix"
mv "$deps/openblas-unpack/scipy_openblas32/include" "$prefix/include"
mkdir -p "$prefix/lib"
mv "$deps/openblas-unpack/scipy_openblas32/lib/libscipy_openblas.so" "$prefix/lib/"
mv "$deps/openblas-unpack/scipy_openblas32-$version.dist-info/licenses/LICENSE.txt" \
  "$prefix/LICENSE.txt"
rm -rf "$deps/openblas-unpack"
mark_unpacked "$wheel_sha256"
echo "fetch-openblas: OpenBLAS $version (scipy-openblas32) in $prefix"
