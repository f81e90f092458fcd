"""Why does ELA-GPT's Hyper-Link (`hyper_link=True`: `out = x + FFN(Mixer(norm(x)))`) converge slower than the usual
pre-norm layer (`h = x + Mixer(norm(x)); out = h + FFN(norm(h))`)? An ablation that separates the parts of the change:

- (a) no norm between the mixer and the FFN (the FFN, router included, reads the mixer's raw output);
- (b) no residual path of the mixer's own (attention reaches the stream only through the routed MoE);
- (c) one residual branch per layer instead of two (depth).

It reuses experiments/ela_gpt.py (`load_data`, `build_model`, `train_one`: the same data, optimiser, schedule, batch
order and MoE) and swaps the forward of each decoder layer of a built model for one of these (nothing under src/
changes; `residual` and `hyper-link` are the shipped forwards):

    residual              h = x + M(n(x)); out = h + F(n2(h))  (hyper_link=False)
    hyper-link            out = x + F(M(n(x)))                 (hyper_link=True, as shipped)
    hl+norm               out = x + F(n2(M(n(x))))             (a fixed; n2 a fresh RMSNorm)
    hl+mixres             out = x + M(n(x)) + F(M(n(x)))       (b fixed)
    hl+norm+mixres        out = x + M(n(x)) + F(n2(M(n(x))))   (a and b fixed; F still sees M only)
    hl+gain               out = x + F(g * M(n(x)))             (a, scale only: scalar g = 1/RMS(M) at init)
    parallel              out = x + M(n(x)) + F(n2(x))         (two branches, one stage; F never sees M)
    hl+stream             out = x + F(n2(x + M(n(x))))         (hyper_link_ffn_input="stream": F reads the stream)
    hl+stream-raw         out = x + F(x + M(n(x)))             (the same without n2)
    hyper-link-2xlayers   hyper-link with twice the layers     (c: as many residual branches as residual)
    residual-half-layers  residual with half the layers        (c: as many residual branches as hyper-link)

Every run also records, per layer, the RMS of the mixer output `M`, of the FFN input and of the FFN output on the
held-out blocks (at init and at every evaluation), and the gradient norm of each layer's mixer and FFN parameters at
every training step (before clipping).

    # every variant, softmax and ELA (hadamard_exp), 2 seeds: ~9.5 min on one core (--data-cache: the tokenizer and
    # blocks are built once, then read)
    OMP_NUM_THREADS=1 PYTHONPATH=src python experiments/ela_gpt_hyper_link_ablation.py --seeds 0 1 \\
        --data-cache /tmp/ela_hl_blocks
    # the stored report was made in two commands: the above without hl+stream / hl+stream-raw, then these added
    OMP_NUM_THREADS=1 PYTHONPATH=src python experiments/ela_gpt_hyper_link_ablation.py --seeds 0 1 \\
        --data-cache /tmp/ela_hl_blocks --variants hl+stream hl+stream-raw --add
    # a quick look
    OMP_NUM_THREADS=1 PYTHONPATH=src python experiments/ela_gpt_hyper_link_ablation.py --mixers softmax --steps 20 \\
        --variants residual hyper-link hl+stream --out /tmp/hl.json

The model settings are ela_gpt.py's (defaults: 2 layers, d 64, 4 heads, 4 experts top-2, 200 steps); the data are
always built with `--data-seed` (so every seed is scored on the same held-out blocks), the seed sets the init and the
batch order. Writes docs/results/ela_gpt_hyper_link_ablation.json (rewritten after every run) and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ela_gpt  # noqa: E402  (experiments/ela_gpt.py: data, model, training loop)

from lazoo.layers.moe import RoutedMoE  # noqa: E402
from lazoo.models.modeling_lazoo import decoder_norm, zero_pads  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

#: mixer name -> (mechanism, ELA kernel or None)
MIXERS = {"softmax": ("softmax", None), "ela-hexp": ("ela", "hadamard_exp")}
#: variant -> (hyper_link of the built model, replacement forward or None (shipped), layer-count factor)
VARIANTS = {
    "residual": (False, None, 1.0),
    "hyper-link": (True, None, 1.0),
    "hl+norm": (True, "hl_norm", 1.0),
    "hl+mixres": (True, "hl_mixres", 1.0),
    "hl+norm+mixres": (True, "hl_norm_mixres", 1.0),
    "hl+gain": (True, "hl_gain", 1.0),
    "parallel": (False, "parallel", 1.0),
    "hl+stream": ("stream", None, 1.0),  # the shipped option hyper_link_ffn_input="stream"
    "hl+stream-raw": (True, "hl_stream_raw", 1.0),
    "hyper-link-2xlayers": (True, None, 2.0),
    "residual-half-layers": (False, None, 0.5),
}


# ----------------------------------------------------------------------------------------------------------- forwards
def _mixer(layer, hidden_states, mask, position_ids, cache):
    return layer.mixer(layer.input_norm(hidden_states), mask=mask, position_ids=position_ids, cache=cache)


def _ffn(layer, h, mask):
    return layer.mlp(h, mask) if isinstance(layer.mlp, RoutedMoE) else layer.mlp(h)


def _checked(fn):
    def forward(self, hidden_states, mask=None, position_ids=None, cache=None, cu_seqlens=None,
                output_attentions=False, **kwargs):
        if cu_seqlens is not None or output_attentions or self.memory_lobe is not None or self.mixer is None:
            raise NotImplementedError("ablation forwards: no packing, attention weights, lobe or mixer-less layer")
        hidden_states = zero_pads(hidden_states, mask)
        return fn(self, hidden_states, _mixer(self, hidden_states, mask, position_ids, cache), mask)
    return forward


FORWARDS = {
    "hl": _checked(lambda s, x, m, mask: x + _ffn(s, m, mask)),  # the shipped Hyper-Link (used by the check only)
    "hl_norm": _checked(lambda s, x, m, mask: x + _ffn(s, s.ablation_norm(m), mask)),
    "hl_mixres": _checked(lambda s, x, m, mask: x + m + _ffn(s, m, mask)),
    "hl_norm_mixres": _checked(lambda s, x, m, mask: x + m + _ffn(s, s.ablation_norm(m), mask)),
    "hl_gain": _checked(lambda s, x, m, mask: x + _ffn(s, s.ablation_gain * m, mask)),
    "parallel": _checked(lambda s, x, m, mask: x + m + _ffn(s, s.post_mixer_norm(x), mask)),
    "hl_stream_raw": _checked(lambda s, x, m, mask: x + _ffn(s, x + m, mask)),
}


def patch(model, kind, probe):
    """Give every decoder layer of `model` the forward `kind` (adding the parameters it needs)."""
    for layer in model.model.layers:
        if kind in ("hl_norm", "hl_norm_mixres"):
            layer.ablation_norm = decoder_norm(model.config)  # fresh, like post_mixer_norm (weight 1)
        if kind == "hl_gain":  # a learned scalar, set so that g*M has RMS 1 at init (probe: RMS of M per layer)
            layer.ablation_gain = torch.nn.Parameter(torch.tensor(1.0 / probe[layer]))
        layer.forward = types.MethodType(FORWARDS[kind], layer)


# ------------------------------------------------------------------------------------------------------------ probes
def _rms(t):
    return t.detach().float().pow(2).mean().sqrt().item()


class Probe:
    """Per-layer RMS of the mixer output / FFN input / FFN output on full-length eval forwards (one record per
    teacher-forced evaluation), and per-layer gradient norms of the mixer and FFN parameters at every step."""

    def __init__(self, model, seq_len):
        self.model, self.seq_len = model, seq_len
        self.records, self.grads = [], []  # [{layer: {...}}], [{"mixer": [...], "ffn": [...]}]
        self._current = None
        self._grad_acc = None
        layers = list(model.model.layers)
        self.n = len(layers)
        for i, layer in enumerate(layers):
            layer.mixer.register_forward_hook(self._hook(i, "mixer_out", output=True))
            layer.mlp.register_forward_pre_hook(self._hook(i, "ffn_in", output=False))
            layer.mlp.register_forward_hook(self._hook(i, "ffn_out", output=True))
            layer.register_forward_pre_hook(self._hook(i, "stream_in", output=False))
            for part, module in (("mixer", layer.mixer), ("ffn", layer.mlp)):
                for p in module.parameters():
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(self._grad_hook(i, part))
        model.register_forward_pre_hook(self._model_pre)

    def _full_eval(self, module, t):
        return not module.training and t.dim() == 3 and t.shape[1] == self.seq_len

    def _model_pre(self, module, args, kwargs=None):
        if module.training:  # a training step starts: close the last one's gradient record
            self.flush_grads()
            self._grad_acc = {"mixer": [0.0] * self.n, "ffn": [0.0] * self.n}
        else:
            ids = args[0] if args else None
            self._current = {} if ids is not None and ids.shape[-1] == self.seq_len else None
            if self._current is not None:
                self.records.append(self._current)

    def _hook(self, i, what, output):
        def hook(module, args, out=None):
            t = out if output else args[0]
            if isinstance(t, tuple):
                t = t[0]
            if self._current is not None and self._full_eval(module, t):
                self._current.setdefault(i, {})[what] = _rms(t)
        return hook

    def _grad_hook(self, i, part):
        def hook(p):
            if self._grad_acc is not None and p.grad is not None:
                self._grad_acc[part][i] += p.grad.detach().float().pow(2).sum().item()
        return hook

    def flush_grads(self):
        if self._grad_acc is not None:
            self.grads.append({k: [math.sqrt(v) for v in vs] for k, vs in self._grad_acc.items()})
            self._grad_acc = None


# ------------------------------------------------------------------------------------------------------------ running
class Context:
    held_out = None
    train_probe = None  # the training blocks that set hl+gain's initial gain
    init_loss = None
    variant = None
    probe = None


def build_model(args, tokenizer, mechanism, kernel, hyper_link, lobe):
    """ela_gpt.build_model, then the ablation's forward and the probes (ela_gpt.train_one calls this)."""
    model = _ORIGINAL_BUILD(args, tokenizer, mechanism, kernel, hyper_link, lobe)
    kind = VARIANTS[Context.variant][1]
    if kind is not None:
        mixer_rms = {}
        if kind == "hl_gain":  # each layer's RMS of M on a training batch (shipped forward), for the gain's init
            hooks = [layer.mixer.register_forward_hook(
                lambda m, a, o, layer=layer: mixer_rms.__setitem__(layer, _rms(o))) for layer in model.model.layers]
            with torch.no_grad():
                model.eval()(Context.train_probe, use_cache=False)
            for h in hooks:
                h.remove()
        patch(model, kind, mixer_rms)
    Context.probe = Probe(model, args.seq_len)
    Context.init_loss = ela_gpt.teacher_forced_loss(model, Context.held_out)  # the init record (draws no RNG)
    model.train()
    return model


_ORIGINAL_BUILD = ela_gpt.build_model
ela_gpt.build_model = build_model  # train_one builds through the module global


def check_patching(args, tokenizer, held_out):
    """The patch mechanism reproduces the shipped Hyper-Link: a hyper_link=True model whose layers get the ablation
    "hl" forward gives the same logits as the shipped one (same seed, same weights)."""
    shipped = _ORIGINAL_BUILD(args, tokenizer, "softmax", None, True, None).eval()
    patched = _ORIGINAL_BUILD(args, tokenizer, "softmax", None, True, None).eval()
    patch(patched, "hl", {})
    with torch.no_grad():
        a = shipped(held_out[:4], use_cache=False).logits
        b = patched(held_out[:4], use_cache=False).logits
    diff = (a - b).abs().max().item()
    if diff > 1e-5:
        raise SystemExit(f"patched Hyper-Link differs from the shipped one: max |logit diff| {diff}")
    return diff


def summarise(probe, init_loss):
    """Per-layer RMS at init and at the end, and the RMS curve per eval, from a run's probe."""
    recs = probe.records
    per_eval = [{str(i): {k: round(v, 5) for k, v in r[i].items()} for i in sorted(r)} for r in recs]
    grads = probe.grads

    def mean_grad(part, lo, hi):
        window = grads[lo:hi]
        return [round(sum(g[part][i] for g in window) / max(1, len(window)), 5) for i in range(probe.n)]

    return {
        "rms_init": per_eval[0], "rms_end": per_eval[-1], "rms_per_eval": per_eval,
        "init_eval_loss": init_loss,
        "grad_norm_mixer_steps_1_10": mean_grad("mixer", 0, 10),
        "grad_norm_ffn_steps_1_10": mean_grad("ffn", 0, 10),
        "grad_norm_mixer_last_10": mean_grad("mixer", len(grads) - 10, len(grads)),
        "grad_norm_ffn_last_10": mean_grad("ffn", len(grads) - 10, len(grads)),
        "grad_norm_mixer_per_step": [[round(v, 5) for v in g["mixer"]] for g in grads],
        "grad_norm_ffn_per_step": [[round(v, 5) for v in g["ffn"]] for g in grads],
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixers", nargs="+", default=list(MIXERS), choices=list(MIXERS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "docs/results/ela_gpt_hyper_link_ablation.json"))
    p.add_argument("--add", action="store_true",
                   help="keep the runs already in --out (made with the same settings) and add these to them")
    args, rest = p.parse_known_args(argv)
    base = ela_gpt.parse_args(rest + ["--leak-steps", "0"])
    return args, base


def main(argv=None):
    torch.set_num_threads(1)
    args, base = parse_args(argv)
    start = time.time()
    data_args = copy.copy(base)
    data_args.seed = args.data_seed
    tokenizer, train, held_out = ela_gpt.load_data(data_args)
    Context.held_out, Context.train_probe = held_out, train[: base.batch_size]
    diff = check_patching(base, tokenizer, held_out)
    print(f"{len(train)} training / {len(held_out)} held-out blocks; patched Hyper-Link == shipped "
          f"(max |logit diff| {diff:.1e}); torch threads {torch.get_num_threads()}", flush=True)
    report = {
        "setup": {
            "script": "experiments/ela_gpt_hyper_link_ablation.py",
            "command": " ".join(["OMP_NUM_THREADS=1 PYTHONPATH=src python experiments/ela_gpt_hyper_link_ablation.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "variants": {v: VARIANTS[v][1] or ("shipped" + ("" if VARIANTS[v][2] == 1 else
                                                            f", layers x{VARIANTS[v][2]}")) for v in args.variants},
            "model": {"hidden_size": base.hidden_size, "layers": base.layers, "heads": base.heads,
                      "experts": base.experts, "expert_size": base.expert_size, "top_k": 2, "moe_bias": "eq14"},
            "steps": base.steps, "batch_size": base.batch_size, "seq_len": base.seq_len, "lr": base.lr,
            "eval_every": base.eval_every, "data_seed": args.data_seed, "seeds": args.seeds,
            "train_blocks": len(train), "held_out_blocks": len(held_out), "patch_check_max_logit_diff": diff,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "wall_seconds": None,
        },
        "results": {},
    }
    out = Path(args.out)
    if args.add and out.exists():  # earlier runs with the same settings stay; this command's runs are added
        old = json.loads(out.read_text())
        same = ("model", "steps", "batch_size", "seq_len", "lr", "eval_every", "data_seed", "train_blocks")
        if any(old["setup"][k] != report["setup"][k] for k in same):
            raise SystemExit(f"--add: {out} was made with other settings")
        report["results"] = old["results"]
        report["setup"]["command"] = [*_as_list(old["setup"]["command"]), report["setup"]["command"]]
        report["setup"]["variants"] = {**old["setup"]["variants"], **report["setup"]["variants"]}
        report["setup"]["seeds"] = sorted(set(old["setup"]["seeds"]) | set(args.seeds))
        start -= _as_list(old["setup"]["wall_seconds"])[-1]  # wall_seconds: the total of the commands
    for mixer in args.mixers:
        for variant in args.variants:
            for seed in args.seeds:
                hyper_link, _, layer_factor = VARIANTS[variant]
                run_args = copy.copy(base)
                run_args.seed = seed
                run_args.layers = max(1, round(base.layers * layer_factor))
                Context.variant = variant
                spec = (*MIXERS[mixer], hyper_link, None)
                name = f"{mixer} {variant} s{seed}"
                r = ela_gpt.train_one(run_args, name, spec, tokenizer, train, held_out, base.steps, base.eval_every)
                Context.probe.flush_grads()
                r.update(summarise(Context.probe, Context.init_loss))
                r.update({"mixer": mixer, "variant": variant, "seed": seed, "layers": run_args.layers})
                r["rms_eval_steps"] = [0] + [s for s, _ in r["eval_curve"]]
                report["results"][name] = r
                report["setup"]["wall_seconds"] = round(time.time() - start, 1)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(_rounded(report), separators=(",", ":")) + "\n")
    print_table(report)
    print(f"wrote {out} ({report['setup']['wall_seconds']:.0f} s)")


def _rounded(x, digits=5):
    """``x`` with every float to ``digits`` significant digits (the per-step curves make the report large)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: _rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v, digits) for v in x]
    return x


def _as_list(x):
    return x if isinstance(x, list) else [x]


def print_table(report):
    """Per mixer and variant: held-out loss at some evaluations (mean over seeds), the final held-out loss of each
    seed, the final training loss (mean), and for the first seed the per-layer RMS of the mixer output M and of the
    FFN input (init -> end) and the mixer parameters' gradient norm (mean of steps 1-10, and of the last 10)."""
    res = report["results"]
    seeds = report["setup"]["seeds"]
    for mixer in [m for m in MIXERS if any(r["mixer"] == m for r in res.values())]:
        print(f"\n{mixer}: held-out loss at step (mean of seeds {seeds}), final held-out per seed, final train loss; "
              f"seed {seeds[0]}: per-layer RMS of M and of the FFN input (init -> end), |grad| of the mixer params "
              "(steps 1-10 ; last 10)")
        rows, evals = [], None
        for variant in VARIANTS:
            runs = [res[f"{mixer} {variant} s{s}"] for s in seeds if f"{mixer} {variant} s{s}" in res]
            if not runs:
                continue
            evals = [s for s, _ in runs[0]["eval_curve"]]
            curve = [sum(r["eval_curve"][k][1] for r in runs) / len(runs) for k in range(len(evals))]
            per_seed = "/".join(f"{r['eval_loss']:.3f}" for r in runs)
            train = sum(r["final_train_loss"] for r in runs) / len(runs)
            r0, n = runs[0], runs[0]["layers"]

            def layers(rec, key, fmt, r0=r0, n=n):
                return "/".join(format(r0[rec][str(i)][key], fmt) for i in range(n))

            m = f"{layers('rms_init', 'mixer_out', '.3f')} -> {layers('rms_end', 'mixer_out', '.2f')}"
            f = f"{layers('rms_init', 'ffn_in', '.3f')} -> {layers('rms_end', 'ffn_in', '.2f')}"
            g = ("/".join(f"{v:.1e}" if v < 1e-3 else f"{v:.3f}" for v in r0["grad_norm_mixer_steps_1_10"]) + " ; "
                 + "/".join(f"{v:.3f}" for v in r0["grad_norm_mixer_last_10"]))
            rows.append((variant, curve, per_seed, train, m, f, g))
        pick = [k for k, s in enumerate(evals) if s in (25, 50, 100) or k == len(evals) - 1]
        head = " ".join(f"@{evals[k]:<5d}" for k in pick)
        print(f"{'variant':21s} {head} {'final/seed':>13s} train  {'RMS M':>23s}  {'RMS FFN-in':>23s}  |grad M|")
        for variant, curve, per_seed, train, m, f, g in rows:
            vals = " ".join(f"{curve[k]:6.3f}" for k in pick)
            print(f"{variant:21s} {vals} {per_seed:>13s} {train:5.3f}  {m:>23s}  {f:>23s}  {g}")


if __name__ == "__main__":
    main()
