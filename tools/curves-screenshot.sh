#!/usr/bin/env bash
# Makes docs/curves.png, the training curves of the HTML partition report:
# compiles the tiny GPT-2 of tests/fixtures/torch/stream for 2 CPU stages and
# 4 microbatches, trains it for 200 steps on train.bin with an evaluation on
# eval.bin every 25 steps, writes the report with the run's metrics, and
# renders it with headless chromium.
#
# Usage: tools/curves-screenshot.sh [PIPEC] [OUT.png]
#   PIPEC    the pipec binary (default: build/bin/pipec)
#   OUT.png  the screenshot to write (default: docs/curves.png)
#
# Needs chromium (tools/install-deps.sh installs it). Everything but the
# screenshot is written to a temporary folder, removed on exit.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
pipec="${1:-$root/build/bin/pipec}"
out="${2:-$root/docs/curves.png}"
fixture="$root/tests/fixtures/torch/stream"

fail() {
  echo "curves-screenshot: $*" >&2
  exit 1
}

[ -x "$pipec" ] || fail "no pipec binary at $pipec (build it, or pass its path)"
command -v chromium >/dev/null ||
  fail "chromium is not installed (tools/install-deps.sh installs it)"
for file in model.onnx train.bin eval.bin; do
  [ -f "$fixture/$file" ] || fail "missing $fixture/$file"
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
plan="$tmp/stream.plan"
metrics="$tmp/run.jsonl"
html="$tmp/report.html"
png="$tmp/curves.png"

"$pipec" compile "$fixture/model.onnx" --hardware cpu --stages 2 --microbatches 4 -o "$plan"
"$pipec" run "$plan" --data "$fixture/train.bin" --eval-data "$fixture/eval.bin" \
  --eval-every 25 --eval-steps 4 --steps 200 --metrics "$metrics" --quiet
[ -s "$metrics" ] || fail "pipec run wrote no metrics"
"$pipec" report "$plan" --format html --metrics "$metrics" -o "$html"
grep -q '<h2>Training curves</h2>' "$html" || fail "the report has no training curves"

# 2000 pixels: the summary and the pipeline timeline, then the three charts.
if ! (cd "$tmp" && timeout 120 chromium --headless --no-sandbox --disable-gpu \
  --hide-scrollbars --window-size=1400,2000 --screenshot="$png" "file://$html") \
  >"$tmp/chromium.log" 2>&1 || [ ! -s "$png" ]; then
  cat "$tmp/chromium.log" >&2
  fail "chromium wrote no screenshot"
fi
mkdir -p "$(dirname "$out")"
cp "$png" "$out"
echo "curves-screenshot: wrote $out"
