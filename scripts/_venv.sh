#!/usr/bin/env bash
# Creates (or reuses) the project virtualenv and installs lazoo with the given extras, pinned by a lock file.
# Sourced by demo.sh, test.sh and test_range.sh. Usage: source scripts/_venv.sh "test"
#   LAZOO_VENV  the virtualenv folder (default .venv)
#   LAZOO_LOCK  the pinned set to install (default requirements/test.lock, made by scripts/lock.sh);
#               "none" installs the newest releases pip finds (what .ci/run checks as the range's top)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LAZOO_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
LOCK="${LAZOO_LOCK:-$ROOT/requirements/test.lock}"
[ "$LOCK" = "none" ] && LOCK=""

if [ ! -x "$VENV/bin/python" ]; then
  echo "[lazoo] creating virtualenv in $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

gpu=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then gpu=1; fi

stamp="$VENV/.lazoo-installed-${EXTRAS:-base}"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] || { [ -n "$LOCK" ] && [ "$LOCK" -nt "$stamp" ]; }; then
  python -m pip install --quiet --upgrade pip
  pins=()
  if [ -n "$LOCK" ]; then
    echo "[lazoo] installing the pinned set of ${LOCK#"$ROOT"/}"
    if [ -n "$gpu" ]; then  # the lock pins the CPU build's torch and triton: let pip pair a CUDA torch with its triton
      grep -v -E '^(torch|triton)==' "$LOCK" > "$VENV/lock-without-torch.txt"
      pins=(-c "$VENV/lock-without-torch.txt")
    else
      pins=(-c "$LOCK")
    fi
  fi
  if ! python -c "import torch" >/dev/null 2>&1; then
    if [ -n "$gpu" ]; then
      echo "[lazoo] GPU found: installing torch with CUDA"
      python -m pip install --quiet "${pins[@]}" "torch>=2.11"
    else
      # Never pull a multi-GB CUDA build onto a CPU machine: use a local CPU wheel if one
      # is provided (PIP_FIND_LINKS), else PyTorch's CPU index.
      echo "[lazoo] no GPU: installing the CPU build of torch"
      wheel="$(ls "${PIP_FIND_LINKS:-/nonexistent}"/torch-*+cpu-*.whl 2>/dev/null | head -n 1 || true)"
      if [ -n "$wheel" ]; then
        version="$(basename "$wheel" | cut -d- -f2)"
        python -m pip install --quiet "${pins[@]}" "torch==${version%+cpu}"
      else
        python -m pip install --quiet "${pins[@]}" "torch>=2.11" --index-url https://download.pytorch.org/whl/cpu
      fi
    fi
  fi
  spec="$ROOT"
  [ -n "$EXTRAS" ] && spec="$ROOT[$EXTRAS]"
  echo "[lazoo] installing lazoo${EXTRAS:+[$EXTRAS]} (editable)"
  python -m pip install --quiet "${pins[@]}" -e "$spec"
  if [ "$EXTRAS" = "test" ] || [ "$EXTRAS" = "vision" ]; then
    # aerial tree images with boxes (lazoo.data.vision); its own dependencies (a detection stack) are not needed
    python -m pip install --quiet --no-deps "deepforest==2.1.0"
  fi
  if [ "$EXTRAS" = "test" ]; then
    # fla 0.6.0's model classes (CPU-constructible) write the fla-format checkpoints the converter tests read;
    # kept in a folder of its own, outside the importable packages: never a lazoo dependency
    python -m pip install --quiet --no-deps --target "$VENV/fla-site" --upgrade \
      "flash-linear-attention==0.6.0" "fla-core==0.6.0" "einops==0.8.2"
  fi
  touch "$stamp"
fi
