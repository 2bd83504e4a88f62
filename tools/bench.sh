#!/usr/bin/env bash
# Builds and runs one of pipec's benchmarks, prints a table and writes it to
# docs/PERFORMANCE.md (between the BEGIN/END markers of its section).
# Usage: tools/bench.sh            import and compile (generates ~3 GB of models
#                                  under build/bench-data once)
#        PIPEC_BENCH_SKIP_HEAVY=1 tools/bench.sh   (skip the 1.5 GB models)
#        tools/bench.sh runtime    the CPU executor (as tools/bench-runtime.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:-compile}
case "$which" in
  compile) min_time=0.5 table=tools/bench_table.py ;;
  runtime) min_time=2 table=tools/bench_runtime_table.py ;;
  *) echo "usage: tools/bench.sh [compile|runtime]" >&2; exit 2 ;;
esac
tools/install-deps.sh
tools/build.sh >/dev/null
json=build/bench-$which.json
# The runtime rows compare measured steps with the `cpu` spec's prediction:
# calibrate it afresh in this run, on the machine as it is now.
if [ "$which" = runtime ]; then
  PIPEC_CACHE_DIR=$(mktemp -d)
  export PIPEC_CACHE_DIR
  trap 'rm -rf "$PIPEC_CACHE_DIR"' EXIT
fi
build/bin/bench_"$which" --benchmark_min_time=$min_time --benchmark_out="$json" \
  --benchmark_out_format=json
python3 "$table" "$json" docs/PERFORMANCE.md
