#!/usr/bin/env bash
# Candidate BLAS libraries side by side on the GEMM shapes of the benchmark
# GPT (build/bin/blas_compare): pipec's OpenBLAS 0.3.34 from PyPI, Debian's
# OpenBLAS 0.3.21, Debian's BLIS 0.9 and Intel's MKL from PyPI (the one pipec
# may choose, support/Blas.h). Installs the candidates it lacks (libblis-dev
# from Debian; MKL by tools/fetch-mkl.sh), then prints a table (one thread, as pipec calls
# it) and, with --write, puts them into docs/PERFORMANCE.md between
# the BEGIN/END blas markers. Usage: tools/bench-blas.sh [--write] [--rounds N]
set -euo pipefail
cd "$(dirname "$0")/.."
write=0
rounds=5
while [ $# -gt 0 ]; do
  case "$1" in
  --write) write=1 ;;
  --rounds) rounds="$2"; shift ;;
  *) echo "bench-blas: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ -x build/bin/blas_compare ] || { echo "bench-blas: build first (tools/build.sh)" >&2; exit 1; }
lib=/usr/lib/x86_64-linux-gnu
if [ ! -f $lib/blis-openmp/libblis.so.4 ] && [ ! -f $lib/blis-pthread/libblis.so.4 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libblis-dev >/dev/null
fi
blis=$(ls $lib/blis-*/libblis.so.4 | head -n1)
tools/fetch-mkl.sh
mkl_version=2026.2.1
candidates=(
  "pipec-openblas-0.3.34=$PWD/build/_deps/openblas/lib/libscipy_openblas.so:scipy_"
  "debian-openblas-0.3.21=$lib/openblas-pthread/libopenblas.so.0"
  "debian-blis-0.9=$blis"
  "mkl-$mkl_version=$PWD/build/_deps/mkl/lib/libmkl_rt.so.3"
)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
{
  flag=""
  [ "$write" = 1 ] && flag=" --write"
  echo "Command: \`tools/bench-blas.sh$flag\` (runs \`tools/bench_blas.py\`: \`build/bin/blas_compare\` per candidate, $rounds rounds per process)."
  echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) CPUs, $(uname -sr), date $(date -u +%FT%TZ)."
  # One thread, as pipec calls a BLAS (each band of a GEMM on one of a rank's
  # threads), and MKL as pipec sets it up: sequential, strict reproducible.
  MKL_THREADING_LAYER=SEQUENTIAL MKL_CBWR=AUTO,STRICT \
    python3 tools/bench_blas.py --rounds "$rounds" --threads 1 "${candidates[@]}"
} | tee "$out"
if [ "$write" = 1 ]; then
  python3 tools/doc_section.py docs/PERFORMANCE.md blas "$out"
fi
