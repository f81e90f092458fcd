"""ELA-GPT ablation (the ELA paper, §VI) at a CPU budget: full-attention GPT vs ELA-GPT (Hadamard-exp and
sum-squared-Euclidean kernels), each with the usual residual, with Hyper-Link, and with Hyper-Link + a
causal Memory Lobe (`--steps`); then the leak experiment (`--leak-steps`, longer): ELA-GPT with the causal
Memory Lobe against the paper's bidirectional one in the same causal LM.

Every run: the same tokenizer, train/held-out blocks, batch order, optimiser, steps and MoE feed-forward
(4 experts, top-2, eq-14 routing-score bias, aux-loss coefficient 0.01); only the mixer and the decoder
options differ. Two held-out losses are reported:

- `eval_loss`: the usual teacher-forced loss (one forward over each block, every position scored);
- `causal_eval_loss`: each position scored by a forward over its prefix only (what the model achieves
  when it generates). For a causal model both are equal; a model that reads future tokens (the
  bidirectional lobe) gets a much lower `eval_loss` than `causal_eval_loss`: the gap is the leak.

    OMP_NUM_THREADS=1 python experiments/ela_gpt.py                      # ~10 min on one core
    python experiments/ela_gpt.py --steps 20 --only softmax,ela-hexp-hl  # a quick look
    # the paper's ablation scale (4 layers, d 256, 4 heads, 4 experts, vocabulary 6400: 5,839,104 parameters
    # against its 5,838,864; 3500 samples of 129 tokens, batch 20: 175 steps an epoch; 10 epochs), on a GPU
    python experiments/ela_gpt.py --device cuda --layers 4 --hidden-size 256 --heads 4 --experts 4 \
        --expert-size 256 --vocab-size 6400 --seq-len 129 --batch-size 20 --chapters 480 --steps 1750 \
        --leak-steps 0 --eval-every 175
    # a machine without `datasets` (a GPU box): build the blocks elsewhere once, carry the folder, and split the
    # variants over processes sharing one GPU, then merge their reports
    python experiments/ela_gpt.py --chapters 480 --vocab-size 6400 --seq-len 129 --data-cache blocks --prepare-only
    python experiments/ela_gpt.py ... --data-cache blocks --only softmax,softmax-hl,softmax-hl-lobe --json a.json
    python experiments/ela_gpt.py --merge a.json b.json c.json --json all.json --figure all.png

Writes docs/results/ela_gpt.json and docs/figures/ela_gpt_loss.png (the report is rewritten after every variant).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

#: name -> (mechanism, ELA kernel or None, hyper_link, memory_lobe); hyper_link "stream": Hyper-Link whose
#: feed-forward reads the normalised stream (`hyper_link_ffn_input="stream"`), not the mixer's output
VARIANTS = {
    "softmax": ("softmax", None, False, None),
    "softmax-hl": ("softmax", None, True, None),
    "softmax-hl-lobe": ("softmax", None, True, "causal"),
    "ela-hexp": ("ela", "hadamard_exp", False, None),
    "ela-hexp-hl": ("ela", "hadamard_exp", True, None),
    "ela-hexp-hl-lobe": ("ela", "hadamard_exp", True, "causal"),
    "ela-sse": ("ela", "sum_sq_euclid", False, None),
    "ela-sse-hl": ("ela", "sum_sq_euclid", True, None),
    "ela-sse-hl-lobe": ("ela", "sum_sq_euclid", True, "causal"),
    "softmax-hls": ("softmax", None, "stream", None),
    "ela-hexp-hls": ("ela", "hadamard_exp", "stream", None),
    "ela-sse-hls": ("ela", "sum_sq_euclid", "stream", None),
}
#: the leak experiment: the paper's bidirectional lobe inside a causal LM (it reads the tokens it predicts)
LEAK_VARIANTS = {
    "ela-hexp-hl-lobe": ("ela", "hadamard_exp", True, "causal"),
    "ela-hexp-hl-bilobe (leak)": ("ela", "hadamard_exp", True, "bidirectional"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--leak-steps", type=int, default=600, help="steps of the leak experiment (0: skip it)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--expert-size", type=int, default=96, help="SwiGLU width of each expert")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--chapters", type=int, default=400, help="KJV chapters used (tokenizer and blocks)")
    p.add_argument("--eval-blocks", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--leak-eval-every", type=int, default=50)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (the paper's smallest scale needs a GPU)")
    p.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    p.add_argument("--json", default=str(ROOT / "docs/results/ela_gpt.json"))
    p.add_argument("--figure", default=str(ROOT / "docs/figures/ela_gpt_loss.png"))
    p.add_argument("--data-cache", default=None,
                   help="folder holding the tokenizer and blocks: read if it exists, else built and written there")
    p.add_argument("--prepare-only", action="store_true", help="write --data-cache and stop")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="combine reports of variant subsets into --json and --figure (nothing is trained)")
    return p.parse_args(argv)


def load_data(args):
    """Tokenizer (byte-level BPE trained on the training chapters) and `[N, seq_len]` train/held-out blocks,
    from `--data-cache` when it holds them (built with the same settings, which it records)."""
    cache = Path(args.data_cache) if args.data_cache else None
    settings = {"chapters": args.chapters, "seq_len": args.seq_len, "vocab_size": args.vocab_size,
                "seed": args.seed, "eval_blocks": args.eval_blocks}
    if cache is not None and (cache / "blocks.pt").exists():
        from transformers import AutoTokenizer

        saved = torch.load(cache / "blocks.pt")
        if saved["settings"] != settings:
            raise SystemExit(f"--data-cache {cache} was built with {saved['settings']}, not {settings}")
        return AutoTokenizer.from_pretrained(cache), saved["train"], saved["held_out"]
    tokenizer, train, held_out = build_data(args)
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(cache)
        torch.save({"settings": settings, "train": train, "held_out": held_out}, cache / "blocks.pt")
    return tokenizer, train, held_out


def build_data(args):
    from datasets import Dataset

    import lazoo.data

    chapters = lazoo.data.load_default_corpus()[: args.chapters]
    data = lazoo.data.build_lm_datasets(Dataset.from_dict({"text": chapters}), block_size=args.seq_len,
                                        vocab_size=args.vocab_size, eval_fraction=0.05, seed=args.seed,
                                        max_eval_blocks=args.eval_blocks)
    train = torch.tensor(data.train["input_ids"])
    held_out = torch.tensor(data.eval["input_ids"])
    return data.tokenizer, train, held_out


def build_model(args, tokenizer, mechanism, kernel, hyper_link, lobe):
    from transformers import AutoConfig, AutoModelForCausalLM

    import lazoo  # noqa: F401  (registers the model types)

    fields = dict(vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, intermediate_size=2 * args.expert_size,
                  hyper_link=bool(hyper_link), hyper_link_ffn_input="stream" if hyper_link == "stream" else "mixer",
                  memory_lobe=lobe, moe_num_experts=args.experts, moe_top_k=2,
                  moe_intermediate_size=args.expert_size, moe_bias="eq14", router_aux_loss_coef=0.01,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if kernel is not None:
        fields["kernel"] = kernel
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(f"lazoo_{mechanism}", **fields))


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


@torch.no_grad()
def teacher_forced_loss(model, blocks):
    model.eval()
    loss = lm_loss(model(blocks, use_cache=False).logits, blocks).item()
    model.train()
    return loss


@torch.no_grad()
def prefix_loss(model, blocks):
    """Mean next-token loss where position t is predicted from a forward over tokens 0..t only."""
    model.eval()
    total, T = 0.0, blocks.shape[1]
    for t in range(T - 1):
        logits = model(blocks[:, : t + 1], use_cache=False).logits[:, -1]
        total += F.cross_entropy(logits.float(), blocks[:, t + 1], reduction="sum").item()
    model.train()
    return total / (blocks.shape[0] * (T - 1))


def train_one(args, name, spec, tokenizer, train, held_out, steps, eval_every):
    model = build_model(args, tokenizer, *spec).to(args.device).train()
    train, held_out = train.to(args.device), held_out.to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))  # same for every run
    curve, evals, aux = [], [], []
    start = time.time()
    for step in range(steps):
        idx = order[(step * args.batch_size + torch.arange(args.batch_size)) % len(train)].to(args.device)
        batch = train[idx]
        out = model(batch, labels=batch, use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        curve.append(lm_loss(out.logits.detach(), batch).item())  # the LM part, without the aux loss
        aux.append(out.aux_loss.item())
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            evals.append((step + 1, teacher_forced_loss(model, held_out)))
    seconds = time.time() - start
    result = {
        "mechanism": spec[0], "kernel": spec[1], "hyper_link": spec[2], "memory_lobe": spec[3],
        "parameters": n_params, "steps": steps, "train_seconds": round(seconds, 1),
        "final_train_loss": sum(curve[-10:]) / len(curve[-10:]),
        "eval_loss": evals[-1][1], "causal_eval_loss": prefix_loss(model, held_out),
        "final_aux_loss": sum(aux[-10:]) / len(aux[-10:]),
        "train_curve": curve, "eval_curve": evals,
    }
    print(f"{name:28s} params {n_params:>8,d}  train {result['final_train_loss']:.3f}  eval {result['eval_loss']:.3f}"
          f"  causal eval {result['causal_eval_loss']:.3f}  aux {result['final_aux_loss']:.3f}  ({seconds:.0f} s)",
          flush=True)
    return result


def _smooth(values, width=9):
    curve = torch.tensor(values)
    return torch.nn.functional.avg_pool1d(curve[None, None], width, 1, width // 2, count_include_pad=False)[0, 0]


def plot(results, leak, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if leak else 2, figsize=(19 if leak else 13, 4.8))
    colors = {"softmax": "tab:blue", "ela-hexp": "tab:orange", "ela-sse": "tab:green"}
    for name, r in results.items():
        base = next(k for k in ("ela-hexp", "ela-sse", "softmax") if name.startswith(k))
        ls = "-" if name.endswith("lobe") else {"-hl": "--", "hls": "-."}.get(name[-3:], ":")
        axes[0].plot(range(1, len(r["train_curve"]) + 1), _smooth(r["train_curve"]), ls, color=colors[base],
                     lw=1.3, label=name)
        steps, losses = zip(*r["eval_curve"])
        axes[1].plot(steps, losses, ls, marker="o", ms=3, color=colors[base], label=name)
    axes[0].set(title="training loss (LM part, 9-step moving mean)", xlabel="step", ylabel="cross-entropy (nats)")
    axes[1].set(title="held-out loss (: residual, -- Hyper-Link, -. reading the stream, - + causal lobe)",
                xlabel="step")
    axes[1].legend(fontsize=7, ncol=2)
    if leak:
        ax = axes[2]
        for (name, r), color in zip(leak.items(), ("tab:orange", "tab:red")):
            steps, losses = zip(*r["eval_curve"])
            ax.plot(steps, losses, "-", marker="o", ms=3, color=color, label=f"{name}: teacher-forced")
            ax.axhline(r["causal_eval_loss"], color=color, ls="--", lw=1,
                       label=f"{name}: scored on prefixes only (end)")
            ax.plot(range(1, len(r["train_curve"]) + 1), _smooth(r["train_curve"], 25), color=color, alpha=0.35,
                    lw=1, label=f"{name}: training (25-step mean)")
        ax.set(title="leak: held-out loss, teacher-forced vs prefix-only", xlabel="step",
               ylim=(min(r["eval_loss"] for r in leak.values()) - 0.3, 5.5))
        ax.legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    names = list(VARIANTS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--only: unknown variants {unknown}; known: {list(VARIANTS)}")
    if args.merge:
        return merge(args)
    start = time.time()
    tokenizer, train, held_out = load_data(args)
    if args.prepare_only:
        print(f"wrote {args.data_cache}: {len(train)} training and {len(held_out)} held-out blocks")
        return
    print(f"{len(train)} training blocks, {len(held_out)} held-out blocks of {args.seq_len} tokens; "
          f"{args.steps} steps x {args.batch_size} blocks = {args.steps * args.batch_size * args.seq_len:,d} "
          f"training tokens per run; torch threads {torch.get_num_threads()}", flush=True)
    results, leak = {}, {}
    report = {
        "setup": {
            "corpus": f"first {args.chapters} KJV chapters (lazoo.data.load_default_corpus), 5% of them held out",
            "tokenizer": f"byte-level BPE, {len(tokenizer)} tokens, trained on the training chapters",
            "model": {"hidden_size": args.hidden_size, "layers": args.layers, "heads": args.heads,
                      "moe": f"{args.experts} experts (SwiGLU width {args.expert_size}), top-2, eq-14 bias, "
                             "aux coef 0.01"},
            "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "train_tokens_per_run": args.steps * args.batch_size * args.seq_len,
            "leak_steps": args.leak_steps,
            "leak_train_tokens_per_run": args.leak_steps * args.batch_size * args.seq_len,
            "train_blocks": len(train), "held_out_blocks": len(held_out),
            "optimizer": f"AdamW lr {args.lr}, betas (0.9, 0.95), {max(1, args.steps // 10)} warmup steps, "
                         "cosine decay, grad clip 1.0",
            "seed": args.seed, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "wall_seconds": None,
        },
        "results": results,
        "leak_experiment": leak,
    }
    for name in names:  # the report is rewritten after each run, so a stopped job keeps what it finished
        results[name] = train_one(args, name, VARIANTS[name], tokenizer, train, held_out, args.steps, args.eval_every)
        write_report(report, start, args.json)
    if args.leak_steps:
        print(f"leak experiment: {args.leak_steps} steps", flush=True)
        for name, spec in LEAK_VARIANTS.items():
            leak[name] = train_one(args, name, spec, tokenizer, train, held_out, args.leak_steps, args.leak_eval_every)
            write_report(report, start, args.json)
    plot(results, leak, args.figure)
    print(f"wrote {args.json} and {args.figure} ({report['setup']['wall_seconds']:.0f} s)")


def write_report(report, start, path):
    report["setup"]["wall_seconds"] = round(time.time() - start, 1)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


def merge(args):
    """One report from reports of variant subsets run with the same settings (their setups must agree except
    for the wall time, which becomes each part's)."""
    parts = [json.loads(Path(p).read_text()) for p in args.merge]
    setups = [{k: v for k, v in part["setup"].items() if k != "wall_seconds"} for part in parts]
    if any(s != setups[0] for s in setups[1:]):
        raise SystemExit("--merge: the reports were made with different settings")
    report = {"setup": {**setups[0], "wall_seconds": [part["setup"]["wall_seconds"] for part in parts]},
              "results": {}, "leak_experiment": {}}
    for part in parts:
        report["results"].update(part["results"])
        report["leak_experiment"].update(part["leak_experiment"])
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    plot(report["results"], report["leak_experiment"], args.figure)
    print(f"wrote {args.json} and {args.figure}")


if __name__ == "__main__":
    main()
