"""`lazoo generate`: load a saved model and its tokenizer (after checking the folder's config and weights) and
print a prompt's continuation, sampled or greedy."""

from __future__ import annotations

import math

from lazoo_cli.parser import MIN_TEMPERATURE

from ..config_checks import check_saved_model_folder, check_weight_shapes
from ..runtime import progress_bars, set_cpu_threads
from ..user_input import COUNT_LIMITS, CLIError, check_counts, check_not_negative, check_range, check_text

__all__ = ["cmd_generate"]


def cmd_generate(args) -> int:
    _check_generate_args(args)
    set_cpu_threads(args.threads)
    with progress_bars(not args.no_progress):
        print(_generate(args))
    return 0


def _check_generate_args(args) -> None:
    check_range("--max-new-tokens", args.max_new_tokens, 1, COUNT_LIMITS["max_new_tokens"])
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= MIN_TEMPERATURE):
        raise CLIError(f"--temperature must be a positive finite number, at least {MIN_TEMPERATURE} (use --greedy "
                       f"for deterministic decoding), got {args.temperature}")
    check_not_negative("--top-k", args.top_k)
    check_range("--seed", args.seed, 0, COUNT_LIMITS["seed"])
    check_text("--prompt", args.prompt)
    check_counts(args, ("threads",), allow_none=True)


def _generate(args) -> str:
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..sampling import sample_text

    path = check_saved_model_folder(args.model_dir)
    check_weight_shapes(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise CLIError(f"cannot load a tokenizer from {str(path)!r} ({err}); save one next to the model "
                       "(`lazoo train` does)") from err
    try:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False).eval()
    except (OSError, ValueError, SafetensorError) as err:  # missing or damaged weights
        raise CLIError(f"cannot load a causal LM from {str(path)!r}: {err}") from err
    return sample_text(model, tokenizer, args.prompt, args.max_new_tokens, args.seed, greedy=args.greedy,
                       temperature=1.0 if args.temperature is None else args.temperature,
                       top_k=args.top_k if args.top_k > 0 else None, static=args.static)
