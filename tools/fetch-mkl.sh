#!/usr/bin/env bash
# Fetches Intel's MKL 2026.2.1 as PyPI's mkl wheel (pinned by hash) into
# build/_deps/mkl/lib: the libraries one sequential sgemm through
# libmkl_rt.so.3 needs (the LP64 interface, the sequential layer, the core and
# its CPU kernels), not the threaded layers, ScaLAPACK or the vector math.
# pipec loads it at run time beside its OpenBLAS and calls whichever of the
# two measured faster on this CPU (support/Blas.h). Safe to run again: it
# exits at once when the stamp names this wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

version=2026.2.1
wheel=mkl-$version-py2.py3-none-manylinux_2_28_x86_64.whl
wheel_sha256=76322a3abf512594ab7b4e82cb72df91e4e5d195498769aa8b292373c1ddd6d1
libs="libmkl_rt.so.3 libmkl_intel_lp64.so.3 libmkl_sequential.so.3 libmkl_core.so.3
  libmkl_def.so.3 libmkl_mc3.so.3 libmkl_avx2.so.3 libmkl_avx512.so.3 libmkl_avx10.so.3"

. tools/wheel-stamp.sh
skip_if_unpacked mkl "$wheel_sha256"
if [ "$(uname -m)" != x86_64 ]; then
  echo "fetch-mkl: MKL is for x86-64; pipec uses OpenBLAS alone on $(uname -m)"
  exit 0
fi
tools/fetch-wheel.sh "mkl==$version" "$wheel" "$wheel_sha256"
rm -rf "$prefix"
mkdir -p "$prefix/lib"
members=""
for lib in $libs; do members="$members mkl-$version.data/data/lib/$lib"; done
# Only the members named: the whole wheel unpacks to about 800 MB.
"$python" - "$deps/$wheel" "$prefix" $members <<'PY'
import os, shutil, sys, zipfile
wheel, prefix, members = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    for m in members:
        with z.open(m) as src, open(os.path.join(prefix, "lib", os.path.basename(m)), "wb") as dst:
            shutil.copyfileobj(src, dst)
    lic = [n for n in z.namelist() if n.endswith("dist-info/LICENSE.txt")]
    if lic:
        with z.open(lic[0]) as src, open(os.path.join(prefix, "LICENSE.txt"), "wb") as dst:
            shutil.copyfileobj(src, dst)
PY
rm -f "$deps/$wheel" # 229 MB, and nothing reads it again
mark_unpacked "$wheel_sha256"
echo "fetch-mkl: MKL $version in $prefix"
