#!/usr/bin/env bash
# Runs `pipec inspect` on every model of Debian's ONNX test data and checks
# that each one either succeeds (exit 0) or fails cleanly (exit 1, one line),
# never with a signal or another code. Prints a summary.
# Usage: tools/check-onnx-testdata.sh [PIPEC] [DATA_DIR]
set -uo pipefail
pipec="${1:-build/bin/pipec}"
data="${2:-/usr/share/libonnx-testdata/data}"
if [ ! -d "$data" ]; then
  echo "check-onnx-testdata: $data is absent; skipped"
  exit 0
fi
ok=0 clean=0 bad=0
while IFS= read -r -d '' model; do
  out=$("$pipec" inspect "$model" 2>&1 >/dev/null)
  code=$?
  case $code in
    0) ok=$((ok + 1)) ;;
    1)
      if [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ]; then
        clean=$((clean + 1))
      else
        bad=$((bad + 1))
        echo "multi-line error ($model):"
        printf '%s\n' "$out"
      fi
      ;;
    *)
      bad=$((bad + 1))
      echo "exit $code: $model"
      printf '%s\n' "$out" | tail -n 3
      ;;
  esac
done < <(find "$data" -name '*.onnx' -print0 | sort -z)
echo "onnx test data: $ok imported, $clean clean errors, $bad bad exits"
[ "$bad" -eq 0 ]
