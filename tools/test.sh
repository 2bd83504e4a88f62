#!/usr/bin/env bash
# Installs what is missing, builds incrementally in build/, installs the
# tests' pinned oracles (numpy, onnx, onnxruntime: tools/oracles.sh), runs
# every test,
# then checks the naming style of the C++ files the change touches
# (tools/check_naming.py: clang-tidy with the repository's .clang-tidy, over
# the files changed since the merge-base with origin/main, else HEAD~1).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
tools/build.sh
tools/oracles.sh
ctest --test-dir build --output-on-failure -j "${PIPEC_JOBS:-2}"
python3 tools/check_naming.py --build build
