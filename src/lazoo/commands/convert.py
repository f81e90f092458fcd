"""`lazoo convert`: a fla, Qwen3.5, Qwen3-Next, Mamba-2, Bamba, Nemotron-H, GraniteMoeHybrid or Kimi Linear checkpoint
folder into a lazoo folder (`lazoo.convert.convert_checkpoint`)."""

from __future__ import annotations

import os

from ..user_input import CLIError

__all__ = ["cmd_convert"]


def cmd_convert(args) -> int:
    from ..convert import ConversionError, convert_checkpoint

    if not os.path.isdir(args.src):
        raise CLIError(f"no such folder {args.src!r}; give a checkpoint folder (config.json + safetensors)")
    try:
        dst, left_out = convert_checkpoint(args.src, _convert_destination(args))
    except (ConversionError, FileExistsError) as err:  # the converter names the file and field in one line
        raise CLIError(str(err)) from err
    for part in left_out:
        print(f"[lazoo] left out: {part} (the converted model is the language model only)")
    print(f"[lazoo] converted {args.src} -> {dst} (load it with AutoModelForCausalLM.from_pretrained after "
          "`import lazoo`, or with trust_remote_code=True without lazoo)")
    return 0


def _convert_destination(args) -> str:
    """DST, given as the second argument or as --output (one of them)."""
    if (args.dst is None) == (args.output is None):
        raise CLIError("give the lazoo folder to write once: as DST (lazoo convert SRC DST) or as --output DST")
    return args.dst if args.dst is not None else args.output
