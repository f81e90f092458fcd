#!/usr/bin/env python
"""Recall vs length for OVQ and its baselines (the OVQ paper, §8.4, Figure 4): train short, test long.

Each model in --models is trained on basic ICR (``lazoo.data.icr``: 8-token keys and values, a query section
after a marker) at --train-len tokens, then tested at every length in --test-lens (per-token accuracy on the
answer tokens, greedy, teacher-forced). Training starts with a length curriculum (--curriculum, 256/512/1024
tokens by default): from scratch at 1-2k tokens the loss sits at chance, ln(vocab), for thousands of steps,
while a model that has solved 256 tokens adapts to 1024 in about 100 steps. A stage moves on when the answer
accuracy of its last 20 steps reaches --advance-acc, and the curriculum ends at --curriculum-share of
--steps in any case; short stages use as many queries as fit (all pairs queried at 256 tokens).
Models (``lazoo.presets``): ``sw-ovq`` (sliding window 128 with RoPE / OVQ, tested under every dictionary
budget in --test-dicts: ``max_dict_size`` is read from the config at every forward call, so the trained
model runs with a larger or smaller N without reloading), ``sw-vq``, ``sw-nope``
(sliding window / full softmax without positions) and ``sw-linear`` (sliding window / linear attention); any
other layout name of ``lazoo.presets`` works too. Also recorded: the bytes of each model's cache (its
inference state) after a test sequence, measured from the cache, so the plot shows OVQ's constant state
against the KV cache of sw-nope.

Resumable: every --ckpt-every steps a model's weights, optimizer, step and RNG state go to
``<out>/ckpt/<model>/`` (a torch.save file cut into parts of at most 16 MiB); a rerun continues from there,
and skips the trainings and tests already in ``<out>/ovq_recall.json`` (rewritten after every test).
Models can train in parallel processes, one --out folder each, combined afterwards with
``--merge folder1,folder2,... --out folder``.
Plots: ``<out>/ovq_recall_accuracy.png`` (accuracy vs length) and ``<out>/ovq_recall_state.png`` (state
bytes vs length).

    PYTHONPATH=src python experiments/ovq_recall.py --device cuda --steps 2000 --train-len 2048 \
        --test-lens 2048,4096,8192,16384,32768,65536 --models sw-ovq,sw-vq,sw-nope,sw-linear --out runs/ovq_recall
"""

from __future__ import annotations

import argparse
import io
import json
import math
import platform
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import lazoo  # noqa: F401  (registers the model types)
from lazoo.data.icr import IGNORE_INDEX, icr_batch, icr_num_pairs
from lazoo.presets import HYBRIDS, build_config

#: layouts this script adds to lazoo.presets: the linear-attention baseline in the same hybrid layout
EXTRA_LAYOUTS = {"sw-linear": ["sliding_window", "linear"]}
PART_BYTES = 16 * 1024 * 1024
TOKEN_LEN = 8  # tokens per key and per value (lazoo.data.icr's default)
EVAL_SEED_OFFSET = 10_000


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", type=_csv(str), default=["sw-ovq", "sw-vq", "sw-nope", "sw-linear"])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--time-budget", type=float, default=0,
                   help="seconds of training per model (0: none): training stops at --steps or this budget, "
                        "whichever comes first; the warm-up, cosine decay and curriculum follow whichever "
                        "fraction is larger, so a model stopped by the clock has still annealed")
    p.add_argument("--train-len", type=int, default=2048)
    p.add_argument("--curriculum", type=_csv(int), default=[256, 512, 1024],
                   help="shorter lengths trained first, in order (lengths >= --train-len are skipped; '' for none)")
    p.add_argument("--advance-acc", type=float, default=0.9,
                   help="a curriculum stage ends when the answer accuracy of its last 20 steps reaches this")
    p.add_argument("--curriculum-share", type=float, default=0.5,
                   help="the curriculum ends after this share of --steps even if a stage is not solved")
    p.add_argument("--test-lens", type=_csv(int), default=[2048, 4096, 8192, 16384, 32768, 65536])
    p.add_argument("--test-dicts", type=_csv(int), default=[512, 2048, 8192],
                   help="OVQ dictionary budgets N tested (the model trains with --train-dict)")
    p.add_argument("--train-dict", type=int, default=2048)
    p.add_argument("--n-queries", type=int, default=32, help="queried keys per sample")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--eval-batch", type=int, default=2)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--chunk-size", type=int, default=128, help="OVQ chunk length L")
    p.add_argument("--window", type=int, default=128, help="sliding window")
    p.add_argument("--ckpt-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/ovq_recall")
    p.add_argument("--merge", type=_csv(str), default=None,
                   help="comma list of earlier --out folders (e.g. one process per model): combine their runs "
                        "into --out's JSON and plots, and train nothing")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- models
def make_config(name, args):
    sizes = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, intermediate_size=2 * args.hidden, sliding_window=args.window,
                 tie_word_embeddings=True, mixer_kwargs={})
    pattern = EXTRA_LAYOUTS.get(name) or HYBRIDS.get(name) or ["?"]
    if "ovq" in [pattern[i % len(pattern)] for i in range(args.layers)]:  # options only for a mechanism in use
        sizes["mixer_kwargs"]["ovq"] = {"max_dict_size": args.train_dict, "chunk_size": args.chunk_size}
    if name in EXTRA_LAYOUTS:
        sizes["mixer_kwargs"]["sliding_window"] = {"qk_norm": True, "use_rope": True}
        return AutoConfig.for_model("lazoo_hybrid", layer_types=[pattern[i % len(pattern)] for i in range(args.layers)],
                                    **sizes)
    if name not in HYBRIDS:
        raise SystemExit(f"unknown model {name!r}: use one of {', '.join([*HYBRIDS, *EXTRA_LAYOUTS])}")
    return build_config(name, **sizes)


def set_dict_size(model, n):
    """Run OVQ layers with a dictionary budget of n (read at every forward call)."""
    mk = dict(model.config.mixer_kwargs or {})
    mk["ovq"] = {**mk.get("ovq", {}), "max_dict_size": n}
    model.config.mixer_kwargs = mk


def has_ovq(model):
    return "ovq" in (model.config.layer_types or [])


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(folder: Path, payload: dict):
    """torch.save ``payload`` into ``folder`` as parts of at most 16 MiB (written, then renamed)."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(exist_ok=True)
    for old in tmp.glob("part*"):
        old.unlink()
    n = max(1, math.ceil(len(data) / PART_BYTES))
    for i in range(n):
        (tmp / f"part{i:03d}").write_bytes(data[i * PART_BYTES:(i + 1) * PART_BYTES])
    for old in folder.glob("part*"):
        old.unlink()
    for f in sorted(tmp.glob("part*")):
        f.rename(folder / f.name)
    tmp.rmdir()


def load_checkpoint(folder: Path):
    parts = sorted(folder.glob("part*"))
    if not parts:
        return None
    data = b"".join(p.read_bytes() for p in parts)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


# ----------------------------------------------------------------------------- task
def batch(n_tokens, size, args, gen, n_queries=None):
    n_queries = n_queries or args.n_queries
    n_pairs = icr_num_pairs(n_tokens, n_queries)
    if n_pairs < n_queries:
        raise SystemExit(f"{n_tokens} tokens hold {n_pairs} pairs, fewer than --n-queries={n_queries}")
    return icr_batch(n_pairs, n_queries, size, args.vocab, generator=gen)


def stage_queries(n_tokens, args):
    """--n-queries, or fewer where n_tokens cannot hold that many context pairs (at most one query per pair)."""
    fit = icr_num_pairs(n_tokens, 0) // 2
    if fit < 1:
        raise SystemExit(f"{n_tokens} tokens are too short for one query and its pair")
    return min(args.n_queries, fit)


def stage_lengths(args):
    """The training lengths in order: the curriculum lengths below --train-len, then --train-len."""
    return [t for t in args.curriculum if t < args.train_len] + [args.train_len]


def answer_logits(model, ids, labels):
    """Logits predicting every answer token (positions are the same in every sample of a batch)."""
    pos = (labels[0] != IGNORE_INDEX).nonzero().squeeze(1)
    out = model(input_ids=ids, logits_to_keep=pos - 1, use_cache=False)
    return out.logits.float(), labels[:, pos]


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()


# ----------------------------------------------------------------------------- train / test
def train(name, args, out: Path, log):
    device = args.device
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(make_config(name, args)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    folder = out / "ckpt" / name
    step, seconds, losses, accs = 0, 0.0, [], []

    def progress():  # the share of the training done: of the steps or of the time budget, the larger
        return max(step / args.steps, seconds / args.time_budget if args.time_budget > 0 else 0.0)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: warmup_cosine(progress()))
    lengths = stage_lengths(args)
    stage, stages = 0, [[lengths[0], 0]]  # stages: [length, first step] as trained
    ck = load_checkpoint(folder)
    if ck is not None:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        gen.set_state(ck["generator"])
        step, seconds, losses = ck["step"], ck["seconds"], ck["losses"]
        accs = ck.get("accs", [])
        stages = ck.get("stages", [[args.train_len, 0]])  # older checkpoints trained at --train-len only
        stage = lengths.index(stages[-1][0]) if stages[-1][0] in lengths else len(lengths) - 1
        log(f"[{name}] resumed at step {step}")
    model.train()
    while progress() < 1:
        t0 = time.time()
        T = lengths[stage]
        b = batch(T, args.batch, args, gen, stage_queries(T, args))
        ids, labels = b["input_ids"].to(device), b["labels"].to(device)
        with autocast(device):
            logits, target = answer_logits(model, ids, labels)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        accs.append(round((logits.detach().argmax(-1) == target).float().mean().item(), 4))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        seconds += time.time() - t0
        losses.append(round(loss.item(), 4))
        if step % 50 == 0 or step == args.steps:
            log(f"[{name}] step {step}/{args.steps} T={T} loss {losses[-1]:.3f} acc {accs[-1]:.3f} ({seconds:.0f} s)")
        if stage < len(lengths) - 1 and step < args.steps:  # a rerun with more --steps goes on in this stage
            recent = accs[max(stages[-1][1], step - 20):]
            solved = len(recent) == 20 and sum(recent) / 20 >= args.advance_acc
            if solved or progress() >= args.curriculum_share:
                stage = stage + 1 if solved else len(lengths) - 1
                stages.append([lengths[stage], step])
                log(f"[{name}] step {step}: now training at {lengths[stage]} tokens")
        if step % args.ckpt_every == 0 or step == args.steps:
            save_checkpoint(folder, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                     "scheduler": sched.state_dict(), "generator": gen.get_state(),
                                     "step": step, "seconds": seconds, "losses": losses, "accs": accs,
                                     "stages": stages})
    info = {"steps": step, "stopped_by_time_budget": step < args.steps, "train_seconds": round(seconds, 1),
            "final_loss": losses[-1] if losses else None,
            "loss_every_50": losses[::50], "acc_every_50": accs[::50], "stages": stages,
            "params": sum(p.numel() for p in model.parameters())}
    return model, info


def warmup_cosine(progress: float, warmup: float = 0.1) -> float:
    """Learning-rate factor at a share ``progress`` of the training: linear warm-up, then cosine decay to 0."""
    if progress < warmup:
        return progress / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


def cache_bytes(cache) -> int:
    total = 0

    def visit(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)

    visit(getattr(cache, "states", None))
    visit(getattr(cache, "lobe_states", None))
    return total


@torch.no_grad()
def test(model, T, args):
    """Per-token accuracy on the answer tokens of --eval-batches batches of T tokens, and the cache bytes."""
    device = args.device
    model.eval()
    gen = torch.Generator().manual_seed(args.seed + EVAL_SEED_OFFSET + T)
    hits = total = first_hits = first_total = 0
    state = None
    t0 = time.time()
    for i in range(args.eval_batches):
        b = batch(T, args.eval_batch, args, gen)
        ids, labels = b["input_ids"].to(device), b["labels"].to(device)
        with autocast(device):
            logits, target = answer_logits(model, ids, labels)
        right = logits.argmax(-1) == target
        hits += int(right.sum())
        total += target.numel()
        # the first token of each value is the look-up proper; the other 7 can be copied from the context by
        # matching the value token before them (teacher forcing gives it)
        first = torch.arange(right.shape[1], device=right.device) % TOKEN_LEN == 0
        first_hits += int(right[:, first].sum())
        first_total += int(first.sum()) * right.shape[0]
        if i == 0:  # the inference state after a whole sequence of one sample
            with autocast(device):
                out = model(input_ids=ids[:1], use_cache=True, logits_to_keep=1)
            state = cache_bytes(out.past_key_values)
            del out
    return {"acc": hits / max(total, 1), "acc_first_token": first_hits / max(first_total, 1),
            "answer_tokens": total, "state_bytes": state,
            "seconds": round(time.time() - t0, 1)}


# ----------------------------------------------------------------------------- results
def plot(results, out: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig_a, ax_a = plt.subplots(figsize=(7, 4.5))
    fig_s, ax_s = plt.subplots(figsize=(7, 4.5))
    for name, run in results["runs"].items():
        curves = {}
        for r in run.get("tests", []):
            label = name if r.get("N") is None else f"{name} (N={r['N']})"
            curves.setdefault(label, []).append(r)
        for label, rs in curves.items():
            rs = sorted(rs, key=lambda r: r["T"])
            ax_a.plot([r["T"] for r in rs], [r["acc"] for r in rs], marker="o", label=label)
            if rs[0]["state_bytes"] is not None:
                ax_s.plot([r["T"] for r in rs], [r["state_bytes"] for r in rs], marker="o", label=label)
    train_len = results["meta"]["train_len"]
    for ax, ylabel in ((ax_a, "per-token accuracy (answer tokens)"), (ax_s, "inference state (bytes)")):
        ax.set_xscale("log", base=2)
        ax.axvline(train_len, color="grey", ls=":", lw=1)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax_a.set_ylim(-0.02, 1.02)
    ax_a.set_title(f"ICR recall, trained at {train_len} tokens")
    ax_s.set_yscale("log")
    ax_s.set_title("state size after one sequence (batch 1)")
    for fig, fname in ((fig_a, "ovq_recall_accuracy.png"), (fig_s, "ovq_recall_state.png")):
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ovq_recall.json"
    meta = {k: v for k, v in vars(args).items() if k != "out"}
    meta.update(torch=torch.__version__, python=platform.python_version(),
                gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else None)
    results = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    if not args.merge:
        results["meta"] = meta

    def write():
        path.write_text(json.dumps(results, indent=1))
        plot(results, out)

    def log(msg):
        print(msg, flush=True)

    if args.merge:
        for folder in args.merge:
            part = json.loads((Path(folder) / "ovq_recall.json").read_text())
            results["runs"].update(part["runs"])
            results.setdefault("merged_meta", {})[folder] = part["meta"]
            results.setdefault("meta", {**part["meta"], "merged_from": args.merge})  # the first part's settings
        write()
        return results

    for name in args.models:
        run = results["runs"].setdefault(name, {"tests": []})
        done = {(r["T"], r.get("N")) for r in run["tests"]}
        model, info = train(name, args, out, log)
        if run.get("train", {}).get("steps") != info["steps"]:  # tests of an earlier model are stale
            run["tests"], done = [], set()
        budgets = args.test_dicts if has_ovq(model) else [None]
        todo = [(T, n) for T in args.test_lens for n in budgets]
        run["train"] = info
        write()
        for T, n in todo:
            if (T, n) in done:
                continue
            if n is not None:
                set_dict_size(model, n)
            try:
                r = test(model, T, args)
            except torch.OutOfMemoryError:
                r = {"acc": None, "error": "out of memory", "state_bytes": None}
                torch.cuda.empty_cache()
            r.update(T=T, N=n)
            run["tests"].append(r)
            log(f"[{name}] T={T}" + (f" N={n}" if n else "") + f": acc {r['acc']}, "
                f"first token {r.get('acc_first_token')}, state {r['state_bytes']} B")
            write()
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
