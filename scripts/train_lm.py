"""Train a causal LM of any lazoo config with transformers.Trainer: `lazoo train` as a script, for
`accelerate launch` (one implementation: `lazoo.commands.train.run_training`; the options are `lazoo train --help`).

    python scripts/train_lm.py --config configs/vla-small.json --output runs/vla --steps 2000 --bf16 --packing \\
        --grad-accum 4 --save-steps 500                          # one process (GPU or CPU)
    python scripts/train_lm.py ... --resume                      # go on from the last complete checkpoint in --output
    accelerate launch --num_processes 2 scripts/train_lm.py ...  # DDP (add --cpu for gloo on the CPU)
    accelerate launch --config_file configs/accelerate/fsdp2.yaml scripts/train_lm.py ...   # FSDP2

--output must be new or empty (nothing of yours is overwritten, and no checkpoint-N folder of yours meets
Trainer's checkpoint rotation); --resume accepts a folder a run wrote, --overwrite replaces lazoo's own files.
--config is a config .json (configs/) or a layout name (`lazoo list`). --packing cuts the blocks into their
documents and packs them in one row (DataCollatorWithFlattening); the models keep packed documents apart.
configs/accelerate/ holds a DDP and an FSDP2 accelerate config (fsdp2.yaml wraps each decoder layer, the
model's `_no_split_modules`, and recomputes it in backward; configs/README.md).
"""

from __future__ import annotations

import sys

from lazoo_cli import main  # parses first: --help and bad arguments answer at once

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
