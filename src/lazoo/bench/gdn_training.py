"""Training a Gated DeltaNet language model: lazoo against the same model built from fla's layers.

The model: fla's ``GatedDeltaNetForCausalLM`` (flash-linear-attention) with ``--hidden-size`` 1024, ``--layers`` 24,
``--heads`` 8 heads of ``--head-dim`` 128 (keys and values: ``expand_v`` 1), fla's SwiGLU MLP (hidden ratio 4), a
32k vocabulary and tied embeddings: about 350M parameters. Random weights from ``--seed``, saved, and converted with
``lazoo.convert.convert_checkpoint``: both implementations start from the same weights.

Each trains ``--steps`` AdamW steps (fp32 weights, bf16 autocast, fused AdamW, learning rate ``--lr``) on the same
batches: ``--distinct-batches`` batches of ``--batch`` × ``--length`` random tokens drawn from ``--seed``, taken in
turn (so the loss falls as the model learns them). Rows, one per implementation: every step's loss, every step's
time (CUDA synchronised, wall clock), tokens/s over the steps after ``--warmup`` (the median step; Triton compiles
and fla autotunes in the first steps), peak memory, parameters; then a ``comparison`` row: lazoo's tokens/s over
fla's, and how far the loss curves are apart (the largest |loss_lazoo − loss_fla| over the steps, and that over the
loss).

fla runs its gated delta rule with FlashQLA's TileLang kernels when ``flash_qla`` is importable (fla dispatches to
it): put fla (and FlashQLA, TileLang) on ``PYTHONPATH``; the ``env`` row records which are there. Neither is a
dependency of lazoo.

    PYTHONPATH=/tmp/site python -m lazoo.bench.gdn_training --out bench_gdn_training.jsonl

CPU smoke test (fla's classes build on the CPU; its kernels do not run there): ``--device cpu --implementations
lazoo --hidden-size 64 --layers 2 --heads 2 --head-dim 32 --vocab-size 256 --length 32 --steps 3 --warmup 1``.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lazoo_cli.bench import bench_parser

from .models import count_params
from .report import JsonRows, command_line, error_text, installed_versions, triton_version
from .timing import sync


def fla_config(args):
    """fla's ``GatedDeltaNetConfig`` of the run."""
    from fla.models import GatedDeltaNetConfig

    return GatedDeltaNetConfig(hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_heads=args.heads,
                               head_dim=args.head_dim, expand_v=1, hidden_ratio=4, vocab_size=args.vocab_size,
                               tie_word_embeddings=True, use_cache=False)


def save_fla_model(args, folder: Path) -> Path:
    """fla's model of the run, with random weights from ``--seed``, saved in ``folder/fla``."""
    from fla.models import GatedDeltaNetForCausalLM

    torch.manual_seed(args.seed)
    GatedDeltaNetForCausalLM(fla_config(args)).save_pretrained(folder / "fla")
    return folder / "fla"


def load(name: str, folder: Path, args):
    """The model of implementation ``name`` from the saved fla folder (lazoo's: converted beside it), fp32 on the
    device."""
    from transformers import AutoModelForCausalLM

    if name == "fla":
        from fla.models import GatedDeltaNetForCausalLM

        return GatedDeltaNetForCausalLM.from_pretrained(folder / "fla", dtype=torch.float32).to(args.device)
    import lazoo  # noqa: F401  (registers lazoo's model types)
    from lazoo.convert import convert_checkpoint

    if not (folder / "lazoo").exists():
        convert_checkpoint(folder / "fla", folder / "lazoo")
    return AutoModelForCausalLM.from_pretrained(folder / "lazoo", dtype=torch.float32).to(args.device)


def batches(args) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed)
    return [torch.randint(0, args.vocab_size, (args.batch, args.length), generator=gen).to(args.device)
            for _ in range(args.distinct_batches)]


def train(model, args) -> dict:
    """``--steps`` steps on ``batches``: losses, step times, tokens/s (median step after the warm-up)."""
    cuda = str(args.device).startswith("cuda")
    data = batches(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda)
    model.train()
    losses, seconds = [], []
    for step in range(args.steps):
        ids = data[step % len(data)]
        start = time.perf_counter()
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(args.device)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    timed = seconds[args.warmup:] or seconds
    step = statistics.median(timed)
    return {"losses": losses, "step_ms": [1000 * s for s in seconds], "median_step_ms": 1000 * step,
            "tokens_per_s": args.batch * args.length / step}


def compare(rows: dict) -> dict:
    fla, ours = rows["fla"], rows["lazoo"]
    gaps = [abs(a - b) for a, b in zip(ours["losses"], fla["losses"])]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return {"row": "comparison", "lazoo_over_fla_tokens_per_s": ours["tokens_per_s"] / fla["tokens_per_s"],
            "largest_loss_gap": gaps[worst], "largest_relative_loss_gap": gaps[worst] / abs(fla["losses"][worst]),
            "at_step": worst}


def environment(args) -> dict:
    import transformers

    cuda = str(args.device).startswith("cuda")
    return {"gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
            "triton": triton_version(), "transformers": transformers.__version__,
            **installed_versions("flash-linear-attention", "fla-core", "flash-qla", "tilelang"),
            "command": command_line("gdn_training")}


def run(args) -> list[dict]:
    with JsonRows(args.out) as rows, tempfile.TemporaryDirectory() as tmp:
        rows.record({"env": environment(args)})
        folder = Path(tmp)
        save_fla_model(args, folder)
        done = {}
        for name in args.implementations.split(","):
            row = {"implementation": name, "row": "train"}
            try:
                model = load(name, folder, args)
                row["params"] = count_params(model)[0]
                if str(args.device).startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                row.update(train(model, args))
                if str(args.device).startswith("cuda"):
                    row["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
                done[name] = row
            except Exception as err:  # noqa: BLE001 - a failed row is recorded; the run goes on
                row["error"] = error_text(err)
            rows.record(row)
            model = None
            gc.collect()
        if {"fla", "lazoo"} <= set(done):
            rows.record(compare(done))
    return rows


def main(argv=None) -> None:
    run(bench_parser("gdn_training", prog="python -m lazoo.bench.gdn_training").parse_args(argv))


if __name__ == "__main__":
    main()
