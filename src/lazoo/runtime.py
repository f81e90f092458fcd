"""How a command uses the machine while it runs: torch's CPU threads, and progress bars on or off."""

from __future__ import annotations

import contextlib
import os

__all__ = ["THREAD_VARIABLES", "cpu_count", "set_cpu_threads", "progress_bars"]

#: environment variables that set the number of CPU threads torch uses (read by torch at start)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cpu_count() -> int:
    """The CPU cores of this machine (1 where the count is unknown)."""
    return os.cpu_count() or 1


def set_cpu_threads(threads: int | None) -> None:
    """torch's CPU threads: `threads` when given; else what OMP_NUM_THREADS or MKL_NUM_THREADS set (torch has
    read them); else every core, shared among the processes of this machine under `accelerate launch` (torch's
    own default counts only physical cores). On a CUDA machine the default is left alone."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    elif not any(os.environ.get(name, "").strip() for name in THREAD_VARIABLES) and not torch.cuda.is_available():
        processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, cpu_count() // processes))


@contextlib.contextmanager
def progress_bars(enabled: bool = True):
    """With `enabled` False, no progress bar while the block runs: datasets' map and filter bars, transformers'
    and huggingface_hub's loading and saving bars, and every other tqdm bar (lm-eval's have no switch), each
    restored afterwards (a command may run in-process, as in the tests). Trainer's bar is off through its own
    `disable_tqdm`, the tokenizer trainer's through `show_progress=False`."""
    if enabled:
        yield
        return
    import datasets
    import huggingface_hub.utils as hub
    import tqdm.std
    import transformers.utils.logging as transformers_logging

    restore = []
    if not datasets.are_progress_bars_disabled():
        datasets.disable_progress_bars()
        restore.append(datasets.enable_progress_bars)
    if not hub.are_progress_bars_disabled():
        hub.disable_progress_bars()
        restore.append(hub.enable_progress_bars)
    if transformers_logging.is_progress_bar_enabled():
        transformers_logging.disable_progress_bar()
        restore.append(transformers_logging.enable_progress_bar)
    init = tqdm.std.tqdm.__dict__["__init__"]

    def disabled_init(self, *args, **kwargs):  # over an explicit disable=False too
        init.__get__(self, type(self))(*args, **{**kwargs, "disable": True})

    tqdm.std.tqdm.__init__ = disabled_init
    try:
        yield
    finally:
        tqdm.std.tqdm.__init__ = init
        for enable in restore:
            enable()
