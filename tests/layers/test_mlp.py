"""The SwiGLU MLP's silu(gate) · up through `lazoo.layers.mlp.silu_mul`: the same values and gradients as
autograd's composition, bit for bit, and one tensor fewer kept for the backward."""

import pytest
import torch
import torch.nn.functional as F

from lazoo.layers.mlp import GatedMLP, silu_mul


def _saved_bytes(fn, *args) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``fn(*args)`` (each storage counted once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_silu_mul_equals_autograd_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(3)
    gate = (torch.randn(4, 37, 24, generator=gen) * 3).to(dtype).requires_grad_()
    up = torch.randn(4, 37, 24, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(4, 37, 24, generator=gen).to(dtype)
    ours = silu_mul(gate, up)
    d_ours = torch.autograd.grad(ours, (gate, up), grad)
    ref = F.silu(gate) * up
    d_ref = torch.autograd.grad(ref, (gate, up), grad)
    assert torch.equal(ours, ref)
    for a, b, name in zip(d_ours, d_ref, ("gate", "up")):
        assert torch.equal(a, b), f"d{name} differs from autograd's ({(a - b).abs().max().item():.3e})"


def test_silu_mul_keeps_one_tensor_fewer():
    gate = torch.randn(8, 64, requires_grad=True)
    up = torch.randn(8, 64, requires_grad=True)
    per_tensor = gate.numel() * gate.element_size()
    assert _saved_bytes(lambda a, b: F.silu(a) * b, gate, up) == 3 * per_tensor  # gate, silu(gate), up
    assert _saved_bytes(silu_mul, gate, up) == 2 * per_tensor  # gate, up


def test_silu_mul_one_input_without_grad_and_no_grad_mode():
    gate = torch.randn(5, 7, requires_grad=True)
    up = torch.randn(5, 7)
    d_gate, = torch.autograd.grad(silu_mul(gate, up).sum(), gate)
    d_ref, = torch.autograd.grad((F.silu(gate) * up).sum(), gate)
    assert torch.equal(d_gate, d_ref)
    with torch.no_grad():
        out = silu_mul(gate, up)
    assert out.grad_fn is None and torch.equal(out, F.silu(gate) * up)


def test_gated_mlp_gradients_unchanged():
    torch.manual_seed(0)
    mlp = GatedMLP(16, 40).double()
    x = torch.randn(3, 11, 16, dtype=torch.float64, requires_grad=True)
    out = mlp(x)
    ref = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.equal(out, ref)
    params = [x, *mlp.parameters()]
    for a, b in zip(torch.autograd.grad(out.square().sum(), params), torch.autograd.grad(ref.square().sum(), params)):
        assert torch.equal(a, b)


def test_moe_experts_keep_only_their_projection():
    from lazoo.layers.moe import MoEExperts

    torch.manual_seed(1)
    experts = MoEExperts(num_experts=2, hidden_size=8, intermediate_size=12).double()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    projected = torch.nn.functional.linear(x, experts.in_proj[0]).detach().requires_grad_()
    assert _saved_bytes(experts._hidden, projected) == projected.numel() * projected.element_size()
    out = experts.expert_forward(0, x)
    gate, up = torch.nn.functional.linear(x, experts.in_proj[0]).chunk(2, dim=-1)
    ref = torch.nn.functional.linear(F.silu(gate) * up, experts.down_proj[0])
    assert torch.equal(out, ref)
    params = [x, experts.in_proj, experts.down_proj]
    for a, b in zip(torch.autograd.grad(out.square().sum(), params), torch.autograd.grad(ref.square().sum(), params)):
        assert torch.equal(a, b)
