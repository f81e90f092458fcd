#!/usr/bin/env python
"""The VLA paper's MQAR capacity experiment: train and evaluate lazoo models on multi-query recall.

Protocol (the VLA paper, §5, Table 6): 2 layers, d = 128, H = 4 (d_h = 32), FFN 256, vocab 128, weight tying;
AdamW β = (0.9, 0.999), ε = 1e-8, lr 3e-4 with cosine decay and 10 % linear warmup, weight decay 1e-2,
global grad-norm clip 1.0, batch 64, 2 000 steps (1 000 for the capacity-overload tables); evaluation on
15 held-out batches of 64 (960 samples), exact-match accuracy; seeds 42, 123, 999; float32 throughout.
Task layout and targets: ``lazoo.data.mqar`` (T = 3n + 1, loss and accuracy only at the n query positions).

Training draws a fresh batch every step from a generator seeded by the run seed (no fixed training set);
evaluation batches come from a separate generator (seed + 10_000), the same for every mechanism.
Accuracy is reported per query (``acc``, the paper's "exact-match accuracy" as read here) and per sample
with all n queries right (``sample_acc``).

Usage:
    python experiments/mqar.py --mechanisms softmax,linear,delta_net,vla --n-pairs 8,16,24 \
        --steps 2000 --seeds 42,123,999 --out mqar.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

import lazoo
from lazoo.presets import build_config

ROOT = Path(__file__).resolve().parents[1]

try:
    from lazoo.data.mqar import IGNORE_INDEX, mqar_batch
except ImportError:  # `lazoo.data` imports `datasets`/`tokenizers`; the task itself needs only torch
    _spec = importlib.util.spec_from_file_location("_lazoo_mqar", ROOT / "src" / "lazoo" / "data" / "mqar.py")
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    IGNORE_INDEX, mqar_batch = _mod.IGNORE_INDEX, _mod.mqar_batch

MODEL = dict(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=256, tie_word_embeddings=True)
def _slow_decay(model) -> None:
    """Gated DeltaNet's decay started near 1 in every head (log α ≈ −1e-3 a token at a = 0: a memory of about a
    thousand tokens), where its default start (A in [1, 16], dt in [1e-3, 1e-1]) gives most heads α ≤ 0.9."""
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
            with torch.no_grad():
                module.A_log.zero_()  # A = 1
                module.dt_bias.fill_(1e-3 + math.log(-math.expm1(-1e-3)))  # softplus(dt_bias) = 1e-3


#: changes made to a variant's model after it is built (its parameters' starting values)
VARIANT_INITS = {"gated_delta_net_slow_decay": _slow_decay}

#: named variants of a mechanism: name -> (mechanism, config overrides); any other name is a mechanism as it is
VARIANTS = {
    # Gated DeltaNet with its decay started near 1 (`_slow_decay`): whether its start is what fails at long T
    "gated_delta_net_slow_decay": ("gated_delta_net", {}),
    # the VLA paper's Algorithm 1 as written: ELU+1 features, the z-normalised read-out, no normalisation before
    "vla_paper": ("vla", dict(feature_map="elu1", readout="normalized", qk_prenorm=False, output_norm=False,
                              penalty_norm="algorithm1")),
    # VLA's defaults with A frozen at A₀ ∝ I (α̂ = k̂): what the precision geometry adds
    "vla_fixed_a": ("vla", dict(precision_update=False)),
    # the defaults before config format 3: Algorithm 1's penalty directions u / ‖u‖ / √d_h (a key adds 1/d_h to A⁻¹
    # against the prior λ₀ = 0.1; today's default is the paper's eq. (8), unit u)
    "vla_algorithm1_u": ("vla", dict(penalty_norm="algorithm1")),
    # today's unit directions with the prior worth one key (λ₀ = 1, not 0.1): A no longer fills within one short
    # sequence (experiments/vla_capacity_stall.py); every capacity run learns, but T = 512 recall is lost (docs/vla.md)
    "vla_prior_one": ("vla", dict(lambda0=1.0)),
    # other read-outs of the VLA state
    "vla_signed": ("vla", dict(feature_map="identity", readout="unit_query", qk_prenorm=False, output_norm=False)),
    "vla_signed_norm": ("vla", dict(feature_map="identity", readout="unit_query", qk_prenorm=False,
                                    output_norm=True)),
    "vla_prenorm": ("vla", dict(feature_map="elu1", readout="normalized", qk_prenorm=True, output_norm=True)),
    # VLA's recipe on the other layers with ELU+1 / exp features and a normaliser
    "linear_prenorm": ("linear", dict(qk_prenorm=True, output_norm=True)),
    "ela_prenorm": ("ela", dict(qk_prenorm=True, output_norm=True)),
}
EVAL_SEED_OFFSET = 10_000


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mechanisms", type=_csv(str), default=["softmax", "linear", "delta_net", "vla"])
    p.add_argument("--n-pairs", type=_csv(int), default=[8, 16, 24])
    p.add_argument("--seq-lens", type=_csv(int), default=None,
                   help="long-context variant: these sequence lengths T (filler before SEP) for every n")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seeds", type=_csv(int), default=[42])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--eval-batches", type=int, default=15)
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--warmup", type=float, default=0.1, help="warmup fraction of the steps")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--short-conv", choices=["default", "on", "off"], default="default",
                   help="the recurrent mixers' short causal conv (softmax has none): each mechanism's "
                        "default (delta_net: on; linear, vla: off), or forced on/off")
    p.add_argument("--log-every", type=int, default=100, help="record the training loss every N steps")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("mqar_results.json"))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time, in worker processes spread over the visible GPUs (these models are too "
                        "small to fill a GPU: one run is bound by kernel launches)")
    return p.parse_args(argv)


def masked_loss_and_hits(model, batch):
    """Cross-entropy over the query positions (labels aligned with positions, not shifted) and the hits."""
    logits = model(input_ids=batch["input_ids"]).logits
    mask = batch["labels"] != IGNORE_INDEX
    loss = F.cross_entropy(logits[mask].float(), batch["labels"][mask])
    hits = (logits.argmax(-1) == batch["labels"]) & mask
    return loss, hits, mask


def make_optimizer(model, args, steps: int):
    """AdamW (``args.lr``, ``args.weight_decay``) and the cosine schedule with ``args.warmup`` of ``steps`` warmup."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=args.weight_decay)
    return opt, get_cosine_schedule_with_warmup(opt, int(args.warmup * steps), steps)


def optimizer_step(model, opt, sched, loss, clip: float) -> bool:
    """Backward, gradient clipping and an AdamW step, skipped for a non-finite loss (the schedule advances
    either way); returns whether the step was taken."""
    opt.zero_grad(set_to_none=True)
    finite = bool(torch.isfinite(loss))
    if finite:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    sched.step()
    return finite


@torch.no_grad()
def evaluate(model, n_pairs, args, seed, seq_len=None):
    model.eval()
    gen = torch.Generator().manual_seed(seed + EVAL_SEED_OFFSET)
    hits_total = queries = samples_ok = samples = 0
    loss_sum = 0.0
    for _ in range(args.eval_batches):
        batch = {k: v.to(args.device) for k, v in
                 mqar_batch(n_pairs, args.eval_batch_size, args.vocab_size, generator=gen,
                            seq_len=seq_len).items()}
        loss, hits, mask = masked_loss_and_hits(model, batch)
        loss_sum += loss.item()
        hits_total += hits.sum().item()
        queries += mask.sum().item()
        samples_ok += (hits.sum(1) == mask.sum(1)).sum().item()
        samples += mask.shape[0]
    model.train()
    return {"acc": hits_total / queries, "sample_acc": samples_ok / samples,
            "eval_loss": loss_sum / args.eval_batches, "eval_queries": queries}


def build_model(mechanism: str, seed: int, **overrides):
    """The float32 model of ``mechanism`` (or a named variant: its config changes and starting values), the weights
    drawn from ``seed``; ``overrides`` change MODEL's fields."""
    torch.manual_seed(seed)
    base, variant = VARIANTS.get(mechanism, (mechanism, {}))
    model = AutoModelForCausalLM.from_config(build_config(base, **{**MODEL, **overrides}, **variant)).float()
    if mechanism in VARIANT_INITS:
        VARIANT_INITS[mechanism](model)
    return model


def run_one(mechanism, n_pairs, seed, args, bar=None, seq_len=None):
    overrides = {"vocab_size": args.vocab_size}
    if args.short_conv != "default":
        overrides["use_short_conv"] = args.short_conv == "on"
    model = build_model(mechanism, seed, **overrides).to(args.device).train()
    base, variant = VARIANTS.get(mechanism, (mechanism, {}))  # recorded in the result
    opt, sched = make_optimizer(model, args, args.steps)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    curve, nonfinite = [], 0
    for step in range(1, args.steps + 1):
        batch = {k: v.to(args.device) for k, v in
                 mqar_batch(n_pairs, args.batch_size, args.vocab_size, generator=gen, seq_len=seq_len).items()}
        loss, hits, mask = masked_loss_and_hits(model, batch)
        nonfinite += not optimizer_step(model, opt, sched, loss, args.clip)
        if step % args.log_every == 0 or step == args.steps:
            curve.append({"step": step, "loss": loss.item(), "train_acc": (hits.sum() / mask.sum()).item()})
        if bar is not None:
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix(mech=mechanism, n=n_pairs, seed=seed, loss=f"{loss.item():.3f}")
    train_s = time.perf_counter() - t0
    result = {"mechanism": mechanism, "variant": {"mechanism": base, **variant}, "n_pairs": n_pairs,
              "seq_len": seq_len or 3 * n_pairs + 1, "seed": seed,
              "params": sum(p.numel() for p in model.parameters()), "nonfinite_steps": nonfinite,
              "train_seconds": train_s, "final_train_loss": curve[-1]["loss"] if curve else math.nan,
              "curve": curve, **evaluate(model, n_pairs, args, seed, seq_len)}
    return result


def _worker(job):
    """One run in a worker process, on GPU `index % device_count` when the device is CUDA."""
    index, (mech, n, seed, T), args = job
    if args.device.startswith("cuda"):
        args.device = f"cuda:{index % torch.cuda.device_count()}"
        torch.cuda.set_device(args.device)
    torch.set_num_threads(1)
    return run_one(mech, n, seed, args, None, T)


def run_parallel(combos, args):
    """Yield the runs' results as they finish, `args.jobs` at a time (spawned processes: CUDA cannot fork)."""
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        futures = [pool.submit(_worker, (i, combo, args)) for i, combo in enumerate(combos)]
        for future in concurrent.futures.as_completed(futures):
            yield future.result()


def summarise(runs, mechanisms, n_pairs, key="n_pairs"):
    """mechanism -> n (or T, with key="seq_len") -> {mean, std, per-seed} of query accuracy (and sample accuracy)."""
    table = {}
    for mech in mechanisms:
        for n in n_pairs:
            accs = [r["acc"] for r in runs if r["mechanism"] == mech and r[key] == n]
            sacc = [r["sample_acc"] for r in runs if r["mechanism"] == mech and r[key] == n]
            if not accs:  # not run (yet)
                continue
            mean = sum(accs) / len(accs)
            std = (sum((a - mean) ** 2 for a in accs) / (len(accs) - 1)) ** 0.5 if len(accs) > 1 else 0.0
            table.setdefault(mech, {})[str(n)] = {"acc_mean": mean, "acc_std": std, "acc": accs,
                                                  "sample_acc_mean": sum(sacc) / len(sacc)}
    return table


def format_table(table, n_pairs, label="n"):
    head = f"{'mechanism':<16}" + "".join(f"{label + '=' + str(n):>22}" for n in n_pairs)
    lines = ["exact-match accuracy per query, mean ± std over seeds (all-correct samples in brackets)", head]
    for mech, row in table.items():
        cells = "".join(f"{row[str(n)]['acc_mean']:>8.3f} ± {row[str(n)]['acc_std']:.3f} "
                        f"[{row[str(n)]['sample_acc_mean']:.3f}]" if str(n) in row else f"{'-':>22}"
                        for n in n_pairs)
        lines.append(f"{mech:<16}{cells}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    lens = args.seq_lens or [None]
    combos = [(m, n, s, T) for m in args.mechanisms for n in args.n_pairs for T in lens for s in args.seeds]
    # the summary's columns: n (capacity curve) or T (long-context variant, one n)
    cols, key, label = (args.seq_lens, "seq_len", "T") if args.seq_lens else (args.n_pairs, "n_pairs", "n")
    runs = []

    def write_report():  # after every run, so an interrupted sweep keeps what it finished
        report = {
            "experiment": "MQAR capacity (the VLA paper, §5)",
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": MODEL,
            "layout": "k1 v1 ... kn vn SEP kσ(1) ... kσ(n); keys 0..V/2-1, values V/2..V-2, SEP V-1; "
                      "labels aligned with positions (target of the logits at each query position)",
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "lazoo": getattr(lazoo, "__version__", None),
                         "cuda": torch.version.cuda,
                         "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else
                         platform.processor() or platform.machine()},
            "summary": summarise(runs, args.mechanisms, cols, key),
            "runs": runs,
            "wall_seconds": time.perf_counter() - t0,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        return report

    def record(r):
        runs.append(r)
        tqdm.write(f"{r['mechanism']:<16} n={r['n_pairs']:<3} T={r['seq_len']:<4} seed={r['seed']:<4} "
                   f"acc={r['acc']:.3f} sample_acc={r['sample_acc']:.3f} loss={r['final_train_loss']:.3f} "
                   f"({r['train_seconds']:.0f}s)")
        return write_report()

    report = write_report()
    if args.jobs > 1:
        with tqdm(total=len(combos), disable=args.no_progress, desc="mqar runs") as bar:
            for r in run_parallel(combos, args):
                report = record(r)
                bar.update(1)
    else:
        with tqdm(total=len(combos) * args.steps, disable=args.no_progress, desc="mqar") as bar:
            for mech, n, seed, T in combos:
                report = record(run_one(mech, n, seed, args, bar, T))
    table = report["summary"]
    print(format_table(table, cols, label))
    print(f"wrote {args.out} ({report['wall_seconds']:.0f}s)")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
