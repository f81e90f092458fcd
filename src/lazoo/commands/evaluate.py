"""`lazoo eval`: `lazoo.eval.run` on saved models, after checking what it would fail on only after evaluating
(lm-eval missing, a saved config with a wrong field, an --output or --task-dir that cannot be made, a --device
this machine lacks)."""

from __future__ import annotations

import importlib.util
import os

from ..config_checks import check_saved_model_folder
from ..user_input import CLIError, check_counts, check_new_file, check_new_folder

__all__ = ["cmd_eval"]


def cmd_eval(args) -> int:
    from ..models.export import UnknownModelTypeError

    try:
        from ..eval import check_args
        from ..eval import run as run_eval
    except ImportError as err:
        raise CLIError(f"`lazoo eval` needs the evaluation extras ({err}); install them with "
                       "pip install 'lazoo[eval]'") from err
    try:
        check_args(args)
    except ValueError as err:
        raise CLIError(str(err)) from err
    _check_eval_inputs(args)
    try:
        return _exit_code(run_eval(args))
    except (FileNotFoundError, UnknownModelTypeError) as err:  # a model folder (checked before any work)
        raise CLIError(str(err)) from err


def _check_eval_inputs(args) -> None:
    """What `lazoo eval` would fail on only after evaluating: lm-eval missing, a saved config with a wrong field,
    an --output or --task-dir that cannot be made, a --device this machine lacks, too many --threads."""
    if importlib.util.find_spec("lm_eval") is None:
        raise CLIError("`lazoo eval` needs lm-evaluation-harness; install it with pip install 'lazoo[eval]'")
    for folder in args.models:
        if os.path.isfile(os.path.join(folder, "config.json")):  # a folder without one: lazoo.eval names it
            check_saved_model_folder(folder)
    if args.output is not None:
        check_new_file("--output", args.output)
    if args.task_dir is not None:
        check_new_folder("--task-dir", args.task_dir)
    if args.device is not None:
        _check_device(args.device)
    check_counts(args, ("threads",), allow_none=True)


def _check_device(device: str) -> None:
    """A torch device this machine has (a typo or a missing GPU fails only after the models load)."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise CLIError(f"--device: {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from err
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {device}: torch sees no CUDA GPU here (torch {torch.__version__})")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise CLIError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")


def _exit_code(value) -> int:
    return value if isinstance(value, int) else 0
