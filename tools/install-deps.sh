#!/usr/bin/env bash
# Installs the Debian 12 packages pipec builds and tests with, when missing.
# Runs as root (or through sudo). Safe to run again: it installs only what is
# not there, and refreshes the package lists only when it has to install.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config git patchelf
  libprotobuf-dev protobuf-compiler
  llvm-14-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenblas-dev libxxhash-dev nlohmann-json3-dev
  libopenmpi-dev openmpi-bin
  iproute2
  libonnx-testdata
  clang-format clang-tidy
  python3 python3-venv
  chromium fonts-dejavu-core zlib1g-dev
)

# Wanted by one test each, which skips without them (tools/slurm-test.sh):
# a failure to install them is a warning, not an error.
optional=(slurm-wlm munge)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for p in "${packages[@]}"; do
  installed "$p" || missing+=("$p")
done
missingOptional=()
for p in "${optional[@]}"; do
  installed "$p" || missingOptional+=("$p")
done

if [ ${#missing[@]} -eq 0 ] && [ ${#missingOptional[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]} ${missingOptional[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
if [ ${#missing[@]} -gt 0 ]; then
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [ ${#missingOptional[@]} -gt 0 ]; then
  $sudo apt-get install -y -qq --no-install-recommends "${missingOptional[@]}" >/dev/null ||
    echo "install-deps: could not install ${missingOptional[*]}; the tests that need them skip" >&2
fi
