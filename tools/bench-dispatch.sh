#!/usr/bin/env bash
# The executor's cost per node, two builds alternated on one machine:
#   tools/bench-dispatch.sh BEFORE_PIPEC AFTER_PIPEC [ROUNDS]
# `pipec model mlp --layers 2000 --hidden 8` (4,002 nodes of 8-wide Gemm and
# Relu; kernels so small that the step is mostly dispatch), compiled for
# inference on one stage with one microbatch of one sample, run for 300
# steps on one thread, unfused (compiled with --no-fuse by each build), by each build in turn, ROUNDS times (default
# 5). Prints each run's ms per step, then the medians, ns per node and the
# ratio. The Google Benchmark mlp2000x8/dispatch (build/bin/bench_runtime)
# measures the current build alone.
set -euo pipefail
before=$1 after=$2 rounds=${3:-5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$after" model mlp --layers 2000 --hidden 8 -o "$work/mlp.onnx" >/dev/null
# Each build compiles its own plan: a plan is read by the build that wrote
# it, and --no-fuse moved from run to compile (plan format 4).
for which in before after; do
  pipec=${!which}
  if ! "$pipec" compile "$work/mlp.onnx" --mode infer --stages 1 --microbatches 1 --batch 1 \
    --no-fuse -o "$work/$which.plan" >/dev/null 2>&1; then
    "$pipec" compile "$work/mlp.onnx" --mode infer --stages 1 --microbatches 1 --batch 1 \
      -o "$work/$which.plan" >/dev/null
    echo "$which" >>"$work/fuse-at-run"
  fi
done
step() { # WHICH -> ms per step
  local nofuse=()
  grep -qx "$1" "$work/fuse-at-run" 2>/dev/null && nofuse=(--no-fuse)
  # pipec prints the step in ms, or in us below a millisecond.
  "${!1}" run "$work/$1.plan" --steps 300 --threads-per-rank 1 "${nofuse[@]}" 2>&1 |
    awk 'match($0, /: [0-9.]+ [mu]s per step/) {
           split(substr($0, RSTART + 2, RLENGTH - 2), f, " ")
           print (f[2] == "us" ? f[1] / 1000 : f[1])
         }'
}
: >"$work/before" && : >"$work/after"
for r in $(seq "$rounds"); do
  b=$(step before) a=$(step after)
  echo "round $r: before $b ms, after $a ms"
  echo "$b" >>"$work/before" && echo "$a" >>"$work/after"
done
python3 - "$work/before" "$work/after" <<'PY'
import statistics, sys
b, a = (statistics.median(float(x) for x in open(f)) for f in sys.argv[1:3])
print("median ms per step: before %.3f, after %.3f; per node: before %.0f ns, after %.0f ns; "
      "%.2fx faster" % (b, a, b / 4002 * 1e6, a / 4002 * 1e6, b / a))
PY
