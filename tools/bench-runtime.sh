#!/usr/bin/env bash
# Runs the CPU executor's benchmarks (build/bin/bench_runtime), prints a table
# and writes it to docs/PERFORMANCE.md (between the BEGIN/END runtime
# markers). Usage: tools/bench-runtime.sh
exec "$(dirname "$0")/bench.sh" runtime
