#!/usr/bin/env bash
# Re-resolve the pinned package sets. Run on purpose (a new release to adopt, a range to move), then run
# .ci/run and commit the lock files with the result:
#   requirements/test.lock    the newest releases today: what scripts/test.sh and scripts/demo.sh install
#   requirements/oldest.lock  the lowest release of every dependency pyproject.toml declares (the floor of
#                             the supported range), with what those need
# Both are for CPython 3.11 on x86-64 Linux with the CPU build of torch; on a GPU machine scripts/_venv.sh
# leaves torch and triton to pip. Needs uv (installed into a scratch virtualenv here).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/uv" && "$tmp/uv/bin/pip" install --quiet uv
echo "torch==2.13.0+cpu" > "$tmp/cpu-torch.txt"  # the CPU build: a local wheel, else PyTorch's CPU index
if ls "${PIP_FIND_LINKS:-/nonexistent}"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  torch_source=(--find-links "$PIP_FIND_LINKS")
else
  torch_source=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi

lock() {  # lock FILE RESOLUTION DESCRIPTION
  local out="$1" resolution="$2" what="$3"
  {
    echo "# $what"
    echo "# Made by scripts/lock.sh on $(date -u +%F) for CPython 3.11, x86-64 Linux, CPU torch; edit by re-running it."
    "$tmp/uv/bin/uv" pip compile pyproject.toml --extra test --resolution "$resolution" --quiet --no-header \
      --no-annotate --python-version 3.11 --python-platform x86_64-manylinux_2_28 -c "$tmp/cpu-torch.txt" \
      "${torch_source[@]}" --index-strategy unsafe-best-match \
      | sed -e 's/^torch==\(.*\)+cpu$/torch==\1/'
  } > "$out"
  echo "[lazoo] wrote $out ($(grep -c '==' "$out") packages)"
}
lock requirements/test.lock highest "The tested set: the newest releases on the day below (scripts/test.sh, scripts/demo.sh)."
lock requirements/oldest.lock lowest-direct "The floor of the supported range: the lowest release of each dependency in pyproject.toml."
