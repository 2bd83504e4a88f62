#!/usr/bin/env bash
# gpu-bundle.sh - builds what the GPU test machine runs, on a machine with
# the CUDA toolkit and no GPU, into one folder that is taken there as it is:
#
#   BUNDLE/bin/pipec  BUNDLE/bin/GpuTest      rpath $ORIGIN/../lib
#   BUNDLE/lib/libpipec_cuda_backend.so       the plugin `run --backend cuda` loads
#   BUNDLE/lib/*.so*                          every other shared library they
#                                             need (protobuf, MPI, OpenBLAS's
#                                             GEMMs, ...), rpath $ORIGIN
#   BUNDLE/tools/                             gpu-check.sh and its Python parts
#   BUNDLE/fixtures/generate/                 the generation fixtures
#   BUNDLE/fixtures/train/                    GPT-2 with its loss, its batch, torch's bf16 losses
#   BUNDLE/MANIFEST                           commit, files and sizes
#
# and BUNDLE.tar.xz of it. The GPU machine's image has CUDA and NCCL (its
# Python packages) but no LLVM, protobuf, OpenBLAS or Open MPI: so LLVM
# Support is linked statically (PIPEC_PORTABLE, the top CMakeLists.txt), the
# libraries of glibc, libstdc++ and libgcc_s are left to the system, and
# CUDA's and NCCL's to that machine. Device code: sm_90 machine code plus
# compute_90 PTX (CMAKE_CUDA_ARCHITECTURES=90).
#
# The build goes to its own folder with the same build type and flags as
# build/, so ccache serves every object that build/ compiled already (the
# objects differ only in their link).
#
# Usage: tools/gpu-bundle.sh [BUNDLE]     (default gpu-bundle)
#        tools/gpu-bundle.sh --check BUNDLE
# --check checks a bundle wherever it lies: under 64 MiB, every library
# that ldd finds comes from the bundle or is one the system keeps, and only
# CUDA's and NCCL's may be missing.
# Environment: PIPEC_GPU_BUILD (build-gpu), PIPEC_JOBS (2).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

limitBytes=$((64 * 1024 * 1024))
# Left to the system: glibc's libraries, the C++ and GCC runtimes.
systemLibs='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libutil|libresolv|libstdc\+\+|libgcc_s)[.-]'
# Brought by the GPU machine (its driver, CUDA's and NCCL's packages).
gpuLibs='^lib(cuda|cudart|cublas|cublasLt|nccl|nvrtc|nvJitLink|nvidia-[a-z-]*)\.so'

die() {
  echo "gpu-bundle: $*" >&2
  exit 1
}

# The ELF files of BUNDLE that ldd checks.
elfFiles() { find "$1/bin" "$1/lib" -type f | sort; }

# checkBundle BUNDLE: the size limit and every library resolved.
checkBundle() {
  local bundle=$1 bytes file line name path bad=0
  [ -x "$bundle/bin/pipec" ] && [ -x "$bundle/bin/GpuTest" ] &&
    [ -f "$bundle/lib/libpipec_cuda_backend.so" ] || die "$bundle: not a bundle (bin/pipec, bin/GpuTest, lib/libpipec_cuda_backend.so)"
  bytes=$(du -sb "$bundle" | cut -f1)
  if [ "$bytes" -ge "$limitBytes" ]; then
    echo "gpu-bundle: $bundle: $bytes bytes, over the 64 MiB ($limitBytes bytes) a run takes along" >&2
    bad=1
  fi
  local real
  real=$(cd "$bundle" && pwd -P)
  while read -r file; do
    while read -r line; do
      case "$line" in
        *"=>"*) ;;
        *) continue ;; # the vdso and the loader
      esac
      name=${line%% =>*}
      path=${line#*=> }
      path=${path%% (*}
      if [[ $name =~ $gpuLibs ]]; then
        continue # found here or not: the GPU machine brings its own
      elif [[ $path == "not found" ]]; then
        echo "gpu-bundle: ${file#"$bundle"/}: $name not found" >&2
        bad=1
      elif [[ $(readlink -f "$path") != "$real"/* ]] && ! [[ $name =~ $systemLibs ]]; then
        echo "gpu-bundle: ${file#"$bundle"/}: $name comes from $path, outside the bundle" >&2
        bad=1
      fi
    done < <(env -u LD_LIBRARY_PATH ldd "$file" 2>&1)
  done < <(elfFiles "$bundle")
  [ $bad = 0 ] || return 1
  echo "gpu-bundle: $bundle: $(elfFiles "$bundle" | wc -l) binaries and libraries, $bytes bytes" \
    "($((bytes * 100 / limitBytes))% of 64 MiB); ldd finds all but CUDA's and NCCL's"
}

if [ "${1:-}" = --check ]; then
  [ $# = 2 ] || die "usage: tools/gpu-bundle.sh --check BUNDLE"
  checkBundle "$2"
  exit
fi
[ $# -le 1 ] || die "usage: tools/gpu-bundle.sh [BUNDLE]"
bundle=${1:-gpu-bundle}
build=${PIPEC_GPU_BUILD:-build-gpu}
jobs=${PIPEC_JOBS:-2}
command -v patchelf >/dev/null || die "patchelf is missing; run tools/install-deps.sh"
[ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null ||
  die "no CUDA toolkit (nvcc): the bundle needs it to build the CUDA backend"

# ccache keys on paths relative to the source root, not on the build folder.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-true}
tools/build-onnx.sh
mkdir -p "$build"
# ONNX's install, hard-linked inside the build folder, so that its include
# path relative to the build folder is build/'s: ccache keys on it (CMake
# would resolve a symbolic link).
if ! cmp -s build/_deps/onnx-install/pipec-onnx.stamp "$build/_deps/onnx-install/pipec-onnx.stamp"; then
  rm -rf "$build/_deps/onnx-install"
  mkdir -p "$build/_deps"
  cp -al build/_deps/onnx-install "$build/_deps/"
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPIPEC_CUDA=ON \
  -DPIPEC_ONNX_ROOT="$(cd "$build" && pwd)/_deps/onnx-install" \
  -DPIPEC_PORTABLE=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DPIPEC_BENCHMARKS=OFF -DPIPEC_TESTS=ON \
  >"$build/configure.log" 2>&1 || { cat "$build/configure.log" >&2; die "configure failed"; }
grep -q 'pipec: CUDA backend ON' "$build/configure.log" ||
  die "configured without the CUDA backend (see $build.configure.log)"
cmake --build "$build" -j "$jobs" --target pipec pipec_cuda_backend GpuTest

rm -rf "$bundle" "$bundle.tar.xz"
mkdir -p "$bundle/bin" "$bundle/lib" "$bundle/tools"
cp "$build/bin/pipec" "$build/tests/GpuTest" "$bundle/bin/"
cp "$build/lib/libpipec_cuda_backend.so" "$bundle/lib/"
# Every library the three need, less the system's and the GPU machine's.
for file in "$build/bin/pipec" "$build/tests/GpuTest" "$build/lib/libpipec_cuda_backend.so"; do
  ldd "$file" | sed -n 's/^\s*\(\S*\) => \(\/\S*\) (.*/\1 \2/p'
done | sort -u | while read -r name path; do
  if ! [[ $name =~ $systemLibs ]] && ! [[ $name =~ $gpuLibs ]]; then
    cp -L "$path" "$bundle/lib/$name"
  fi
done
chmod -R u+w "$bundle"
# Only the static symbol tables and debug information go: pipec's dynamic
# symbols (--export-dynamic), which the plugin binds to, stay.
strip --strip-unneeded "$bundle"/bin/* "$bundle"/lib/*
patchelf --set-rpath '$ORIGIN/../lib' "$bundle"/bin/*
for lib in "$bundle"/lib/*; do patchelf --set-rpath '$ORIGIN' "$lib"; done
cp tools/gpu-check.sh tools/gpu_check_*.py "$bundle/tools/"
# The GPT-2 training fixture and torch's bf16 autocast losses on it
# (tests/fixtures/torch/train/autocast.json).
mkdir -p "$bundle/fixtures/train"
cp -r tests/fixtures/torch/train/gpt2_tied.onnx tests/fixtures/torch/train/gpt2_tied.data \
  tests/fixtures/torch/train/autocast.json "$bundle/fixtures/train/"
# The generation fixtures and transformers' tokens (tests/fixtures/torch/generate).
mkdir -p "$bundle/fixtures/generate"
cp tests/fixtures/torch/generate/*.onnx tests/fixtures/torch/generate/*.npy "$bundle/fixtures/generate/"
# onnxruntime-genai's form (GroupQueryAttention), as genai-llama.*.
for f in tests/fixtures/genai/llama.*; do cp "$f" "$bundle/fixtures/generate/genai-${f##*/}"; done
{
  echo "pipec GPU bundle: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
  echo "built $(date -u +%Y-%m-%dT%H:%MZ) on $(uname -m), CUDA $(/usr/local/cuda/bin/nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), sm_90 + compute_90 PTX"
  echo "needs from the GPU machine: $(for f in "$bundle"/bin/* "$bundle"/lib/*; do
    readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; done | sort -u | grep -E "$gpuLibs" | tr '\n' ' ')"
  echo "needs from the system: glibc $(objdump -T "$bundle"/bin/* "$bundle"/lib/* |
    grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1) or newer, libstdc++ with $(objdump -T "$bundle"/bin/* "$bundle"/lib/* |
    grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)"
  (cd "$bundle" && find bin lib tools fixtures -type f -printf '%10s %p\n' | sort -k2)
} >"$bundle/MANIFEST"
checkBundle "$bundle"
tar -C "$(dirname "$bundle")" -cf - "$(basename "$bundle")" | xz -T2 -6 >"$bundle.tar.xz"
echo "gpu-bundle: wrote $bundle and $bundle.tar.xz ($(du -b "$bundle.tar.xz" | cut -f1) bytes)"
