#!/usr/bin/env bash
# pipec's CPU speed against PyTorch and onnxruntime on the benchmark GPT: the
# table of docs/PERFORMANCE.md's "Against PyTorch and onnxruntime" section.
#
# Creates the virtual environment build/_deps/peers-venv (never used by CI or
# tools/test.sh) and installs the pinned peers from PyPI into it when they are
# missing (PyPI's torch wheel and its CUDA libraries are several GB), then runs
# tools/bench_peers.py in it with the arguments given here.
#
# Usage: tools/bench-peers.sh [--pipec build/bin/pipec] [--rounds 5] [--steps 10]
#                             [--threads N] [--threads-per-rank N] [--rows LIST]
#                             [--workdir build/peers-bench] [--quick] [--write]
#        tools/bench-peers.sh --quick      1 round of 2 steps per row (a smoke test)
#        tools/bench-peers.sh --write      the full run, written to docs/PERFORMANCE.md
#        tools/bench-peers.sh --generate [--rounds 3] [--write]
#                                          generation against transformers' generate
# (tools/bench_peers.py's docstring says what each row measures). It does not
# build pipec: run tools/build.sh first, and nothing else on the machine while
# it measures.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=build/_deps/peers-venv
# The versions tools/fixtures/ made the torch fixtures with (see
# tools/fixtures/_torch_fixture_common.py); onnxscript is torch.onnx's exporter.
pins=(torch==2.15.0 transformers==5.24.0 onnx==1.23.2 onnxruntime==1.32.0
      onnxscript==0.7.2 numpy==2.4.6)

if [ ! -x "$venv/bin/python" ]; then
  if ! python3 -m venv "$venv"; then
    echo "bench-peers: python3 -m venv failed; install python3-venv (tools/install-deps.sh)" >&2
    exit 1
  fi
  echo "bench-peers: created $venv" >&2
fi

missing=()
for pin in "${pins[@]}"; do
  name=${pin%%==*}
  want=${pin#*==}
  have=$("$venv/bin/python" -c \
    "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null || true)
  if [ "$have" != "$want" ]; then
    missing+=("$pin")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "bench-peers: installing ${missing[*]} into $venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${missing[@]}" >&2
  names=("${missing[@]%%==*}")
  echo "bench-peers: installed $("$venv/bin/python" -c "
import importlib.metadata as m, sys
print(', '.join('%s %s' % (n, m.version(n)) for n in sys.argv[1:]))" "${names[@]}")" >&2
else
  echo "bench-peers: $venv has ${pins[*]}" >&2
fi

# --generate: pipec generate against transformers' generate
# (tools/bench_generate.py, docs/PERFORMANCE.md's "Generation" section).
if [ "${1:-}" = --generate ]; then
  shift
  exec "$venv/bin/python" tools/bench_generate.py "$@"
fi
exec "$venv/bin/python" tools/bench_peers.py "$@"
