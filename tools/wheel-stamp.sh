# Sourced, from the repository root, by the scripts that unpack a pinned PyPI wheel into
# build/_deps/NAME (tools/fetch-mkl.sh, tools/fetch-openblas.sh). The stamp such a script
# writes there when it has finished names the wheel's sha256, so that running it again with
# the same pin costs nothing.
deps=build/_deps
python=$deps/venv/bin/python # the venv tools/fetch-wheel.sh makes

# skip_if_unpacked NAME SHA256: sets prefix (build/_deps/NAME) and stamp, and exits the
# script (0) when the stamp names SHA256: that wheel is unpacked there already.
skip_if_unpacked() {
  prefix=$deps/$1
  stamp=$prefix/pipec-$1.stamp
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$2" ]; then
    exit 0
  fi
}

# mark_unpacked SHA256: the last step of a script, once the wheel is unpacked into prefix.
mark_unpacked() {
  echo "$1" >"$stamp"
}
