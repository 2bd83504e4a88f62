#!/usr/bin/env bash
# Installs what is missing, builds incrementally in build/, installs the
# tests' pinned oracles (numpy, onnx, onnxruntime: tools/oracles.sh), runs
# every test,
# then checks the naming style of the C++ files the change touches
# (tools/check_naming.py: clang-tidy with the repository's .clang-tidy, over
# the files changed since the merge-base with origin/main, else HEAD~1).
#
# tools/test.sh --asan builds a -fsanitize=address,undefined configuration in
# build-asan/ (without CUDA; the ONNX build of build/_deps is shared) and runs
# every test under it: any sanitizer report fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--asan" ]; then
  tools/build-onnx.sh
  tools/fetch-openblas.sh
  san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  if [ ! -f build-asan/build.ninja ]; then
    cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPIPEC_CUDA=OFF \
      -DCMAKE_C_FLAGS="$san" -DCMAKE_CXX_FLAGS="$san" \
      -DCMAKE_EXE_LINKER_FLAGS="$san" -DCMAKE_SHARED_LINKER_FLAGS="$san" >/dev/null
  fi
  cmake --build build-asan -j "${PIPEC_JOBS:-2}"
  tools/oracles.sh
  # The conformance, control-flow and torch-parity tests run the sanitized
  # pipec beside the oracles of build/.
  mkdir -p build-asan/_deps
  ln -sfn "$PWD/build/_deps/oracles" build-asan/_deps/oracles
  # Leaks at exit are not errors here (protobuf and ONNX keep static
  # registries); every other report is. An allocation too big for the
  # machine returns null, as malloc does, so pipec's own error is tested.
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1 \
    UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j "${PIPEC_JOBS:-2}"
  exit 0
fi
tools/install-deps.sh
tools/build.sh
tools/oracles.sh
ctest --test-dir build --output-on-failure -j "${PIPEC_JOBS:-2}"
python3 tools/check_naming.py --build build
