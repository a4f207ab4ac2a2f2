#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv and the package with its test, serve
# and vision extras.
# Safe to re-run, offline once the packages are cached, and without root when a fast BLAS is
# there. MLX's Linux CPU wheel runs float32 matmuls 20-40x slower on its bundled BLAS: on
# x86-64 Linux the package depends on Intel MKL from PyPI (no root needed); on other Linux
# machines Debian's OpenBLAS is installed with apt-get only when no copy is found.
# DFLASH2_BLAS=openblas makes it check for (and if need be install) OpenBLAS on x86-64 too.
# `bash scripts/setup.sh --blas-only` makes the BLAS decision and stops (used by the tests).
set -euo pipefail
cd "$(dirname "$0")/.."

find_openblas() {
  # Debian keeps it in openblas-<flavour>/ behind an update-alternatives link; test each path
  # on its own (one `ls` over several paths fails when any one of them is absent).
  local arch; arch="$(uname -m)-linux-gnu"
  for f in "/usr/lib/$arch/libopenblas.so.0" "/usr/lib/$arch"/openblas-*/libopenblas.so.0 \
           /usr/lib64/libopenblas.so.0 /usr/lib/libopenblas.so.0; do
    [ -e "$f" ] && { echo "$f"; return 0; }
  done
  return 1
}

if [ "$(uname -s)" = "Linux" ]; then
  if [ "$(uname -m)" = "x86_64" ] && [ "${DFLASH2_BLAS:-auto}" != "openblas" ]; then
    echo "setup: BLAS: Intel MKL from PyPI (a dependency on x86-64 Linux)"
  elif lib="$(find_openblas)"; then
    echo "setup: BLAS: OpenBLAS at $lib"
  else
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo -n"
    echo "setup: BLAS: installing OpenBLAS (libopenblas0-pthread)"
    if ! { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq libopenblas0-pthread >/dev/null; }; then
      echo "setup: could not install OpenBLAS (no root or offline); float32 matmuls will be" \
           "20-40x slower until: sudo apt-get install -y libopenblas0-pthread" >&2
    fi
  fi
fi
[ "${1:-}" = "--blas-only" ] && exit 0

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# Re-runs with an unchanged pyproject.toml install nothing, so they work offline.
stamp="$(sha256sum pyproject.toml | cut -c1-16) $PWD"
if [ "$(cat .venv/.dflash2-setup 2>/dev/null)" = "$stamp" ] && .venv/bin/python -c "import dflash2_mlx, pytest, fastapi, mlx_dspark, mlx_vlm" 2>/dev/null; then
  echo "setup: ready (.venv, already installed)"
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[test,serve,vision]" 2>&1 | grep -v "^WARNING: Location" || true
# The tests' DSpark oracle (tests/test_dspark.py), an independent MLX implementation; without
# its own dependencies (the test lends it mlx-lm's RoPE helper).
.venv/bin/python -m pip install -q --no-deps mlx-dspark==0.20.3 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import dflash2_mlx" || { echo "setup: install failed" >&2; exit 1; }
echo "$stamp" > .venv/.dflash2-setup
echo "setup: ready (.venv)"
