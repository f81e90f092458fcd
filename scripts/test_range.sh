#!/usr/bin/env bash
# The two ends of the supported range, each in a virtualenv of its own:
#   oldest  requirements/oldest.lock: every dependency at the floor pyproject.toml declares (.venv-oldest)
#   newest  the newest releases the package index serves right now, no lock (.venv-newest; torch stays
#           the CPU build)
# On each: the model, generation, export, PEFT, Trainer, eval and vision tests, and transformers' own common model tests
# from that end's release (tests/models/transformers_suite.py); then a model folder saved on
# each end loads with trust_remote_code on the other (lazoo hidden) and generates the same tokens.
# Usage: bash scripts/test_range.sh [oldest|newest|both] [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
ENDS="${1:-both}"
[ $# -gt 0 ] && shift
[ "$ENDS" = both ] && ENDS="oldest newest"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TESTS=(tests/models/test_compat.py tests/models/test_models.py tests/models/test_seqcls.py
       tests/models/test_static_cache.py tests/models/test_cache_layers.py tests/models/test_transformers_mixins.py
       tests/models/test_graph_decode.py
       tests/integration/test_export.py tests/integration/test_peft.py
       tests/integration/test_trainer.py tests/integration/test_export_vision.py tests/eval/test_eval.py
       tests/vision/test_vision_models.py tests/test_optional_deps.py)

setup() {  # setup END: create or update .venv-END, print its versions
  (
    if [ "$1" = oldest ]; then
      export LAZOO_VENV="$ROOT/.venv-oldest" LAZOO_LOCK="$ROOT/requirements/oldest.lock"
    else
      export LAZOO_VENV="$ROOT/.venv-newest" LAZOO_LOCK=none
    fi
    # shellcheck disable=SC1091
    source scripts/_venv.sh test
    if [ "$1" = newest ]; then  # a reused virtualenv too: take whatever is newest today (torch excepted)
      torch_pin="$(python -c 'import torch; print("torch==" + torch.__version__.split("+")[0])')"
      python -m pip install --quiet --upgrade --upgrade-strategy eager -c <(echo "$torch_pin") -e ".[test]"
    fi
    python - "$1" <<'PY'
import importlib.metadata as md, sys
names = ["transformers", "torch", "triton", "accelerate", "peft", "lm_eval", "datasets", "tokenizers"]
print(f"[lazoo] {sys.argv[1]} end:", ", ".join(f"{n} {md.version(n)}" for n in names))
PY
  )
}

status=0
for end in $ENDS; do
  setup "$end"
  echo "[lazoo] range tests on the $end end"
  ".venv-$end/bin/python" -m pytest -q "${TESTS[@]}" "$@" || status=1
done
if [ "$ENDS" = "oldest newest" ]; then  # a folder saved on one end, loaded on the other
  for pair in "oldest newest" "newest oldest"; do
    set -- $pair
    echo "[lazoo] saved with the $1 end's transformers, loaded with the $2 end's"
    LAZOO_OTHER_PYTHON="$ROOT/.venv-$2/bin/python" ".venv-$1/bin/python" -m pytest -q tests/integration/test_export.py \
      tests/integration/test_export_vision.py -k other_end || status=1
  done
fi
exit $status
