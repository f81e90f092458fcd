#!/usr/bin/env python
"""The test-time regression paper, §6 (Figure 3): one test-time regression layer plus a length-2 short
convolution on the keys solves MQAR; memory capacity (P against d_model), not sequence length, limits it.

Model (the paper's §6): embeddings, ONE mixer layer (linear attention or unweighted RLS), a length-2 causal
convolution on the keys only (`k_t = w_0 W_K x_t + w_1 W_K x_{t−1}`, no activation: the paper's eq. 56), no MLP
(`intermediate_size = 0` makes lazoo's MLP block an exact zero map with no weights), d_model = D_k = 64 (one
head), tied embeddings and LM head. Mixer options: ``short_conv_targets="k"``, ``conv_size=2``,
``conv_activation=None``; linear attention as in the paper's eq. 2 (identity feature map, no denominator; lazoo's
linear mixer then applies its per-head output RMSNorm), RLS with γ = 1 (the paper's eq. 11; lazoo's mixer:
unit-norm q and k, learned ridge λ).

Task: lazoo's MQAR draws (`lazoo.data.mqar.mqar_batch`: P distinct keys, values, a query permutation) laid out
at length T as in Zoology (Arora et al. 2023), which the paper follows: the P key-value pairs first, then the
P queries, each a (key, value) pair at a non-overlapping 2-token slot among T − 2P filler tokens (the SEP id,
one constant token like Zoology's 0 with ``random_non_queries=False``); the loss and accuracy are taken at each
query key's position, whose target is its value. This needs T ≥ 4P (Zoology's constraint too); a point with
T < 4P is skipped. Vocabulary 8192 as in Zoology (keys 0..4095, values 4096..8190, SEP 8191).

Query slots (``--gaps``): "power" (default) is Zoology's gap law, slot i of the (T − 2P)/2 drawn with
probability ∝ a·i^(a−1), a = ``--power-a`` = 0.01 (Zoology's train and test default), without replacement; it
puts many queries right after the context and the rest anywhere up to T. "uniform" draws the slots uniformly
(the layout's first version). Every run also reports ``acc_uniform_slots``, the same model's accuracy with
uniform slots, where almost every query sits behind hundreds of fillers: a check that what was learned does
not depend on the distance.

Why the power law matters for linear attention (measured on CPU with this script's model and data): with
uniform slots and T > 4P, the memory `Σ v kᵀ` holds a rank-one term (number of SEP-SEP bigrams)·v_sep k_sepᵀ
that grows with T. At initialisation it is already the largest part of every read-out, and training makes it larger (its
parameters grow under Adam while the output RMSNorm and the final norm make the loss blind to its scale):
after 100 steps it was ~3000 times the query's own pair term (P = 16, T = 256, vocab 2048), the loss sat at
ln V, and the gradient the pairs get is divided by that term. The model can hold the solution (keys of the
SEP bigram orthogonal to every query, which the paper's orthonormal construction has built in): trained with
power-law slots, the SEP term fell to ~1 % of the pair term within 200 steps and the accuracy with uniform
slots equals that with power-law slots (0.99 at T = 256 and 512 for P = 16, vocabulary 2048, where uniform
slots give 0.001; at P = 64, vocabulary 8192, T = 512: 0.41 and 0.47 after only 400 steps, seeds 1 and 2,
against 0.000 with uniform slots after 1500 GPU steps). Queries close to the context give the pair term a
gradient before the SEP term has grown. At P = 64 and T ≥ 512 the model still falls into the SEP term first
and leaves it after a random number of steps: in short CPU runs 3 of 4 had left it by step 400 at T = 512,
and at T = 1024 one of three had learned by step 300, one was leaving, one had not by step 380. So give it
the full ``--steps`` budget and the learning-rate sweep. RLS whitens the SEP direction with
(KᵀK + λI)⁻¹ and learns with either law.

Training: as `experiments/mqar.py` (AdamW β = (0.9, 0.999), cosine schedule with 10 % warm-up, weight decay, grad
clip 1.0, a fresh batch every step); every learning rate in ``--lr`` is run and a point reports its best, as
Zoology does with its learning-rate sweep. Accuracy: exact match per query on held-out batches.

Usage (GPU; the JSON is rewritten after every run so partial results survive):
    PYTHONPATH=src python experiments/mqar_short_conv.py --device cuda --steps 4000 --lr 1e-3,3e-3 \
        --mechanisms linear,rls --pairs 64,128 --seq-len 256,512,1024 --out docs/results/mqar_short_conv.json
In pieces (e.g. under a per-command time limit), then combined into one JSON and figure:
    ... --pairs 64 --out docs/results/mqar_short_conv_p64.json --plot none
    ... --pairs 128 --out docs/results/mqar_short_conv_p128.json --plot none
    python experiments/mqar_short_conv.py --merge \
        docs/results/mqar_short_conv_p64.json,docs/results/mqar_short_conv_p128.json
Ablation (the first layout, uniform slots; linear attention stays at ln 4096 for T ≥ 512): add ``--gaps uniform``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mqar as mqar_protocol  # noqa: E402  (experiments/mqar.py: data import fallback, loss/hits of one batch)

from lazoo.presets import build_config  # noqa: E402

IGNORE_INDEX, mqar_batch = mqar_protocol.IGNORE_INDEX, mqar_protocol.mqar_batch
EVAL_SEED_OFFSET = mqar_protocol.EVAL_SEED_OFFSET

D_MODEL = 64
#: mechanism -> the mixer options of the paper's §6 (one layer, short conv of length 2 on the keys only)
KEY_CONV = {"use_short_conv": True, "conv_size": 2, "short_conv_targets": "k", "conv_activation": None}
MIXERS = {
    "linear": {**KEY_CONV, "feature_map": "identity", "normalize": False},
    "rls": {**KEY_CONV, "gamma": 1.0},
}


GAPS = ("power", "uniform")
#: Zoology's power-law exponent a (train_power_a = test_power_a = 0.01)
ZOOLOGY_POWER_A = 0.01


def query_slots(n_pairs: int, n_slots: int, batch_size: int, generator: torch.Generator, gaps: str = "power",
                power_a: float = ZOOLOGY_POWER_A) -> torch.Tensor:
    """`n_pairs` distinct slot indices in [0, n_slots) per row, [batch_size, n_pairs] in draw order.

    "power": Zoology's gap law, slot i (1-based) with weight a·i^(a−1), drawn without replacement (each draw
    renormalises over the slots left, as numpy's `choice(replace=False, p=...)` does); "uniform": every
    slot alike."""
    if gaps not in GAPS:
        raise ValueError(f"gaps must be one of {', '.join(GAPS)}, got {gaps!r}")
    if gaps == "uniform":
        return torch.rand(batch_size, n_slots, generator=generator).argsort(dim=1)[:, :n_pairs]
    if not power_a > 0:
        raise ValueError(f"power_a must be > 0, got {power_a!r}")
    weights = power_a * torch.arange(1, n_slots + 1, dtype=torch.float64) ** (power_a - 1)
    return torch.multinomial(weights.expand(batch_size, n_slots), n_pairs, replacement=False, generator=generator)


def long_mqar_batch(n_pairs: int, seq_len: int, batch_size: int, vocab_size: int,
                    generator: torch.Generator, gaps: str = "power",
                    power_a: float = ZOOLOGY_POWER_A) -> dict[str, torch.Tensor]:
    """MQAR at length `seq_len` ≥ 4·n_pairs: context pairs, then each query as a (key, value) pair in a
    2-token slot among filler (SEP) tokens, slots drawn by `query_slots` (`gaps`). Labels are
    position-aligned (the value at each query key)."""
    if seq_len < 4 * n_pairs:
        raise ValueError(f"seq_len={seq_len} must be at least 4 * n_pairs = {4 * n_pairs}")
    n, b = n_pairs, batch_size
    base = mqar_batch(n, b, vocab_size, generator=generator)  # k1 v1 .. kn vn SEP kσ(1) .. kσ(n)
    context = base["input_ids"][:, : 2 * n]
    queries, answers = base["input_ids"][:, 2 * n + 1:], base["labels"][:, 2 * n + 1:]
    sep = base["input_ids"][0, 2 * n].item()
    slots = query_slots(n, (seq_len - 2 * n) // 2, b, generator, gaps, power_a)
    pos = 2 * n + 2 * slots  # position of each query key
    input_ids = torch.full((b, seq_len), sep, dtype=torch.long)
    input_ids[:, : 2 * n] = context
    input_ids.scatter_(1, pos, queries)
    input_ids.scatter_(1, pos + 1, answers)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels.scatter_(1, pos, answers)
    return {"input_ids": input_ids, "labels": labels}


def build_model(mechanism: str, vocab_size: int):
    if mechanism not in MIXERS:
        raise ValueError(f"unknown mechanism {mechanism!r}; valid: {', '.join(MIXERS)}")
    config = build_config(mechanism, vocab_size=vocab_size, hidden_size=D_MODEL, num_hidden_layers=1,
                          num_attention_heads=1, intermediate_size=0, tie_word_embeddings=True,
                          mixer_kwargs={mechanism: MIXERS[mechanism]})
    with warnings.catch_warnings():  # the zero-width MLP's empty weights: "Initializing zero-element tensors"
        warnings.simplefilter("ignore", UserWarning)
        return AutoModelForCausalLM.from_config(config)


def masked_loss_and_hits(model, batch):
    """`experiments/mqar.py`'s loss and hits with the LM head applied at the query positions only (P of T per
    row): the same numbers without a [B, T, vocab] logits tensor."""
    mask = batch["labels"] != IGNORE_INDEX
    hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state
    logits = model.lm_head(hidden[mask]).float()
    labels = batch["labels"][mask]
    loss = torch.nn.functional.cross_entropy(logits, labels)
    hits = torch.zeros_like(mask)
    hits[mask] = logits.argmax(-1) == labels
    return loss, hits, mask


@torch.no_grad()
def evaluate(model, n_pairs, seq_len, args, seed, gaps=None):
    """Accuracy and loss on held-out batches with the training slot law (`gaps` None) or the one given."""
    model.eval()
    gen = torch.Generator().manual_seed(seed + EVAL_SEED_OFFSET)
    hits = queries = 0
    loss_sum = 0.0
    for _ in range(args.eval_batches):
        batch = {k: v.to(args.device) for k, v in
                 long_mqar_batch(n_pairs, seq_len, args.batch_size, args.vocab_size, gen,
                                 gaps or args.gaps, args.power_a).items()}
        loss, h, mask = masked_loss_and_hits(model, batch)
        loss_sum += loss.item()
        hits += h.sum().item()
        queries += mask.sum().item()
    model.train()
    return {"acc": hits / queries, "eval_loss": loss_sum / args.eval_batches, "eval_queries": queries}


def train_one(mechanism, n_pairs, seq_len, lr, args):
    torch.manual_seed(args.seed)
    model = build_model(mechanism, args.vocab_size).to(args.device, torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, int(0.1 * args.steps), args.steps)
    gen = torch.Generator().manual_seed(args.seed)
    t0, curve, nonfinite = time.perf_counter(), [], 0
    for step in range(1, args.steps + 1):
        batch = {k: v.to(args.device) for k, v in
                 long_mqar_batch(n_pairs, seq_len, args.batch_size, args.vocab_size, gen,
                                 args.gaps, args.power_a).items()}
        loss, hits, mask = masked_loss_and_hits(model, batch)
        nonfinite += not mqar_protocol.optimizer_step(model, opt, sched, loss, clip=1.0)
        if step % args.log_every == 0 or step == args.steps:
            curve.append({"step": step, "loss": loss.item(), "train_acc": (hits.sum() / mask.sum()).item()})
    train_seconds = time.perf_counter() - t0
    held_out = evaluate(model, n_pairs, seq_len, args, args.seed)
    far = held_out if args.gaps == "uniform" else evaluate(model, n_pairs, seq_len, args, args.seed, gaps="uniform")
    return {"mechanism": mechanism, "n_pairs": n_pairs, "seq_len": seq_len, "lr": lr, "seed": args.seed,
            "gaps": args.gaps, "params": sum(p.numel() for p in model.parameters()),
            "train_seconds": train_seconds, "nonfinite_steps": nonfinite,
            "final_train_loss": curve[-1]["loss"] if curve else math.nan, "curve": curve, **held_out,
            "acc_uniform_slots": far["acc"], "eval_loss_uniform_slots": far["eval_loss"]}


def best_per_point(runs):
    """(mechanism, P, T) -> the run with the best accuracy over learning rates."""
    best = {}
    for r in runs:
        key = f"{r['mechanism']}/P={r['n_pairs']}/T={r['seq_len']}"
        if key not in best or r["acc"] > best[key]["acc"]:
            best[key] = {k: r.get(k) for k in ("mechanism", "n_pairs", "seq_len", "lr", "acc", "eval_loss",
                                               "acc_uniform_slots")}
    return best


def plot(report, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = list(report["best"].values())
    pairs = sorted({r["n_pairs"] for r in best})
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.2 * len(pairs), 3.6), squeeze=False)
    for ax, P in zip(axes[0], pairs):
        for mech in sorted({r["mechanism"] for r in best}):
            runs = sorted((r for r in best if r["n_pairs"] == P and r["mechanism"] == mech),
                          key=lambda r: r["seq_len"])
            if runs:
                line, = ax.plot([r["seq_len"] for r in runs], [r["acc"] for r in runs], marker="o", label=mech)
                far = [(r["seq_len"], r["acc_uniform_slots"]) for r in runs if r.get("acc_uniform_slots") is not None]
                if far:
                    ax.plot(*zip(*far), marker="x", linestyle="--", color=line.get_color(),
                            label=f"{mech}, uniform slots")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"P = {P} pairs, d_model = {D_MODEL}")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("MQAR accuracy (best lr)")
        ax.legend()
    fig.suptitle("One mixer layer + length-2 key convolution, no MLP", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _far(best_run) -> str:
    far = best_run.get("acc_uniform_slots")
    return "" if far is None else f", uniform slots {far:.3f}"


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mechanisms", type=_csv(str), default=["linear", "rls"])
    p.add_argument("--pairs", type=_csv(int), default=[64, 128])
    p.add_argument("--seq-len", type=_csv(int), default=[256, 512, 1024])
    p.add_argument("--lr", type=_csv(float), default=[1e-3, 3e-3], help="comma list: each is run, best reported")
    p.add_argument("--gaps", choices=GAPS, default="power",
                   help="query slots: Zoology's power law (default) or uniform; acc_uniform_slots is always reported")
    p.add_argument("--power-a", type=float, default=ZOOLOGY_POWER_A, help="the power law's exponent a (Zoology: 0.01)")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "mqar_short_conv.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "figures" / "mqar_short_conv.png")
    p.add_argument("--merge", type=_csv(Path), default=None,
                   help="train nothing: combine the runs of these result JSONs (e.g. one per --pairs, run "
                        "separately) into --out and draw --plot")
    return p.parse_args(argv)


def merge(args) -> dict:
    parts = [json.loads(path.read_text()) for path in args.merge]
    runs = [r for part in parts for r in part["runs"]]
    report = {**parts[0], "merged_from": [str(p) for p in args.merge], "best": best_per_point(runs), "runs": runs,
              "skipped_T_below_4P": sorted({s for part in parts for s in part.get("skipped_T_below_4P", [])})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if args.plot is not None and str(args.plot) != "none":
        plot(report, args.plot)
    for key, r in report["best"].items():
        print(f"{key:<24} acc={r['acc']:.3f} (lr {r['lr']:g})" + _far(r))
    print(f"wrote {args.out} from {len(parts)} files")
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    t0 = time.perf_counter()
    combos = [(m, P, T, lr) for m in args.mechanisms for P in args.pairs for T in args.seq_len for lr in args.lr]
    skipped = sorted({f"P={P}/T={T}" for _, P, T, _ in combos if T < 4 * P})
    runs, report = [], None
    for mech, P, T, lr in combos:
        if T < 4 * P:
            continue
        r = train_one(mech, P, T, lr, args)
        runs.append(r)
        print(f"{mech:<7} P={P:<4} T={T:<5} lr={lr:<7g} acc={r['acc']:.3f} "
              f"(uniform slots {r['acc_uniform_slots']:.3f}) loss={r['final_train_loss']:.3f} "
              f"({r['train_seconds']:.0f}s)", flush=True)
        report = {
            "experiment": ("the test-time regression paper, §6, Figure 3: MQAR with one mixer layer "
                           "+ length-2 key convolution, no MLP"),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": {"d_model": D_MODEL, "heads": 1, "layers": 1, "intermediate_size": 0, "mixers": MIXERS},
            "layout": f"P pairs, then P (key, value) queries in 2-token slots among SEP fillers, slots drawn "
                      f"{'by a power law, a = ' + str(args.power_a) if args.gaps == 'power' else 'uniformly'} "
                      "(acc_uniform_slots: uniform slots); loss/accuracy at query keys; T >= 4P",
            "skipped_T_below_4P": skipped,
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                         "device_name": torch.cuda.get_device_name() if str(args.device).startswith("cuda")
                         else platform.machine()},
            "best": best_per_point(runs),
            "runs": runs,
            "wall_seconds": time.perf_counter() - t0,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        if args.plot is not None and str(args.plot) != "none":
            plot(report, args.plot)
    if report is None:
        raise SystemExit(f"nothing to run: every (P, T) has T < 4P ({', '.join(skipped)})")
    for key, r in report["best"].items():
        print(f"{key:<24} acc={r['acc']:.3f} (lr {r['lr']:g})" + _far(r))
    print(f"wrote {args.out} ({report['wall_seconds']:.0f}s)")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
