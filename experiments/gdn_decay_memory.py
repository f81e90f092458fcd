"""How much of a key 500 positions back reaches the query, at initialisation: Gated DeltaNet's decay start.

The MQAR long-context protocol (experiments/mqar.py: 2 layers, d = 128, 4 heads, each mechanism's default short
convolution, n = 8 pairs, T = 512) puts every key at least T − 3n − 1 = 487 positions before its query. At
initialisation, for each model and seed, on one batch of the task:

  * ``retained``: per Gated DeltaNet head, the product of its decays α_t over the last 487 positions (the share of a
    key's write that survives to the query), from the layer's own gates on the batch's inputs; the fraction of
    heads that keep more than 1 %;
  * ``grad_ratio``: ‖∂ loss / ∂ embedding‖ at the first pair's key, over the same at the last query's own token (how
    much the loss can learn from the far key, against the near one).

    python experiments/gdn_decay_memory.py --out docs/results/mqar/gdn_decay_memory.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from mqar import MODEL, build_model, mqar_batch


def retained(model, batch, distance: int) -> list[float]:
    """Per Gated DeltaNet head (every layer): exp(Σ log α_t) over the last ``distance`` positions of each sample,
    the median over samples. The gates are read from the layer's forward inputs with a hook."""
    found = []

    def hook(module, args, kwargs):
        g, _ = module.gates(args[0])  # log α [B, T, H] from the mixer's input
        found.append(g[:, -distance:].sum(1).exp().median(0).values)

    mixers = [m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "gates")]
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in mixers]
    with torch.no_grad():
        model(input_ids=batch["input_ids"])
    for h in handles:
        h.remove()
    return [float(v) for layer in found for v in layer]


def grad_ratio(model, batch, n_pairs: int) -> float:
    ids, labels = batch["input_ids"], batch["labels"]
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=emb).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    loss.backward()
    norms = emb.grad.norm(dim=-1)  # [B, T]
    far, near = norms[:, 0], norms[:, -2]  # the first pair's key; the last query's own position
    return float((far / near.clamp_min(1e-30)).median())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mechanisms", default="gated_delta_net,gated_delta_net_slow_decay,delta_net")
    ap.add_argument("--seeds", default="42,123,999")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--n-pairs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    distance = args.seq_len - 3 * args.n_pairs - 1
    rows = []
    for mechanism in args.mechanisms.split(","):
        for seed in map(int, args.seeds.split(",")):
            model = build_model(mechanism, seed)
            gen = torch.Generator().manual_seed(seed)
            batch = mqar_batch(args.n_pairs, args.batch_size, MODEL["vocab_size"], generator=gen,
                               seq_len=args.seq_len)
            heads = retained(model, batch, distance)
            row = {"mechanism": mechanism, "seed": seed, "distance": distance,
                   "retained_per_head": heads,
                   "heads_keeping_over_1pct": sum(h > 0.01 for h in heads) if heads else None,
                   "grad_ratio_far_near": grad_ratio(model, batch, args.n_pairs)}
            rows.append(row)
            kept = "" if not heads else f"heads keeping > 1 %: {row['heads_keeping_over_1pct']}/{len(heads)}, " \
                f"largest {max(heads):.3g}; "
            print(f"{mechanism:28s} seed {seed:4d}  {kept}grad far/near {row['grad_ratio_far_near']:.3g}")
    summary = {}
    for mechanism in args.mechanisms.split(","):
        ratios = [r["grad_ratio_far_near"] for r in rows if r["mechanism"] == mechanism]
        summary[mechanism] = {"grad_ratio_median": statistics.median(ratios),
                              "grad_ratio_log10_mean": sum(math.log10(max(x, 1e-300)) for x in ratios) / len(ratios)}
    if args.out:
        report = {"experiment": "gdn_decay_memory", "settings": vars(args) | {"out": str(args.out)},
                  "versions": {"torch": torch.__version__}, "runs": rows, "summary": summary}
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
