"""OVQ's version tables (lazoo.kernels.ovq.versions): every value each slot takes, its final value and the
gradients of both, against a float64 loop over the slots' keys. Groups of several sizes, slots no key joins, slots
empty before the call, keys that join nothing. CPU: the ``interp_*`` test runs in a fresh process with
TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402

INTERP = interpreter_ready()
F64 = torch.float64


def reference(x, d0, counts0, slot_of):
    """float64 tables [B, H, M + P, d] (rows in the kernel's layout) and final dictionaries, by a loop."""
    B, P, H, D = x.shape
    M = d0.shape[2]
    table = torch.zeros(B, H, M + P, D, dtype=F64)
    end = torch.zeros(B, H, M, D, dtype=F64)
    for b in range(B):
        for h in range(H):
            row = 0
            for s in range(M):
                c0 = int(counts0[b, h, s])
                acc = d0[b, h, s].to(F64) * c0
                table[b, h, row] = acc / max(c0, 1)
                row += 1
                keys = [p for p in range(P) if slot_of[b, h, p] == s]
                for j, p in enumerate(keys):
                    acc = acc + x[b, p, h].to(F64)
                    table[b, h, row] = acc / (c0 + j + 1)
                    row += 1
                end[b, h, s] = acc / (c0 + len(keys)) if c0 + len(keys) else 0
    return table, end


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
def test_interp_tables_and_gradients_match_float64_loop():
    from lazoo.kernels.ovq.versions import version_table

    gen = torch.Generator().manual_seed(0)
    B, P, H, D, M = 2, 23, 2, 12, 6
    x = torch.randn(B, P, H, D, generator=gen)
    d0 = torch.randn(B, H, M, D, generator=gen)
    counts0 = torch.randint(0, 4, (B, H, M), generator=gen)
    counts0[0, 0, 2] = 0  # empty before the call
    slot_of = torch.randint(-1, M, (B, H, P), generator=gen)  # -1: joins nothing
    slot_of[0, 0][slot_of[0, 0] == 2] = 3  # slot 2 of (0, 0): empty before and after (its end is 0)
    slot_of[1, 1, :12] = 4  # a long group
    n = torch.stack([(slot_of == s).sum(-1) for s in range(M)], -1)  # [B, H, M]
    start = torch.arange(M) + (n.cumsum(-1) - n)
    order = (torch.where(slot_of >= 0, slot_of, M) * P + torch.arange(P)).argsort(-1)

    xs, d0s = x.clone().requires_grad_(), d0.clone().requires_grad_()
    table, end = version_table(xs, d0s, counts0, start, n, order, M + P, torch.float32)
    xr, d0r = x.to(F64).requires_grad_(), d0.to(F64).requires_grad_()
    table_r, end_r = reference(xr, d0r, counts0, slot_of)
    assert torch.allclose(table.to(F64), table_r, rtol=1e-5, atol=1e-6)
    assert torch.allclose(end.to(F64), end_r, rtol=1e-5, atol=1e-6)
    assert float(end_r[0, 0, 2].detach().abs().max()) == 0.0 and int((slot_of == 4).sum()) >= 12

    gt, ge = torch.randn(table.shape, generator=gen), torch.randn(end.shape, generator=gen)
    (table * gt).sum().add((end * ge).sum()).backward()
    (table_r * gt.to(F64)).sum().add((end_r * ge.to(F64)).sum()).backward()
    assert torch.allclose(xs.grad.to(F64), xr.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(d0s.grad.to(F64), d0r.grad, rtol=1e-5, atol=1e-6)
    assert float(xs.grad[slot_of.permute(0, 2, 1) < 0].abs().max()) == 0.0  # keys that join nothing
