#!/usr/bin/env bash
# Build what a maintainer publishes, into dist/ (emptied first), with no Docker:
#   - the sdist;
#   - manylinux2014 (glibc 2.17) abi3 wheels for x86_64 and aarch64, whose C
#     pass is cross-compiled by zig (PyPI's ziglang) against glibc 2.17;
#   - a pure py3-none-any wheel for every other platform (the Python path).
# DIST_OUT: another folder than dist/ (the tests build into their own).
# Then it checks them: auditwheel show (the manylinux2014 tag), abi3audit,
# twine check and check-wheel-contents. The tools go into a venv of their
# own (DIST_VENV, default build/dist-venv), created on first use.
#
# Publish (a maintainer, after a clean run): twine upload dist/*
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
DIST_VENV=${DIST_VENV:-$ROOT/build/dist-venv}
OUT=${DIST_OUT:-$ROOT/dist}
# The oldest glibc the binary wheels load on: manylinux2014's.
GLIBC=2.17
ARCHES=(x86_64 aarch64)

if [ ! -x "$DIST_VENV/bin/python" ]; then
  "$PYTHON" -m venv "$DIST_VENV"
fi
"$DIST_VENV/bin/pip" install -q --disable-pip-version-check \
  "setuptools>=68" wheel build ziglang auditwheel abi3audit twine check-wheel-contents
PY="$DIST_VENV/bin/python"

rm -rf "$OUT" build/lib* build/temp* build/bdist*
mkdir -p "$OUT"

echo "build-dist: sdist and the pure wheel"
"$PY" -m build --sdist --outdir "$OUT" --no-isolation . >/dev/null
OTEL_SPECDEC_PURE=1 "$PY" -m build --wheel --outdir "$OUT" --no-isolation . >/dev/null
rm -rf build/lib* build/temp* build/bdist*

# The C pass for each architecture: zig compiles and links for
# <arch>-linux-gnu.<glibc>; Python's headers are the same for both (the
# limited API has no architecture-dependent layout the source reads).
ZIG_WRAPPERS=$(mktemp -d)
trap 'rm -rf "$ZIG_WRAPPERS"' EXIT
for arch in "${ARCHES[@]}"; do
  echo "build-dist: manylinux2014 abi3 wheel for $arch"
  cc="$ZIG_WRAPPERS/cc-$arch"
  printf '#!/bin/sh\nexec "%s" -m ziglang cc -target %s-linux-gnu.%s "$@"\n' \
    "$PY" "$arch" "$GLIBC" > "$cc"
  chmod +x "$cc"
  CC="$cc" LDSHARED="$cc -shared -s" OTEL_SPECDEC_REQUIRE_C=1 \
    "$PY" setup.py -q bdist_wheel --plat-name "manylinux2014_$arch" \
      --dist-dir "$OUT" >/dev/null
  rm -rf build/lib* build/temp* build/bdist*
done

echo "build-dist: checks"
for wheel in "$OUT"/*manylinux2014*.whl; do
  "$DIST_VENV/bin/auditwheel" show "$wheel" | tr '\n' ' ' | grep -q "manylinux_2_17" \
    || { echo "build-dist: auditwheel does not give $wheel manylinux2014" >&2; exit 1; }
  "$DIST_VENV/bin/abi3audit" --strict --assume-minimum-abi3 3.10 "$wheel" >/dev/null
done
"$DIST_VENV/bin/twine" check --strict "$OUT"/*
"$DIST_VENV/bin/check-wheel-contents" "$OUT"/*.whl >/dev/null
ls -1 "$OUT"
