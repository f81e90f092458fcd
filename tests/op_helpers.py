"""What the op and kernel tests share: padding masks, relative errors, comparing two backends' outputs, final
states and gradients, and float64 references used in both."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import pytest
import torch


def interpreted() -> bool:
    """Whether the Triton interpreter is on from the start (``TRITON_INTERPRET=1``; False without Triton)."""
    try:
        from lazoo.kernels._utils import interpreter_ready
    except ImportError:  # no triton
        return False
    return interpreter_ready()


#: the mark of an op test that runs Triton kernels through the interpreter (tests/test_interpreter.py runs them)
needs_interpreter = pytest.mark.skipif(not interpreted(), reason="needs TRITON_INTERPRET=1 from the start "
                                                                  "(tests/test_interpreter.py runs it)")


def record_launches(monkeypatch, module, *names: str) -> list:
    """Replace the Triton kernels ``module.<name>`` by ones that record each launch's grid, then launch it; returns
    the list the grids go to."""
    grids = []
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, type("Recording", (), {
            "__getitem__": lambda self, grid, real=real: (grids.append(grid), real[grid])[1]})())
    return grids


def left_pad_mask(lengths: Sequence[int], T: int, holes: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
    """``[B, T]`` bool mask with ``lengths[b]`` real tokens at the right end of each row,
    plus optional interior pads ``(b, t)``."""
    t = torch.arange(T)
    mask = t[None, :] >= (T - torch.tensor(lengths))[:, None]
    for b, i in holes:
        mask[b, i] = False
    return mask


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (absolute error where b is all zero)."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    return err / scale if scale > 0 else err


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    if a.dtype in (torch.bool, torch.int64, torch.int32):
        assert torch.equal(a, b), f"{what}: {a} != {b}"
        return
    e = rel_err(a, b)
    assert e <= rtol, f"{what}: relative error {e:.3e} > {rtol:.1e}"


def state_parts(state) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every part of a state (tensor, dict or None), in a fixed order."""
    if state is None:
        return []
    if isinstance(state, torch.Tensor):
        return [("state", state)]
    return [(f"state[{k!r}]", state[k]) for k in sorted(state)]


def assert_state_close(a, b, rtol: float, what: str) -> None:
    pa, pb = state_parts(a), state_parts(b)
    assert [n for n, _ in pa] == [n for n, _ in pb], f"{what}: state parts differ"
    for (name, x), (_, y) in zip(pa, pb):
        assert_close(x, y, rtol, f"{what} {name}")


def forward_and_grads(fn: Callable, leaves: Mapping[str, torch.Tensor], seed: int = 1234):
    """Run ``fn() -> (o, state)`` and take the gradients of a random projection of the output
    and of every float part of the final state w.r.t. ``leaves``."""
    o, state = fn()
    parts = [o] + [x for _, x in state_parts(state) if x.is_floating_point()]
    gen = torch.Generator().manual_seed(seed)
    loss = sum((p * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.device, p.dtype)).sum()
               for p in parts)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return o, state, dict(zip(leaves, grads))


def compare_backends(fn: Callable, leaves: Mapping[str, torch.Tensor], rtol: float,
                     backends: tuple[str, str] = ("chunk", "recurrent")) -> None:
    """``fn(backend)`` under two backends: outputs, final states and gradients must agree."""
    test, ref = backends
    o1, s1, g1 = forward_and_grads(lambda: fn(test), leaves)
    o2, s2, g2 = forward_and_grads(lambda: fn(ref), leaves)
    assert_close(o1, o2, rtol, f"output {test} vs {ref}")
    assert_state_close(s1, s2, rtol, f"final {test} vs {ref}")
    for name in leaves:
        assert g2[name] is not None, f"no gradient reaches {name} ({ref})"
        assert g1[name] is not None, f"no gradient reaches {name} ({test})"
        assert_close(g1[name], g2[name], rtol, f"grad {name} {test} vs {ref}")


def check_against(run: Callable, reference: Callable, leaves: Mapping[str, torch.Tensor], rtol: float,
                  what: str) -> None:
    """Outputs, final states and every gradient of ``run()`` against ``reference()`` (both ``() -> (o, S)``)."""
    o1, s1, g1 = forward_and_grads(run, leaves)
    o2, s2, g2 = forward_and_grads(reference, leaves)
    assert_close(o1, o2, rtol, f"{what} output")
    assert_close(s1, s2, rtol, f"{what} final state")
    for name in leaves:
        assert g1[name] is not None and g2[name] is not None, f"{what}: no gradient reaches {name}"
        assert_close(g1[name], g2[name], rtol, f"{what} grad {name}")


def kda_inputs(B, T, H, dk, dv, HV=None, seed=0, strong=False):
    """q, k, v ~ N(0, 1); g = logsigmoid(N(2, 1)) per value head and key dim (with `strong`, every third key dim
    decays by exp(−5) to exp(−40) a step); β = sigmoid(N(0, 1)); an initial state."""
    HV = HV or H
    F64 = torch.float64
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, dk, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, HV, dv, generator=gen, dtype=F64)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, dk, generator=gen, dtype=F64) + 2)
    if strong:
        g[..., ::3] = -5 - 35 * torch.rand(B, T, HV, len(range(0, dk, 3)), generator=gen, dtype=F64)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen, dtype=F64))
    S0 = torch.randn(B, HV, dv, dk, generator=gen, dtype=F64)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "S0": S0}


def rls_closed_form(q, k, v, lam, gamma=1.0):
    """o_t = VK_t (KK_t + λI)^{-1} q_t from the moments of every prefix, one LU solve per t in float64 (no
    Cholesky, no Woodbury, no Sherman–Morrison: independent of every backend)."""
    q, k, v = (x.double() for x in (q, k, v))
    kk = torch.einsum("bthd,bthe->bthde", k, k)
    vk = torch.einsum("bthv,bthe->bthve", v, k)
    if gamma == 1.0:
        KK, VK = kk.cumsum(1), vk.cumsum(1)
    else:
        KK, VK = torch.empty_like(kk), torch.empty_like(vk)
        a, b = torch.zeros_like(kk[:, 0]), torch.zeros_like(vk[:, 0])
        for t in range(q.shape[1]):
            a, b = gamma * a + kk[:, t], gamma * b + vk[:, t]
            KK[:, t], VK[:, t] = a, b
    eye = torch.eye(q.shape[-1], dtype=torch.float64)
    z = torch.linalg.solve(KK + lam * eye, q[..., None])
    return (VK @ z)[..., 0]


def prefill_then_steps(run, T: int, cut: int, state=None, step: int = 3):
    """``run(slice, state)`` -> (output, state) over a prompt of ``cut`` tokens, then ``step`` tokens at a time up to
    ``T`` from the state each call leaves, without autograd: (the outputs concatenated in time, the last state)."""
    with torch.no_grad():
        o, state = run(slice(0, cut), state)
        outs = [o]
        for i in range(cut, T, step):
            o, state = run(slice(i, i + step), state)
            outs.append(o)
    return torch.cat(outs, 1), state
