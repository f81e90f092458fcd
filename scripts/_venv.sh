#!/usr/bin/env bash
# Creates (or reuses) the project virtualenv in .venv and installs lazoo with the given extras.
# Sourced by demo.sh and test.sh. Usage: source scripts/_venv.sh "test"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LAZOO_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[lazoo] creating virtualenv in $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

stamp="$VENV/.lazoo-installed-${EXTRAS:-base}"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
  python -m pip install --quiet --upgrade pip
  if ! python -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
      echo "[lazoo] GPU found: installing torch with CUDA"
      python -m pip install --quiet "torch>=2.11"
    else
      # Never pull a multi-GB CUDA build onto a CPU machine: use a local CPU wheel if one
      # is provided (PIP_FIND_LINKS), else PyTorch's CPU index.
      echo "[lazoo] no GPU: installing the CPU build of torch"
      if ls "${PIP_FIND_LINKS:-/nonexistent}"/torch-*+cpu-*.whl >/dev/null 2>&1; then
        python -m pip install --quiet "torch==2.13.0"
      else
        python -m pip install --quiet "torch>=2.11" --index-url https://download.pytorch.org/whl/cpu
      fi
    fi
  fi
  spec="$ROOT"
  [ -n "$EXTRAS" ] && spec="$ROOT[$EXTRAS]"
  echo "[lazoo] installing lazoo${EXTRAS:+[$EXTRAS]} (editable)"
  python -m pip install --quiet -e "$spec"
  if [ "$EXTRAS" = "test" ] || [ "$EXTRAS" = "vision" ]; then
    # aerial tree images with boxes (lazoo.data.vision); its own dependencies (a detection stack) are not needed
    python -m pip install --quiet --no-deps "deepforest==2.1.0"
  fi
  touch "$stamp"
fi
