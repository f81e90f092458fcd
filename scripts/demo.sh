#!/usr/bin/env bash
# The main job: set up .venv if needed, then train a small sliding-window/VLA hybrid on the embedded
# corpus with transformers.Trainer, report perplexity, save, reload and generate.
# Options are `lazoo demo`'s, e.g.: bash scripts/demo.sh --config gated_delta_net --steps 100
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source scripts/_venv.sh ""
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m lazoo_cli demo "$@"
