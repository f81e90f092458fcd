#!/usr/bin/env python
"""The VLA paper's stability experiment: state norms over T steps of random inputs.

The VLA paper, §6.2 / Figure 4: "tracks state norms at inference on random inputs. Standard linear
attention reaches ‖S_1000‖_F ≈ 1,630 [...] VLA stays below 15 throughout [...] DeltaNet is also bounded",
and ‖A_t‖_F for VLA "decays from ~56 to ~10". The paper gives no more protocol than that; the choices
made here where it is silent are listed in ``PROTOCOL`` and written to the JSON.

For each seed, one head gets i.i.d. random raw projections q_t, k_t, v_t, u_t ~ N(0, I_dh) (u = W_u k_raw,
as the VLA op takes it) and β_t = sigmoid(N(0, 1)) for DeltaNet; the same q, k, v feed all three
mechanisms. Each op (``lazoo.ops``, ``backend="recurrent"``) is stepped one token at a time, its final
state passed back as ``initial_state``, which gives the exact state after every step:

    linear attention  S_t = S_{t-1} + v_t φ(k_t)ᵀ (φ = elu+1; the unnormalised numerator state)
    DeltaNet          S_t = S_{t-1}(I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ (k L2-normalised)
    VLA               Algorithm 1 (λ0 = 0.1, refresh every 20 steps with ηI = 1e-3 I, ε = 1e-4)

For VLA the script also recomputes, at every step, k̂_t = φ(k_t)/‖φ(k_t)‖ and α̂_t = A_t k̂_t/‖A_t k̂_t‖
from the post-update A_t (as Algorithm 1 does) and measures the spectral norm of the recurrence
Jacobian ‖I - α̂_t k̂_tᵀ‖₂ (Proposition 2 claims exactly 1; it is 1 only when α̂ = k̂), and the norm of
the product of the transition maps (S_t = S_{t-1} F_t + ..., F_t = I - k̂_t α̂_tᵀ), ‖F_1 ⋯ F_t‖₂.

Usage:  python experiments/state_norms.py [--steps 1000] [--head-dim 32] [--seeds 42 123 999] [--out docs/figures]
Writes ``state_norms.png`` and ``state_norms.json`` to ``--out``.
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

import lazoo
from lazoo.layers.mixers.base import prenormalized
from lazoo.ops import delta_rule, linear_attention, vla

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "figures"
CHECKPOINTS = (100, 500, 1000)
LABELS = {
    "linear": "linear attention ‖S_t‖_F",
    "delta_net": "DeltaNet ‖S_t‖_F",
    "vla": "VLA ‖S_t‖_F",
    "vla_A": "VLA ‖A_t‖_F",
    "linear_normalised": "linear ‖S_t‖_F / ‖z_t‖",
}
#: the paper's numbers for this experiment (the VLA paper, §1, §4.1, §6.2, Figure 4)
PAPER = {
    "linear_S_at_1000": 1630.0,
    "linear_S_at_1000_abstract": 1600.0,
    "linear_growth_per_step": 1.6,
    "vla_S_upper_bound": 15.0,
    "vla_A_start": 56.0,
    "vla_A_end": 10.0,
    "reduction_factor": "~110x (abstract: 109x; contributions: 100x)",
    "prop2_jacobian_spectral_norm": 1.0,
}
PROTOCOL = {
    "inputs": "i.i.d. standard normal raw projections q_t, k_t, v_t ~ N(0, I_dh) per step (one head per seed); "
              "the same q, k, v for all three mechanisms",
    "vla_u": "u_t ~ N(0, I_dh) i.i.d. (stands for W_u k_raw; the op normalises it and divides by sqrt(dh))",
    "delta_beta": "beta_t = sigmoid(N(0, 1)) per step (mean 0.5), as beta = sigmoid(w_beta . x) with random x",
    "linear": "feature_map='elu1', normalize=True; the norm reported is the numerator state S (not z); "
              "'linear_normalised' is ‖S_t‖_F / ‖z_t‖, the scale the normalised read-out S φ(q) / (φ(q)·z) sees",
    "delta_net": "use_qk_l2norm=True (k L2-normalised), no gate",
    "vla": "lambda0=0.1, refresh_period=20, refresh_eta=1e-3, eps=1e-4 (Algorithm 1 / Table 6)",
    "stepping": "one token per op call, backend='recurrent', final state passed back as initial_state",
    "dv": "dv = dk = head_dim (the paper's S is dh x dh)",
    "seeds": "the paper's evaluation seeds 42, 123, 999 by default; one torch.Generator per seed",
}


# ----------------------------------------------------------------------------- inputs
def make_inputs(seeds, steps, dh, dtype, std=1.0, v_mean=0.0):
    """Stack one random sequence per seed along the batch dim: q, k, v, u ``[B, T, 1, dh]``, beta ``[B, T, 1]``.

    q, k, v, u ~ N(0, std² I) (v shifted by ``v_mean`` in every coordinate), β = sigmoid(N(0, 1))."""
    qs, ks, vs, us, bs = [], [], [], [], []
    for seed in seeds:
        g = torch.Generator().manual_seed(int(seed))
        q, k, v, u = (std * torch.randn(steps, 1, dh, generator=g, dtype=torch.float64) for _ in range(4))
        v = v + v_mean
        beta = torch.sigmoid(torch.randn(steps, 1, generator=g, dtype=torch.float64))
        qs.append(q), ks.append(k), vs.append(v), us.append(u), bs.append(beta)
    out = [torch.stack(x).to(dtype) for x in (qs, ks, vs, us, bs)]
    return dict(zip(("q", "k", "v", "u", "beta"), out))


# ----------------------------------------------------------------------------- experiment
def jacobian_spectral_norm_closed_form(c: torch.Tensor) -> torch.Tensor:
    """‖I - a kᵀ‖₂ for unit a, k with a·k = c: the map is the identity off span{a, k}; on that plane
    σ1² + σ2² = 3 - 2c and σ1 σ2 = |1 - c|, so σ_max² = ((3 - 2c) + sqrt((3 - 2c)² - 4(1 - c)²)) / 2."""
    s = 3.0 - 2.0 * c
    return torch.sqrt((s + torch.sqrt((s * s - 4.0 * (1.0 - c) ** 2).clamp_min(0.0))) / 2.0)


def run_experiment(seeds, steps, dh, dtype=torch.float32, vla_kwargs=None, std=1.0, v_mean=0.0, vla_prenorm=False):
    """Step the three ops through ``steps`` random tokens; return trajectories ``[B, T]`` and VLA diagnostics.
    ``vla_prenorm``: VLA gets q and k scaled to length √d_h (its layer's default `qk_prenorm`; u stays raw)."""
    vla_kwargs = dict(lambda0=0.1, refresh_period=20, refresh_eta=1e-3, eps=1e-4, **(vla_kwargs or {}))
    x = make_inputs(seeds, steps, dh, dtype, std, v_mean)
    q, k, v, u, beta = x["q"], x["k"], x["v"], x["u"], x["beta"]
    q_vla, k_vla = prenormalized(q, k) if vla_prenorm else (q, k)
    Bn = len(seeds)
    norms = {name: torch.empty(Bn, steps, dtype=torch.float64) for name in LABELS}
    jac = torch.empty(Bn, steps, dtype=torch.float64)  # ‖I - α̂ k̂ᵀ‖₂, by SVD
    cos = torch.empty(Bn, steps, dtype=torch.float64)  # α̂ · k̂
    prod_norm = torch.empty(Bn, steps, dtype=torch.float64)  # ‖F_1 ⋯ F_t‖₂
    eye = torch.eye(dh, dtype=torch.float64)
    P = eye.repeat(Bn, 1, 1)

    st_lin = st_delta = st_vla = None
    with torch.no_grad():
        for t in range(steps):
            sl = slice(t, t + 1)
            _, st_lin = linear_attention(q[:, sl], k[:, sl], v[:, sl], feature_map="elu1", normalize=True,
                                         initial_state=st_lin, output_final_state=True, backend="recurrent")
            _, st_delta = delta_rule(q[:, sl], k[:, sl], v[:, sl], beta[:, sl], use_qk_l2norm=True,
                                     initial_state=st_delta, output_final_state=True, backend="recurrent")
            _, st_vla = vla(q_vla[:, sl], k_vla[:, sl], v[:, sl], u[:, sl], **vla_kwargs,
                            initial_state=st_vla, output_final_state=True, backend="recurrent")
            norms["linear"][:, t] = torch.linalg.matrix_norm(st_lin["S"][:, 0].double())
            # The read-out divides S φ(q) by φ(q)·z_t: S / ‖z‖ is the scale the normalised output sees.
            norms["linear_normalised"][:, t] = norms["linear"][:, t] / st_lin["z"][:, 0].double().norm(dim=-1)
            norms["delta_net"][:, t] = torch.linalg.matrix_norm(st_delta[:, 0].double())
            norms["vla"][:, t] = torch.linalg.matrix_norm(st_vla["S"][:, 0].double())
            norms["vla_A"][:, t] = torch.linalg.matrix_norm(st_vla["A"][:, 0].double())

            # α̂_t, k̂_t exactly as Algorithm 1 (lines 8-9, 19-20), from the post-update A_t (in the op's dtype).
            k_feat = F.elu(k_vla[:, t, 0].to(st_vla["A"].dtype)) + 1.0
            k_hat = k_feat / k_feat.norm(dim=-1, keepdim=True)
            alpha = torch.einsum("bij,bj->bi", st_vla["A"][:, 0], k_hat)
            alpha_hat = (alpha / alpha.norm(dim=-1, keepdim=True)).double()
            k_hat = k_hat.double()
            J = eye - alpha_hat[:, :, None] * k_hat[:, None, :]  # ∂S_t/∂S_{t-1} as the paper writes it
            jac[:, t] = torch.linalg.matrix_norm(J, ord=2)
            cos[:, t] = (alpha_hat * k_hat).sum(-1)
            # S_t = S_{t-1} F_t + v α̂ᵀ with F_t = I - k̂ α̂ᵀ = Jᵀ: S_T = S_0 F_1 ⋯ F_T + ...
            P = P @ J.transpose(-1, -2)
            prod_norm[:, t] = torch.linalg.matrix_norm(P, ord=2)

    # Consistency: the stepped final states equal one call of each op on the whole sequence (chunk form).
    with torch.no_grad():
        _, f_lin = linear_attention(q, k, v, feature_map="elu1", normalize=True, output_final_state=True,
                                    backend="chunk")
        _, f_delta = delta_rule(q, k, v, beta, use_qk_l2norm=True, output_final_state=True, backend="chunk")
        _, f_vla = vla(q_vla, k_vla, v, u, **vla_kwargs, output_final_state=True, backend="chunk")
    consistency = {
        "linear": _rel(st_lin["S"], f_lin["S"]),
        "delta_net": _rel(st_delta, f_delta),
        "vla_S": _rel(st_vla["S"], f_vla["S"]),
        "vla_A": _rel(st_vla["A"], f_vla["A"]),
    }
    return {
        "norms": norms,
        "jacobian": jac,
        "jacobian_closed_form": jacobian_spectral_norm_closed_form(cos),
        "cos": cos,
        "jacobian_product": prod_norm,
        "consistency": consistency,
        "vla_kwargs": vla_kwargs,
        "final_states": {"stepped": (st_lin, st_delta, st_vla), "chunk": (f_lin, f_delta, f_vla)},
    }


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


# ----------------------------------------------------------------------------- summary
def _stats(x: torch.Tensor) -> dict:
    """mean / min / max over seeds of a ``[B]`` tensor, plus the per-seed values."""
    return {"mean": float(x.mean()), "min": float(x.min()), "max": float(x.max()),
            "per_seed": [float(a) for a in x]}


def _quantiles(x: torch.Tensor) -> dict:
    x = x.flatten()
    return {"min": float(x.min()), "median": float(x.median()), "max": float(x.max()),
            "mean": float(x.mean()), "n": int(x.numel())}


def checkpoints(steps: int) -> list[int]:
    ts = [c for c in CHECKPOINTS if c <= steps]
    return ts if ts and ts[-1] == steps else ts + [steps]


def phi_moments(std: float) -> tuple[float, float]:
    """E[φ(y)] and E[φ(y)²] for φ = elu + 1 and y ~ N(0, std²) (std > 0):
    E[φ] = std/√(2π) + 1/2 + e^{std²/2} Φ(-std),  E[φ²] = std²/2 + 2 std/√(2π) + 1/2 + e^{2 std²} Φ(-2 std)."""
    Phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2.0))  # noqa: E731
    c = 1.0 / math.sqrt(2.0 * math.pi)
    m1 = std * c + 0.5 + math.exp(std * std / 2.0) * Phi(-std)
    m2 = std * std / 2.0 + 2.0 * std * c + 0.5 + math.exp(2.0 * std * std) * Phi(-2.0 * std)
    return m1, m2


def expected_linear_norm(t: int, dh: int, std: float = 1.0, v_mean: float = 0.0) -> float:
    """sqrt(E‖S_t‖_F²) for linear attention, S_t = Σ_s v_s φ(k_s)ᵀ, with i.i.d. k ~ N(0, std² I) and
    v ~ N(v_mean·1, std² I), independent: E‖S_t‖² = t E‖v‖² E‖φ(k)‖² + t(t-1) ‖E v‖² ‖E φ(k)‖²
    = t·dh(std² + v_mean²)·dh E[φ²] + t(t-1)·dh v_mean²·dh E[φ]². With v_mean = 0 it grows as √t;
    a nonzero mean of v makes it grow linearly, at dh·|v_mean|·E[φ] per step."""
    m1, m2 = phi_moments(std)
    e2 = t * dh * (std * std + v_mean * v_mean) * dh * m2 + t * (t - 1) * dh * v_mean ** 2 * dh * m1 * m1
    return math.sqrt(e2)


def summarize(res, args, seconds) -> dict:
    steps = args.steps
    ts = checkpoints(steps)
    mech = {}
    for name, traj in res["norms"].items():
        peak, arg = traj.max(dim=1)
        mech[name] = {
            "label": LABELS[name],
            "at_t": {str(t): _stats(traj[:, t - 1]) for t in ts},
            "initial": _stats(traj[:, 0]),
            "max_over_t": _stats(peak),
            "argmax_t": [int(a) + 1 for a in arg],
            "finite": bool(torch.isfinite(traj).all()),
        }
    t_end = steps
    lin_end = res["norms"]["linear"][:, -1]
    vla_end = res["norms"]["vla"][:, -1]
    return {
        "experiment": "the VLA paper, §6.2 / Figure 4: state norms over T steps of random inputs",
        "settings": {
            "steps": steps,
            "head_dim": args.head_dim,
            "dv": args.head_dim,
            "heads_per_seed": 1,
            "seeds": list(args.seeds),
            "dtype": args.dtype,
            "threads": args.threads,
            "input_std": args.input_std,
            "v_mean": args.v_mean,
            "vla_qk_prenorm": args.vla_qk_prenorm,
            "backend": "recurrent, stepped one token at a time",
            "vla": res["vla_kwargs"],
            "delta_net": {"use_qk_l2norm": True, "beta": "sigmoid(N(0,1))"},
            "linear": {"feature_map": "elu1", "normalize": True},
            "protocol": PROTOCOL,
        },
        "versions": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "lazoo": getattr(lazoo, "__version__", "?"),
        },
        "runtime_s": round(seconds, 3),
        "checkpoints": ts,
        "mechanisms": mech,
        "linear_expected_sqrt_E_norm2": {
            "formula": "sqrt(t dh(std^2+m^2) dh E[phi^2] + t(t-1) dh m^2 dh E[phi]^2), k ~ N(0, std^2 I), "
                       "v ~ N(m 1, std^2 I); sqrt(t) growth when m = 0",
            "at_t": {str(t): expected_linear_norm(t, args.head_dim, args.input_std, args.v_mean) for t in ts},
        },
        "ratio_linear_over_vla_at_end": _stats(lin_end / vla_end),
        "vla_jacobian": {
            "what": "spectral norm ‖I - α̂_t k̂_tᵀ‖₂ over all steps and seeds (Proposition 2 claims exactly 1)",
            "spectral_norm": _quantiles(res["jacobian"]),
            "closed_form_max_abs_diff": float((res["jacobian"] - res["jacobian_closed_form"]).abs().max()),
            "cos_alpha_k": _quantiles(res["cos"]),
            "fraction_above_1_plus_1e-6": float((res["jacobian"] > 1 + 1e-6).double().mean()),
            "product_norm_F1_to_Ft": {str(t): _stats(res["jacobian_product"][:, t - 1]) for t in ts},
            "product_norm_max_over_t": _stats(res["jacobian_product"].max(dim=1).values),
        },
        "consistency_stepped_vs_one_call_chunk_rel_err": res["consistency"],
        "paper": PAPER,
        "at_end": {"t": t_end, "linear_mean": float(lin_end.mean()), "vla_mean": float(vla_end.mean())},
    }


# ----------------------------------------------------------------------------- plot
def plot(res, summary, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = summary["settings"]["steps"]
    t = torch.arange(1, steps + 1).numpy()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5.6), gridspec_kw={"width_ratios": [1.6, 1]})
    colors = {"linear": "tab:red", "delta_net": "tab:blue", "vla": "tab:green", "vla_A": "tab:purple",
              "linear_normalised": "tab:brown"}
    for name, traj in res["norms"].items():
        mean, lo, hi = traj.mean(0).numpy(), traj.min(0).values.numpy(), traj.max(0).values.numpy()
        style = {"vla_A": "--", "linear_normalised": "-."}.get(name, "-")
        ax.plot(t, mean, style, color=colors[name], lw=1.0 if name == "linear_normalised" else 1.6, label=LABELS[name])
        ax.fill_between(t, lo, hi, color=colors[name], alpha=0.2, lw=0)
    st = summary["settings"]
    ref = [expected_linear_norm(int(s), st["head_dim"], st["input_std"], st["v_mean"]) for s in t]
    ax.plot(t, ref, ":", color="black", lw=1.0,
            label=r"linear, theory $\sqrt{E\|S_t\|^2}$" + (r" ($\propto\sqrt{t}$)" if st["v_mean"] == 0 else ""))
    ax.plot(t, PAPER["linear_growth_per_step"] * t, ":", color="tab:red", lw=1.0, alpha=0.7,
            label="paper's linear attention: 1.6 t (1,630 at t=1000)")
    ax.axhline(PAPER["vla_S_upper_bound"], color="tab:green", ls=":", lw=1.0, alpha=0.7,
               label="paper's VLA bound: 15")
    ax.set_yscale("log")
    ax.set_xlabel("step t")
    ax.set_ylabel("Frobenius norm")
    seeds = summary["settings"]["seeds"]
    dist = f"N(0,{st['input_std']:g}²)" + (f" (v mean {st['v_mean']:g})" if st["v_mean"] else "")
    ax.set_title(f"State norms, random {dist} inputs, d_h={st['head_dim']}, "
                 f"{len(seeds)} seeds (mean, min-max band)", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    ax.grid(True, which="both", alpha=0.3)

    jac = res["jacobian"]
    jac_label = r"$\|I-\hat\alpha_t\hat k_t^\top\|_2$"
    ax2.plot(t, jac.mean(0).numpy(), color="tab:green", lw=1.0, label=jac_label + " (mean over seeds)")
    ax2.fill_between(t, jac.min(0).values.numpy(), jac.max(0).values.numpy(), color="tab:green", alpha=0.2, lw=0)
    ax2.plot(t, res["jacobian_product"].mean(0).numpy(), color="tab:orange", lw=1.0,
             label=r"$\|F_1\cdots F_t\|_2$ (mean over seeds)")
    ax2.axhline(1.0, color="black", ls=":", lw=1.0, label="Proposition 2 claim: 1")
    ax2.axhline((1 + 5 ** 0.5) / 2, color="gray", ls="--", lw=0.8,
                label=r"sup over unit $\hat\alpha,\hat k$: $(1+\sqrt{5})/2$")
    ax2.set_xlabel("step t")
    ax2.set_ylabel("spectral norm")
    ax2.set_title("VLA recurrence Jacobian", fontsize=10)
    q = summary["vla_jacobian"]["spectral_norm"]
    ax2.text(0.97, 0.55, jac_label + " over all steps and seeds:\n"
             f"min {q['min']:.4f}, median {q['median']:.4f}, max {q['max']:.4f}",
             transform=ax2.transAxes, ha="right", va="center", fontsize=8,
             bbox=dict(boxstyle="round", fc="white", ec="0.7"))
    ax2.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False)
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="sequence length T (default 1000)")
    p.add_argument("--head-dim", type=int, default=32, help="d_h = dk = dv (default 32, the paper's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 123, 999],
                   help="one random sequence per seed (default: the paper's 42 123 999)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="input/compute dtype of the ops (default float32, the paper's 'float32 throughout')")
    p.add_argument("--input-std", type=float, default=1.0,
                   help="standard deviation of the raw projections q, k, v, u (default 1)")
    p.add_argument("--v-mean", type=float, default=0.0,
                   help="constant added to every coordinate of v (default 0: zero-mean values)")
    p.add_argument("--vla-qk-prenorm", action="store_true",
                   help="VLA gets q and k scaled to length √d_h, as its layer does by default (qk_prenorm)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads during the run (default 1)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if not args.input_std > 0:
        p.error("--input-std must be > 0")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.head_dim < 2:
        p.error("--head-dim must be >= 2")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    # Tiny matrices, one token at a time: one thread is fastest and is not slowed by a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        t0 = time.perf_counter()
        res = run_experiment(args.seeds, args.steps, args.head_dim, dtype, std=args.input_std, v_mean=args.v_mean,
                             vla_prenorm=args.vla_qk_prenorm)
        summary = summarize(res, args, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "state_norms.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(res, summary, args.out / "state_norms.png")

    print(f"T={args.steps} d_h={args.head_dim} seeds={args.seeds} dtype={args.dtype} std={args.input_std:g} "
          f"v_mean={args.v_mean:g} "
          f"({summary['runtime_s']:.1f} s)")
    print(f"{'':22s}" + "".join(f"{'t=' + str(t):>26s}" for t in summary["checkpoints"]) + f"{'max over t':>26s}")
    for m in summary["mechanisms"].values():
        cells = [m["at_t"][str(t)] for t in summary["checkpoints"]] + [m["max_over_t"]]
        print(f"{m['label']:22s}" + "".join(f"{c['mean']:>10.2f} [{c['min']:.2f}, {c['max']:.2f}]".rjust(26)
                                          for c in cells))
    j = summary["vla_jacobian"]["spectral_norm"]
    print(f"VLA ‖I - α̂ k̂ᵀ‖₂: min {j['min']:.4f} median {j['median']:.4f} max {j['max']:.4f} "
          f"(n={j['n']}); cos(α̂, k̂) median {summary['vla_jacobian']['cos_alpha_k']['median']:.3f}")
    print(f"wrote {args.out / 'state_norms.json'} and {args.out / 'state_norms.png'}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
