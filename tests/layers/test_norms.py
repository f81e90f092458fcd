"""`norm_keeping_only_input`: an RMSNorm whose weight's dtype differs from its input's (bf16 activations, fp32
weights, as under autocast) recomputed in the backward: the same values and gradients, bit for bit, and only the
input kept."""

import torch
from torch import nn

from lazoo.layers.norms import norm_keeping_only_input


def _saved(fn, *args):
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = (t.dtype, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sorted(kept.values(), key=str)


def _case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    norm = nn.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32, generator=gen) + 0.5)
    x = (torch.randn(3, 17, 4, 32, generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    return norm, x


def test_same_values_and_gradients_as_the_norm():
    norm, x = _case()
    grad = torch.randn(3, 17, 4, 32).to(torch.bfloat16)
    ours = norm_keeping_only_input(norm, x)
    d_ours = torch.autograd.grad(ours, (x, norm.weight), grad)
    ref = norm(x)
    d_ref = torch.autograd.grad(ref, (x, norm.weight), grad)
    assert ours.dtype == ref.dtype == torch.bfloat16 and torch.equal(ours, ref)
    for a, b, name in zip(d_ours, d_ref, ("x", "weight")):
        assert torch.equal(a, b), f"d{name}: {(a.float() - b.float()).abs().max().item():.3e} from the norm's own"


def test_keeps_only_the_input():
    norm, x = _case(1)
    _, ref_kept = _saved(norm, x)
    _, ours_kept = _saved(lambda t: norm_keeping_only_input(norm, t), x)
    assert sum(n for _, n in ours_kept) == x.numel() * x.element_size()  # x itself, nothing in float32
    assert sum(n for dtype, n in ref_kept if dtype == torch.float32) >= 2 * x.numel() * 4  # the norm: float32 copies


def test_plain_call_where_nothing_is_gained():
    norm, x = _case(2)
    same = x.detach().float().requires_grad_()  # the weight's dtype: torch's fused form keeps little already
    out = norm_keeping_only_input(norm, same)
    assert "Checkpoint" not in type(out.grad_fn).__name__
    with torch.no_grad():
        assert norm_keeping_only_input(norm, x).grad_fn is None
