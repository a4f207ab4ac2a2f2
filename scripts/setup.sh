#!/usr/bin/env bash
# Set up a fresh machine: OpenBLAS on Linux (MLX's CPU wheel is 20-40x slower without it),
# a virtual environment in .venv, and the package with its test and serve extras. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = "Linux" ] && ! ls /usr/lib/*/libopenblas.so.0 /usr/lib64/libopenblas.so.0 >/dev/null 2>&1; then
  echo "setup: installing OpenBLAS (libopenblas0-pthread)"
  SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null
fi

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[test,serve]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import dflash2_mlx" || { echo "setup: install failed" >&2; exit 1; }
echo "setup: ready (.venv)"
