#!/usr/bin/env bash
# A long fuzz run: tools/fuzz.sh [MUTANTS] [SEED] (default 20000 mutants, a
# random seed, printed so that a failure can be replayed). Failing inputs
# are kept in build/fuzz-failures/.
set -euo pipefail
cd "$(dirname "$0")/.."
mutants="${1:-20000}"
seed="${2:-$RANDOM$RANDOM}"
echo "fuzz: seed $seed"
exec python3 tools/fuzz.py --pipec build/bin/pipec --mutants "$mutants" --seed "$seed" \
  --keep build/fuzz-failures
