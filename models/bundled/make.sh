#!/usr/bin/env bash
# Regenerates the small bundled models with pipec's own generators. The files
# are deterministic: the same pipec gives byte-identical models.
set -euo pipefail
cd "$(dirname "$0")/../.."
pipec=build/bin/pipec
$pipec model gpt --layers 4 --hidden 64 --heads 4 --vocab 512 --seq 32 -o models/bundled/gpt-4l.onnx
$pipec model resnet --layers 16 --hidden 8 --seq 64 --vocab 100 -o models/bundled/resnet50-w8.onnx
$pipec model llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 512 --seq 32 --tied \
  -o models/bundled/llama-2l-tied.onnx
