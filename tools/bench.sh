#!/usr/bin/env bash
# Builds and runs pipec's benchmarks, prints a table and writes it to
# docs/PERFORMANCE.md (between the BEGIN/END markers of the import section).
# Usage: tools/bench.sh            (generates ~3 GB of models under build/bench-data once)
#        PIPEC_BENCH_SKIP_HEAVY=1 tools/bench.sh   (skip the 1.5 GB models)
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
tools/build.sh >/dev/null
json=build/bench-compile.json
build/bin/bench_compile --benchmark_min_time=0.5 --benchmark_out="$json" --benchmark_out_format=json
python3 tools/bench_table.py "$json" docs/PERFORMANCE.md
