"""Why VLA's precision update loses recall when a long filler separates the pairs from their queries: a synthetic
read-out through ``lazoo.ops.vla`` (no training). d = 32 (one head of the MQAR models), 8 key/value pairs with random
keys, then F filler tokens whose keys are one direction plus 10 % noise (what a trained model can make of repeated
filler) or random, then the pairs' keys read from the final state. The recall error |S k̂_i − v_i| / |v_i| (0: exact;
above 1: the memory is worse than empty) and A's condition number, for VLA's defaults, the refresh's options, A
frozen (λ₀ → ∞: A ∝ I, the β = 1 delta rule) and the prior λ₀ swept, then for A pulled back towards A₀ every
token, A ← (1 − η) A + η A₀ (written out here; not an option of the op). Identity features, the unit-query read-out,
u = k (the write geometry is the key's own). Each token adds |û|² = 1/d to A⁻¹ along û against the prior λ₀: λ₀
sets how much a key seen once counts. Usage: python experiments/vla_filler_recall.py [OUT.json]"""
import json
import sys

import torch
import torch.nn.functional as F

from lazoo import ops

D, PAIRS, FILLERS = 32, 8, (0, 8, 100, 490)
OP_VARIANTS = {
    "defaults (λ₀ 0.1, η 1e-3 every 20)": {}, "no refresh": {"refresh_period": 0}, "η = 1": {"refresh_eta": 1.0},
    "λ₀ 1": {"lambda0": 1.0}, "λ₀ 1e-2": {"lambda0": 1e-2},
    "eq. (8): λ₀ 0.1 / 32, η 1e-3 · 32": {"lambda0": 0.1 / D, "refresh_eta": 1e-3 * D},
    "λ₀ 1e-3": {"lambda0": 1e-3}, "λ₀ 1e-6": {"lambda0": 1e-6}, "A frozen (λ₀ 1e6)": {"lambda0": 1e6},
}


def sequence(filler: int, kind: str, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(PAIRS + filler, D, generator=g, dtype=torch.float64)
    v = torch.randn(PAIRS + filler, D, generator=g, dtype=torch.float64)
    if kind == "repeated":
        k[PAIRS:] = torch.randn(D, generator=g, dtype=torch.float64) + 0.1 * torch.randn(filler, D, generator=g,
                                                                                         dtype=torch.float64)
    return k, v


def recall(S, A, k, v):
    kh = F.normalize(k[:PAIRS], dim=-1)
    err = ((kh @ S.T) - v[:PAIRS]).norm(dim=-1) / v[:PAIRS].norm(dim=-1)
    ev = torch.linalg.eigvalsh(A)
    return {"error": err.mean().item(), "A_condition": (ev.max() / ev.min()).item()}


def through_the_op(filler, kind, options):
    k, v = sequence(filler, kind)
    x = k[None, :, None]
    _, st = ops.vla(x, x, v[None, :, None], x, output_final_state=True, backend="recurrent",
                    feature_map="identity", readout="unit_query", **options)
    return recall(st["S"][0, 0], st["A"][0, 0], k, v)


def pulled_back(filler, kind, eta, lambda0=0.1):
    """VLA's recurrence (as the op computes it here) with A <- (1 - eta) A + eta A0 after each token's update."""
    k, v = sequence(filler, kind)
    A0 = torch.eye(D, dtype=torch.float64) / lambda0
    A, S = A0.clone(), torch.zeros(D, D, dtype=torch.float64)
    for t in range(len(k)):
        kh = F.normalize(k[t], dim=0)
        uh = kh / D ** 0.5
        z = A @ uh
        A = (1 - eta) * (A - torch.outer(z, z) / (1 + uh @ z)) + eta * A0
        a = A @ kh
        S = S + torch.outer(v[t] - S @ kh, a / a.norm())
    return recall(S, A, k, v)


def main():
    rows = []
    for kind in ("repeated", "random"):
        for filler in FILLERS:
            for name, options in OP_VARIANTS.items():
                rows.append({"filler": kind, "F": filler, "variant": name, **through_the_op(filler, kind, options)})
            for eta in (0.1, 0.5):
                rows.append({"filler": kind, "F": filler, "variant": f"A pulled back, η = {eta} a token",
                             **pulled_back(filler, kind, eta)})
    for r in rows:
        print(f"{r['filler']:8s} F={r['F']:4d}  {r['variant']:36s} error {r['error']:.3f}  "
              f"cond(A) {r['A_condition']:.0f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
