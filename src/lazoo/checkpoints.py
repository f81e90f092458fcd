"""Trainer checkpoint folders on disk: which are complete, the staging folder a checkpoint is written in before
it is renamed to checkpoint-N in one step, the rotation that deletes only complete ones, and how a save that
was interrupted is recognised."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
from pathlib import Path

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import sort_checkpoints

__all__ = ["STAGING_PREFIX", "STAGING_NAME", "CHECKPOINT_NAME", "CHECKPOINT_FILES", "is_complete_checkpoint",
           "checkpoint_step", "staging_leftovers", "publish_checkpoint", "rotate_complete_checkpoints",
           "trainer_checkpoint_matches", "numbered_checkpoints", "complete_checkpoints", "is_interrupted_save"]

#: a checkpoint being written: `<output>/.lazoo-saving-checkpoint-N/checkpoint-N`, renamed to
#: `<output>/checkpoint-N` once complete. The name is not matched by Trainer's `checkpoint-*` (Trainer neither
#: resumes from it nor rotates it), and a leftover one is recognisably lazoo's: an interrupted save
STAGING_PREFIX = ".lazoo-saving-"
STAGING_NAME = re.compile(r"^\.lazoo-saving-checkpoint-[0-9]+$")
#: the checkpoint folders Trainer writes (and `get_last_checkpoint` reads)
CHECKPOINT_NAME = re.compile(r"^checkpoint-([0-9]+)$")
#: the files a checkpoint save writes (model and config, exported code and card, tokenizer, optimizer,
#: scheduler, scaler, RNG and Trainer state)
CHECKPOINT_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                    "pytorch_model*.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth",
                    "training_args.bin", "trainer_state.json", "tokenizer*", "special_tokens_map.json", "README.md",
                    "*.py")


def is_complete_checkpoint(folder) -> bool:
    """Trainer writes trainer_state.json last: a checkpoint folder without it is an interrupted save (or not
    a checkpoint at all)."""
    return os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME))


def checkpoint_step(folder) -> int | None:
    """N of a folder named checkpoint-N, else None."""
    match = CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(folder)))
    return int(match.group(1)) if match else None


def staging_leftovers(folder) -> list[str]:
    """The staging folders of interrupted checkpoint saves in `folder` (lazoo's own, by their name)."""
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, n) for n in os.listdir(folder)
                  if STAGING_NAME.match(n) and os.path.isdir(os.path.join(folder, n)))


def _set_aside_incomplete(folder: str) -> None:
    """An incomplete checkpoint-N where this run saves step N (a save interrupted before checkpoints were
    written atomically): an empty one is removed (rmdir refuses any other); any other is kept, renamed
    incomplete-checkpoint-N (a name neither Trainer nor its rotation looks at)."""
    try:
        os.rmdir(folder)
        return
    except OSError:
        pass
    parent, name = os.path.split(os.path.normpath(folder))
    target, k = os.path.join(parent, f"incomplete-{name}"), 1
    while os.path.exists(target):
        k += 1
        target = os.path.join(parent, f"incomplete-{name}.{k}")
    os.replace(folder, target)
    print(f"[lazoo] {folder} had no trainer_state.json (an interrupted save); kept as {target}")


def publish_checkpoint(staging: str, name: str, run_dir: str) -> None:
    """Rename the complete `staging/name` to `run_dir/name` in one step. A checkpoint of the same step already
    there (a resumed run saving a step again) is moved into the staging folder first, and goes with it."""
    final = os.path.join(run_dir, name)
    if os.path.isdir(final):
        if is_complete_checkpoint(final):
            os.replace(final, os.path.join(staging, "replaced"))
        else:
            _set_aside_incomplete(final)
    os.replace(os.path.join(staging, name), final)
    shutil.rmtree(staging)


def rotate_complete_checkpoints(run_dir: str, save_total_limit: int | None) -> None:
    """Trainer's rotation (keep the newest `save_total_limit`, oldest deleted first, by mtime as Trainer
    does) over complete checkpoints only: a checkpoint-N without trainer_state.json is never deleted."""
    if not save_total_limit or save_total_limit <= 0:
        return
    complete = [c for c in sort_checkpoints(run_dir, use_mtime=True) if is_complete_checkpoint(c)]
    for old in complete[:-save_total_limit]:
        shutil.rmtree(old, ignore_errors=True)


def trainer_checkpoint_matches(folder: Path) -> list[Path]:
    """What in `folder` Trainer's `checkpoint-*` matches (and may delete when rotating checkpoints)."""
    return sorted(folder.glob("checkpoint-*")) if folder.is_dir() else []


def numbered_checkpoints(folder: Path) -> list[Path]:
    """The checkpoint-N folders in `folder`, by N."""
    found = [p for p in trainer_checkpoint_matches(folder) if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def complete_checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoint-N folders in `folder`, by N."""
    return [p for p in numbered_checkpoints(folder) if is_complete_checkpoint(p)]


def is_interrupted_save(folder: Path) -> bool:
    """Whether `folder` (a checkpoint-N without trainer_state.json) holds nothing but files a checkpoint save
    writes, lazoo's card and code among them: a save that was interrupted, not a folder of the user's."""
    from .models.card import is_lazoo_card
    from .models.export import foreign_code_files

    entries = list(folder.iterdir())
    if not all(p.is_file() and any(fnmatch.fnmatch(p.name, f) for f in CHECKPOINT_FILES) for p in entries):
        return False
    readme = folder / "README.md"
    code = [p for p in entries if p.suffix == ".py"]
    return (not readme.exists() or is_lazoo_card(readme)) and not foreign_code_files(folder, [p.name for p in code])
