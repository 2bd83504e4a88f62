#!/usr/bin/env bash
# Builds ONNX's C++ libraries (onnx, onnx_proto: static, -fPIC, ONNX_ML=1,
# namespace onnx, full protobuf) from the pinned PyPI sdist against Debian's
# protobuf (libprotobuf-dev, protobuf-compiler) into build/_deps/onnx-install.
# A pip-installed CMake in build/_deps/venv is used (ONNX wants CMake >= 3.26).
# Runs as root (like tools/install-deps.sh). Safe to run again: it exits at once
# when the stamp says this version is installed. Jobs: PIPEC_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."

onnx_version=1.23.2
onnx_sha256=008cb0467b2bbee41448acc7da8b6f4e704624cb0d327a2d5adafc7ce19bc5b8
cmake_version=3.31.10
jobs="${PIPEC_JOBS:-2}"

deps=build/_deps
venv=$deps/venv
sdist=$deps/onnx-$onnx_version.tar.gz
src=$deps/onnx-$onnx_version
bld=$deps/onnx-build
prefix=$deps/onnx-install
stamp=$prefix/pipec-onnx.stamp
log=$deps/onnx-build.log

protoc=$(command -v protoc || true)
if [ -z "$protoc" ] || [ ! -f /usr/include/google/protobuf/message.h ]; then
  echo "build-onnx: Debian's protobuf is missing; run tools/install-deps.sh" >&2
  exit 1
fi
# Everything that changes the result: rebuild when any of it differs.
recipe="onnx $onnx_version sha256 $onnx_sha256; $($protoc --version); static pic ml full ns=onnx"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$recipe" ]; then
  echo "build-onnx: onnx $onnx_version already in $prefix"
  exit 0
fi

start=$SECONDS
mkdir -p "$deps"
: >"$log"
trap 'echo "build-onnx: failed; see $log" >&2; tail -n 20 "$log" >&2' ERR

# CMake from PyPI in a venv (Debian 12's CMake is 3.25).
python=/usr/bin/python3
[ -x "$python" ] || python=python3
if ! "$venv/bin/python" -c '' 2>/dev/null; then
  rm -rf "$venv"
  "$python" -m venv "$venv" >>"$log" 2>&1
fi
if [ "$("$venv/bin/cmake" --version 2>/dev/null | head -n1)" != "cmake version $cmake_version" ]; then
  "$venv/bin/pip" install -q --disable-pip-version-check "cmake==$cmake_version" >>"$log" 2>&1
fi

# The sdist (full C++ tree and CMake), checked against its pinned hash.
if [ ! -f "$sdist" ] || ! echo "$onnx_sha256  $sdist" | sha256sum -c --status; then
  rm -rf "$deps/onnx-dl" "$sdist"
  "$venv/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary onnx \
    "onnx==$onnx_version" -d "$deps/onnx-dl" >>"$log" 2>&1
  mv "$deps/onnx-dl/onnx-$onnx_version.tar.gz" "$sdist"
  rm -rf "$deps/onnx-dl"
  echo "$onnx_sha256  $sdist" | sha256sum -c --status ||
    { echo "build-onnx: $sdist does not match its pinned sha256" >&2; exit 1; }
fi
rm -rf "$src" "$bld" "$prefix"
tar -xzf "$sdist" -C "$deps"

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
generator=()
if command -v ninja >/dev/null; then
  generator=(-G Ninja)
fi
# Shared Debian protobuf: a static libprotobuf next to pipec's shared one would
# register the descriptors twice. FETCHCONTENT_FULLY_DISCONNECTED: fail rather
# than download protobuf/abseil should Debian's not be found.
"$venv/bin/cmake" -S "$src" -B "$bld" "${generator[@]}" "${launcher[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_INSTALL_PREFIX="$PWD/$prefix" \
  -DCMAKE_INSTALL_LIBDIR=lib \
  -DBUILD_SHARED_LIBS=OFF \
  -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
  -DONNX_ML=ON \
  -DONNX_NAMESPACE=onnx \
  -DONNX_USE_LITE_PROTO=OFF \
  -DONNX_USE_PROTOBUF_SHARED_LIBS=ON \
  -DONNX_BUILD_CUSTOM_PROTOBUF=OFF \
  -DONNX_BUILD_PYTHON=OFF \
  -DONNX_BUILD_TESTS=OFF \
  -DONNX_VERIFY_PROTO3=OFF \
  -DONNX_DISABLE_STATIC_REGISTRATION=OFF \
  -DONNX_WERROR=OFF \
  -DProtobuf_PROTOC_EXECUTABLE="$protoc" \
  -DPython3_EXECUTABLE="$PWD/$venv/bin/python" \
  -DFETCHCONTENT_FULLY_DISCONNECTED=ON >>"$log" 2>&1
"$venv/bin/cmake" --build "$bld" -j "$jobs" >>"$log" 2>&1
"$venv/bin/cmake" --install "$bld" >>"$log" 2>&1
# ONNX installs only headers; plan.proto imports "onnx/onnx-ml.proto", so the
# generated .proto files (the ones compiled into onnx_proto) go next to them.
cp "$bld"/onnx/*.proto "$prefix/include/onnx/"
echo "$recipe" >"$stamp"
echo "build-onnx: built onnx $onnx_version into $prefix in $((SECONDS - start)) s"
