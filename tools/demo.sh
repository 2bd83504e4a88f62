#!/usr/bin/env bash
# The main job: install what is missing, build, generate a GPT, inspect it,
# compile it for 4 pipeline stages with the default schedule, print the
# partition report, write report.html, then train it for a few steps on 4 CPU
# ranks (threads of one process) and write the measured timeline.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
tools/build.sh
mkdir -p out
pipec=build/bin/pipec
echo
echo "== 1. generate a 12-layer GPT (hidden 256, vocab 8000, seq 128): out/gpt-12l.onnx"
$pipec model gpt --layers 12 --hidden 256 --heads 8 --vocab 8000 --seq 128 --loss -o out/gpt-12l.onnx
echo
echo "== 2. pipec inspect out/gpt-12l.onnx"
$pipec inspect out/gpt-12l.onnx
$pipec inspect out/gpt-12l.onnx --format json -o out/gpt-12l.inspect.json
echo
echo "== 3. pipec compile for 4 stages (1F1B, H100 cost model) -> out/gpt-12l.plan"
$pipec compile out/gpt-12l.onnx -o out/gpt-12l.plan --stages 4
echo
echo "== 4. pipec report: the partition, the simulated timeline and the balancing comparison"
$pipec report out/gpt-12l.plan
$pipec report out/gpt-12l.plan --format html -o out/report.html
$pipec simulate out/gpt-12l.plan --trace out/trace.json > /dev/null
echo
echo "== 5. train: compile for 4 CPU ranks (1F1B, 8 microbatches of 1) and run 3 steps"
echo "   (synthetic token ids are uniform: the loss starts near ln(8000) = 8.99 and has little to"
echo "    learn; pipec run --data DIR trains on real data)"
$pipec compile out/gpt-12l.onnx -o out/gpt-12l-cpu.plan --stages 4 --hardware cpu --batch 8 \
  --microbatches 8
$pipec run out/gpt-12l-cpu.plan --steps 3 --trace out/run-trace.json --save-weights out/gpt-12l-trained.onnx
$pipec report out/gpt-12l-cpu.plan --trace out/run-trace.json --format html -o out/run-report.html
echo
echo "outputs:"
echo "  out/gpt-12l.onnx              the generated model"
echo "  out/gpt-12l.inspect.json      its layer table as JSON"
echo "  out/gpt-12l.plan              the compiled plan (pipec report / simulate read it)"
echo "  out/report.html               the partition report with the timeline; open it in a browser"
echo "  out/trace.json                the simulated timeline for chrome://tracing or ui.perfetto.dev"
echo "  out/gpt-12l-cpu.plan          the plan for 4 CPU ranks that step 5 ran"
echo "  out/run-trace.json            the measured timeline of those steps, in the same format"
echo "  out/run-report.html           the CPU plan's report with the measured last step under the simulated one"
echo "  out/gpt-12l-trained.onnx      the model after 3 training steps"
