#!/usr/bin/env bash
# Installs the tests' numerical oracles, pinned, into build/_deps/oracles (a
# venv): numpy, onnx (its node test cases), onnxruntime (the reference
# runtime), safetensors (the checkpoint format's reference reader and
# writer) and tensorboard (the reader of `run --tensorboard`'s event
# files). tools/test.sh runs it; the conformance test skips without it.
# Safe to run again: it exits at once when the pins are installed.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=build/_deps/oracles
pins=(numpy==2.4.6 onnx==1.23.2 onnxruntime==1.32.0 safetensors==0.8.0 tensorboard==2.21.0)
stamp=$venv/pipec-oracles.stamp
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ] && "$venv/bin/python" -c '' 2>/dev/null
then
  exit 0
fi
python=/usr/bin/python3
[ -x "$python" ] || python=python3
rm -rf "$venv"
mkdir -p build/_deps
"$python" -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "${pins[@]}"
echo "${pins[*]}" >"$stamp"
echo "oracles: ${pins[*]} in $venv"
