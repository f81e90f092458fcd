#!/usr/bin/env bash
# The tests: set up .venv (with the test extras) if needed, then run the default (CPU) suite.
# Extra arguments go to pytest, e.g.: bash scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source scripts/_venv.sh "test"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# fla's classes for the converter tests (installed by _venv.sh; the tests skip them where it is absent)
export LAZOO_FLA_SITE="${LAZOO_FLA_SITE:-${LAZOO_VENV:-$PWD/.venv}/fla-site}"
exec python -m pytest "$@"
