#!/usr/bin/env bash
# Runs the CPU executor's benchmarks (build/bin/bench_runtime), prints a table
# and writes it to docs/PERFORMANCE.md (between the BEGIN/END runtime
# markers). Usage: tools/bench-runtime.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
tools/build.sh >/dev/null
json=build/bench-runtime.json
build/bin/bench_runtime --benchmark_min_time=2 --benchmark_out="$json" --benchmark_out_format=json
python3 tools/bench_runtime_table.py "$json" docs/PERFORMANCE.md
