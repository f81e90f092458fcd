"""bf16 gradient errors of lazoo's chunked Triton kernels against float64, one op at a time, on a GPU: GLA (a decay
per key channel), scalar-gated linear attention and Mamba-2 (its inputs through the same kernels), KDA. For each op,
the relative (Frobenius) error of the output and of every input's gradient, the same inputs evaluated in float64
by the op's PyTorch chunk form. A gradient whose error stands far above the others' points at a kernel problem (the
KDA backward's in-flight wgmma race showed as dk, dg, dβ errors 6x dq's and dv's).
Usage: python experiments/grad_errors_bf16.py OUT.json [--ops gla,gated_linear_attention,mamba2,kda]"""
import argparse
import json
import math

import torch
import torch.nn.functional as F

from lazoo import ops

B, T, H, D = 2, 1000, 16, 128
FAST_BACKEND = "triton"


def inputs(op, gen, dev):
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    if op == "mamba2":
        P, N, Hm = 64, 128, 32
        x = {"x": r(B, T, Hm, P), "dt": F.softplus(r(B, T, Hm) - 3), "B": r(B, T, 1, N) / math.sqrt(N),
             "C": r(B, T, 1, N) / math.sqrt(N)}
        const = {"A": -torch.empty(Hm, device=dev).uniform_(1, 16, generator=gen), "D": r(Hm)}
        return x, const
    x = {"q": F.normalize(r(B, T, H, D), dim=-1), "k": F.normalize(r(B, T, H, D), dim=-1), "v": r(B, T, H, D)}
    if op == "gla":
        x["g"] = F.logsigmoid(r(B, T, H, D) + 4) / 8
    elif op == "gated_linear_attention":
        x["g"] = F.logsigmoid(r(B, T, H) + 4)
    elif op == "kda":
        A = torch.empty(H, device=dev).uniform_(1, 16, generator=gen)
        x["g"] = -A[:, None] * F.softplus(r(B, T, H, D) - 5)
        x["beta"] = torch.sigmoid(r(B, T, H))
    return x, {}


def run(op, x, const, backend):
    if op == "mamba2":
        return ops.mamba2(x["x"], x["dt"], const["A"].to(x["x"].dtype if x["x"].dtype == torch.float64 else
                                                          torch.float32), x["B"], x["C"], const["D"],
                          backend=backend)[0]
    if op == "kda":
        return ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], backend=backend, use_qk_l2norm=False)[0]
    fn = ops.gla if op == "gla" else ops.gated_linear_attention
    return fn(x["q"], x["k"], x["v"], x["g"], backend=backend)[0]


def errors(op, dev):
    gen = torch.Generator(device=dev).manual_seed(0)
    x, const = inputs(op, gen, dev)
    do = torch.randn(run(op, {n: t.double() for n, t in x.items()}, {n: t.double() for n, t in const.items()},
                         "chunk").shape, device=dev, generator=gen)
    out = {}
    for name, dtype, backend in (("f64", torch.float64, "chunk"), ("bf16", torch.bfloat16, FAST_BACKEND)):
        fp32 = {"dt"} if op == "mamba2" else {"g"} if op == "kda" else set()  # gates the op takes in float32
        leaves = {n: (t.float() if n in fp32 and dtype != torch.float64 else t.to(dtype)).detach().requires_grad_()
                  for n, t in x.items()}
        consts = {n: t.double() if dtype == torch.float64 else t for n, t in const.items()}
        o = run(op, leaves, consts, backend)
        o.backward(do.to(o.dtype))
        out[name] = {"o": o.detach().double(), **{n: t.grad.double() for n, t in leaves.items()}}
    return {n: ((out["bf16"][n] - out["f64"][n]).norm() / out["f64"][n].norm()).item() for n in out["f64"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--ops", default="gla,gated_linear_attention,mamba2,kda")
    a = p.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [B, T, H, D]}
    for op in a.ops.split(","):
        try:
            result[op] = errors(op, "cuda")
        except Exception as e:  # noqa: BLE001 - one failing op must not stop the others
            result[op] = f"{type(e).__name__}: {e}"
        print(op, result[op], flush=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
