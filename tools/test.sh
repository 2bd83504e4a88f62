#!/usr/bin/env bash
# Installs what is missing, builds incrementally in build/, runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
tools/build.sh
ctest --test-dir build --output-on-failure -j "${PIPEC_JOBS:-2}"
