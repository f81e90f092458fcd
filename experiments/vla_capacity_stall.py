#!/usr/bin/env python
"""Why VLA seed 123 stalls on MQAR n = 24 (T = 73, no short conv) with unit penalty directions: instrumented runs.

The training is experiments/mqar.py's (its model, data, loss, AdamW, cosine schedule with 10 % warmup, clip 1.0),
run for ``--steps`` steps of a ``--schedule-steps`` schedule (the same learning rates as a full run up to there).
Every ``--log-every`` steps it records the loss, the global gradient norm before clipping and the gradient norms of
each layer's parameter groups and of the op's output o (before the output RMSNorm). Every ``--diag-every`` steps it
replays each VLA layer's inputs (the first ``--diag-samples`` samples of the batch) through Algorithm 1 in float64 and
records, per layer: the spectrum of λ₀·A at the end of the sequence (1 = the prior; small = directions the penalty
directions have filled), its condition number, the alignment cos(α̂_t, k̂_t) of the write with the key, how much of α̂
lies in A's weakest eigendirections, |S| at the end, the key features' mutual cosine and the size of the read-out.

Usage (one run a process, one thread; the runs in the JSON came from these, at most two at a time):
    OMP_NUM_THREADS=1 PYTHONPATH=src python experiments/vla_capacity_stall.py --variant vla --seed 123 \
        --steps 700 --out /tmp/stall_vla_123.json
    # the same with --variant vla_algorithm1_u, and --variant vla --seed 42; an intervention adds
    # --option lambda0=1.0 (any VLA option, key=value); then merge:
    python experiments/vla_capacity_stall.py --merge /tmp/stall_*.json \
        --out docs/results/mqar/vla_capacity_stall_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mqar  # noqa: E402  (experiments/mqar.py: data, model, loss, evaluation)

from lazoo.layers.mixers.vla import VLAMixer  # noqa: E402

_RECORD: dict = {"on": False, "inputs": {}, "o_grad": {}, "o_rms": {}}
_ORIGINAL_MIX = VLAMixer.mix


def _recording_mix(self, q, k, v, x, *, mask, state, want_state):
    """VLAMixer.mix, keeping (when asked) the op's inputs as the op sees them and the size/gradient of its output."""
    out = _ORIGINAL_MIX(self, q, k, v, x, mask=mask, state=state, want_state=want_state)
    if _RECORD["on"]:
        layer = self.layer_idx
        with torch.no_grad():
            u = torch.einsum("bthd,hed->bthe", k, self.u_weight)
            qn, kn = self.apply_qk_prenorm(q, k)
            n = _RECORD["samples"]
            _RECORD["inputs"][layer] = [t[:n].detach().double() for t in (qn, kn, v, u)]
            _RECORD["opts"] = self.options
        o = out[0]
        _RECORD["o_rms"][layer] = o.detach().pow(2).mean().sqrt().item()
        if o.requires_grad:
            o.register_hook(lambda g, layer=layer: _RECORD["o_grad"].__setitem__(layer, g.norm().item()))
    return out


VLAMixer.mix = _recording_mix


@torch.no_grad()
def replay(q, k, v, u, opts):
    """Algorithm 1 in float64 (the layer's λ₀ and η, scaled as VLAMixer does) on recorded inputs: diagnostics."""
    B, T, H, d = k.shape
    scale = d if opts["penalty_norm"] == "unit" else 1
    lam, eta, period = opts["lambda0"] / scale, opts["refresh_eta"] * scale, opts["refresh_period"]
    kf = F.elu(k) + 1
    qf = F.elu(q) + 1
    kh = F.normalize(kf, dim=-1)
    uh = F.normalize(u, dim=-1) / math.sqrt(d)
    A = torch.eye(d, dtype=k.dtype).repeat(B, H, 1, 1) / lam
    S = torch.zeros(B, H, d, d, dtype=k.dtype)
    z = torch.zeros(B, H, d, dtype=k.dtype)
    eye = torch.eye(d, dtype=k.dtype)
    cos_ak, weak_frac, readout, read_ratio = [], [], [], []
    for t in range(T):
        zs = torch.einsum("bhij,bhj->bhi", A, uh[:, t])
        delta = 1 + (uh[:, t] * zs).sum(-1)
        A = A - zs[..., :, None] * zs[..., None, :] / delta[..., None, None]
        if period > 0 and (t + 1) % period == 0:
            A = A + eta * eye
        a = F.normalize(torch.einsum("bhij,bhj->bhi", A, kh[:, t]), dim=-1)
        cos_ak.append((a * kh[:, t]).sum(-1))
        # the share of α̂ in the eigendirections of A with λ₀·eig > 0.5 (not yet filled by penalty directions)
        ev, evec = torch.linalg.eigh(A)
        proj = torch.einsum("bhij,bhi->bhj", evec, a) ** 2
        weak_frac.append((proj * (ev * lam > 0.5)).sum(-1))
        e = v[:, t] - torch.einsum("bhvk,bhk->bhv", S, kh[:, t])
        S = S + e[..., :, None] * a[..., None, :]
        z = z + kf[:, t]
        num = torch.einsum("bhvk,bhk->bhv", S, qf[:, t])
        den = (z * qf[:, t]).sum(-1, keepdim=True).clamp_min(opts["eps"])
        readout.append((num / den).norm(dim=-1))
        read_ratio.append(num.norm(dim=-1) / den.squeeze(-1) / v[:, t].norm(dim=-1).clamp_min(1e-12))
    ev = torch.linalg.eigvalsh(A) * lam  # λ₀·A: 1 = the prior
    kcos = torch.einsum("bthd,bshd->bhts", kh, kh)
    un = F.normalize(u, dim=-1)
    ucos = torch.einsum("bthd,bshd->bhts", un, un).abs()
    off = ~torch.eye(T, dtype=torch.bool)
    cos_ak = torch.stack(cos_ak, 1)
    return {
        "lam0A_eig_min": ev[..., 0].mean().item(), "lam0A_eig_median": ev[..., d // 2].mean().item(),
        "lam0A_eig_max": ev[..., -1].mean().item(),
        "log10_cond_A": torch.log10(ev[..., -1] / ev[..., 0]).mean().item(),
        "n_eig_below_0.5": (ev < 0.5).sum(-1).double().mean().item(),
        "cos_alpha_k_mean": cos_ak.mean().item(), "cos_alpha_k_first8": cos_ak[:, :8].mean().item(),
        "cos_alpha_k_last8": cos_ak[:, -8:].mean().item(),
        "alpha_share_unfilled_dirs": torch.stack(weak_frac, 1).mean().item(),
        "S_fro_end": S.norm(dim=(-1, -2)).mean().item(),
        "key_feature_cos_mean": kcos[..., off].mean().item(), "u_abs_cos_mean": ucos[..., off].mean().item(),
        "readout_norm_mean": torch.stack(readout, 1).mean().item(),
        "readout_over_v_mean": torch.stack(read_ratio, 1).mean().item(),
    }


def grad_groups(model):
    """Gradient norm per (layer, part): mixer projections, u_weight, o_norm, mlp, norms; and the embedding."""
    groups: dict[str, float] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        parts = name.split(".")
        key = (f"L{parts[2]}.{parts[4] if parts[3] == 'mixer' else parts[3]}" if parts[1] == "layers"
               else parts[1])
        groups[key] = groups.get(key, 0.0) + p.grad.double().pow(2).sum().item()
    return {k: v ** 0.5 for k, v in sorted(groups.items())}


def parse_value(s):
    for kind in (int, float):
        try:
            return kind(s)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(s.lower(), s)


def run(args):
    torch.set_num_threads(1)
    options = {o.split("=", 1)[0]: parse_value(o.split("=", 1)[1]) for o in args.option}
    base, variant = mqar.VARIANTS.get(args.variant, (args.variant, {}))
    name = args.variant + "".join(f"+{k}={v}" for k, v in options.items())
    mqar.VARIANTS[name] = (base, {**variant, **options})
    margs = mqar.parse_args(["--device", "cpu", "--steps", str(args.schedule_steps)])
    margs.eval_batches = args.eval_batches
    model = mqar.build_model(name, args.seed, vocab_size=margs.vocab_size, use_short_conv=False).train()
    opt, sched = mqar.make_optimizer(model, margs, args.schedule_steps)
    gen = torch.Generator().manual_seed(args.seed)
    _RECORD["samples"] = args.diag_samples
    log, diags = [], []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = mqar.mqar_batch(args.n_pairs, margs.batch_size, margs.vocab_size, generator=gen)
        want_log = step % args.log_every == 0 or step == 1
        want_diag = step % args.diag_every == 0 or step == 1
        _RECORD["on"] = want_log or want_diag
        loss, hits, mask = mqar.masked_loss_and_hits(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        _RECORD["on"] = False
        if want_log:
            entry = {"step": step, "lr": sched.get_last_lr()[0], "loss": loss.item(),
                     "train_acc": (hits.sum() / mask.sum()).item(), "grad_groups": grad_groups(model),
                     "o_rms": dict(_RECORD["o_rms"]), "o_grad_norm": dict(_RECORD["o_grad"])}
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), margs.clip)
        opt.step()
        sched.step()
        if want_log:
            entry["grad_norm_total"] = total.item()
            log.append(entry)
            print(f"{name} s{args.seed} step {step} loss {loss.item():.3f} |g| {total.item():.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
        if want_diag:
            d = {"step": step}
            for layer, tensors in sorted(_RECORD["inputs"].items()):
                d[f"L{layer}"] = replay(*tensors, _RECORD["opts"])
            diags.append(d)
    train_s = time.perf_counter() - t0
    result = {"run": name, "variant": {"mechanism": base, **variant, **options}, "seed": args.seed,
              "n_pairs": args.n_pairs, "seq_len": 3 * args.n_pairs + 1, "steps": args.steps,
              "schedule_steps": args.schedule_steps, "train_seconds": train_s,
              **mqar.evaluate(model, args.n_pairs, margs, args.seed), "log": log, "diagnostics": diags}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": [result]}, indent=1))
    print(f"{name} s{args.seed}: acc {result['acc']:.3f} eval_loss {result['eval_loss']:.3f} ({train_s:.0f}s)")


def merge(args):
    runs = [r for f in args.merge for r in json.loads(Path(f).read_text())["runs"]]
    report = {"experiment": "VLA MQAR capacity stall (seed 123, unit penalty directions), instrumented, CPU",
              "command": __doc__.split("Usage")[1].strip(),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "machine": platform.processor() or platform.machine()},
              "notes": args.note, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", default="vla", help="a mechanism or a variant name of experiments/mqar.py")
    p.add_argument("--option", action="append", default=[], help="a VLA option key=value on top of the variant")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--n-pairs", type=int, default=24)
    p.add_argument("--steps", type=int, default=700, help="steps run")
    p.add_argument("--schedule-steps", type=int, default=2000, help="the length of the warmup + cosine schedule")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--diag-every", type=int, default=25)
    p.add_argument("--diag-samples", type=int, default=8)
    p.add_argument("--eval-batches", type=int, default=15)
    p.add_argument("--merge", nargs="*", default=None, help="merge these per-run JSON files into --out")
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    merge(args) if args.merge else run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
