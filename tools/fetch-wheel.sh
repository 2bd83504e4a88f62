#!/usr/bin/env bash
# Downloads one pinned wheel from PyPI into build/_deps/WHEEL, with the pip
# of build/_deps/venv (made when missing: Debian's python3 has no pip), and
# checks it against its sha256. A wheel already there that matches is kept.
# Usage: tools/fetch-wheel.sh REQUIREMENT WHEEL SHA256 (the fetch-*.sh scripts)
set -euo pipefail
cd "$(dirname "$0")/.."
requirement=$1 wheel=$2 sha256=$3
deps=build/_deps
mkdir -p "$deps"
venv=$deps/venv
if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  rm -rf "$venv"
  /usr/bin/python3 -m venv "$venv"
fi
if [ -f "$deps/$wheel" ] && echo "$sha256  $deps/$wheel" | sha256sum -c --status; then
  exit 0
fi
dl=$deps/wheel-dl
rm -rf "$dl" "${deps:?}/$wheel"
"$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: \
  "$requirement" -d "$dl"
mv "$dl/$wheel" "$deps/$wheel"
rm -rf "$dl"
echo "$sha256  $deps/$wheel" | sha256sum -c --status ||
  { echo "fetch-wheel: $deps/$wheel does not match its pinned sha256" >&2; exit 1; }
