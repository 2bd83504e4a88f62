#!/usr/bin/env bash
# check-gpu-bundle.sh - the GpuBundle test (ctest -L gpu-bundle), on a
# machine with the CUDA toolkit and no GPU:
#   1. tools/gpu-bundle.sh builds the bundle (gpu-bundle/ and its .tar.xz);
#   2. the .tar.xz is unpacked into an empty temporary folder, with no build
#      tree beside it, and checked there: under 64 MiB and ldd resolves all
#      but CUDA's and NCCL's libraries (gpu-bundle.sh --check);
#   3. from there: pipec --version, GpuTest --gtest_list_tests (with the
#      bf16 MatMulBias case), the CUDA plugin loads (run --backend cuda ends
#      with "no CUDA device" here), and tools/gpu-check.sh --dry-run passes
#      in under 3 minutes.
# CUDA's own libraries come from the toolkit here (/usr/local/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

fail() {
  echo "check-gpu-bundle: $*" >&2
  exit 1
}

tools/gpu-bundle.sh gpu-bundle
tmp=$(mktemp -d "${TMPDIR:-/tmp}/pipec-bundle.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
tar -C "$tmp" -xJf gpu-bundle.tar.xz
cd "$tmp"
bundle=$tmp/gpu-bundle
"$root/tools/gpu-bundle.sh" --check "$bundle"

export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib
version=$("$bundle/bin/pipec" --version) || fail "pipec --version failed"
echo "$version"
grep -q '^  cuda      runtime' <<<"$version" || fail "pipec --version reports no CUDA runtime"
tests=$("$bundle/bin/GpuTest" --gtest_list_tests) || fail "GpuTest --gtest_list_tests failed"
echo "GpuTest lists $(grep -c '^  ' <<<"$tests") tests"
grep -q 'Bf16MatMulBiasRunsInTheEpilogue' <<<"$tests" || fail "GpuTest lacks the bf16 MatMulBias case"

# The plugin resolves every symbol (dlopen RTLD_NOW) and reaches the device
# check: without a GPU that is the error, with one the run.
"$bundle/bin/pipec" model mlp --layers 2 --hidden 16 --loss -o "$tmp/mlp.onnx" >/dev/null
"$bundle/bin/pipec" compile "$tmp/mlp.onnx" -o "$tmp/mlp.plan" --stages 1 >/dev/null
set +e
out=$("$bundle/bin/pipec" run "$tmp/mlp.plan" --backend cuda --steps 1 2>&1)
rc=$?
set -e
echo "$out"
if [ $rc != 0 ] && ! grep -q 'no CUDA device' <<<"$out"; then
  fail "pipec run --backend cuda did not get as far as the device: $out"
fi
grep -q 'CPU fallbacks:' <<<"$out" || [ $rc != 0 ] ||
  fail "pipec run --backend cuda printed no 'CPU fallbacks:' in its summary"

started=$SECONDS
"$bundle/tools/gpu-check.sh" --dry-run "$bundle" "$tmp/results" ||
  fail "gpu-check.sh --dry-run failed (table above)"
took=$((SECONDS - started))
[ "$(find "$tmp/results" -type f | wc -l)" -le 8 ] || fail "gpu-check.sh wrote more than 8 files"
[ $took -lt 180 ] || fail "gpu-check.sh --dry-run took ${took}s, over 3 minutes"
echo "check-gpu-bundle: the bundle runs from $tmp; gpu-check.sh --dry-run passed in ${took}s"
