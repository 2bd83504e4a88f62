#!/usr/bin/env bash
# The main job on a bundled model: install what is missing, build, generate
# the bundled GPT and inspect it (layers, params, FLOPs, boundary bytes).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
tools/build.sh
mkdir -p out
echo
echo "== generating a 12-layer GPT (hidden 256, vocab 8000) as out/gpt-12l.onnx"
build/bin/pipec model gpt --layers 12 --hidden 256 --heads 8 --vocab 8000 --seq 128 -o out/gpt-12l.onnx
echo
echo "== pipec inspect out/gpt-12l.onnx"
build/bin/pipec inspect out/gpt-12l.onnx
build/bin/pipec inspect out/gpt-12l.onnx --format json -o out/gpt-12l.inspect.json
echo
echo "== the bundled ResNet-50 layout, grouped from its ONNX graph"
build/bin/pipec inspect models/bundled/resnet50-w8.onnx | head -n 30
echo
echo "outputs: out/gpt-12l.onnx, out/gpt-12l.inspect.json"
