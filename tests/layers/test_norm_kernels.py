"""The decoder's norms on the Triton RMSNorm (``lazoo.kernels.rms_norm``) where it runs by default on CUDA: an
`RMSNorm` whose weight's dtype is not its input's (autocast: torch's form is then unfused) and a recurrent mixer's
output norm with its SiLU gate give the values and gradients of their PyTorch forms, and the kernel is what ran;
a norm of one dtype stays on torch's fused op. On the CPU the interpreter runs the kernel with ``fused_norm_runs``
patched to say yes (``interp_*`` tests; ``tests/test_interpreter.py``); the GPU test takes the default path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from lazoo import LazooConfig
from lazoo.layers import norms
from lazoo.layers.mlp import silu_mul

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")


@pytest.fixture
def kernel_calls(monkeypatch):
    """The norms take the kernel on the CPU (under the interpreter); the list counts its calls."""
    from lazoo.kernels import rms_norm as krn

    calls = []
    real = krn.rms_norm

    def counted(*args, **kwargs):
        calls.append(kwargs.get("gate") is not None)
        return real(*args, **kwargs)

    def runs(x, weight, gate=None):
        return krn.check_supported(x, weight, gate) is None

    monkeypatch.setattr(krn, "rms_norm", counted)
    monkeypatch.setattr(norms, "fused_norm_runs", runs)
    return calls


def random_norm(dim: int, eps: float) -> norms.RMSNorm:
    """An `RMSNorm` with a random weight (seed 0)."""
    torch.manual_seed(0)
    norm = norms.RMSNorm(dim, eps=eps)
    with torch.no_grad():
        norm.weight.normal_()
    return norm


def values_and_grads(fn, *inputs):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad((out * proj).sum(), inputs)
    return out, grads


@needs_interp
def test_interp_a_norm_of_mixed_dtypes_runs_the_kernel_and_one_of_one_dtype_does_not(kernel_calls):
    norm = random_norm(24, 1e-5)
    x = torch.randn(3, 7, 24)
    same, _ = values_and_grads(norm, x)
    zero_centered = norms.rms_norm(24, 1e-5, zero_centered=True)
    zero_centered(x)
    assert kernel_calls == []  # one dtype: torch's fused op; the zero-centred norm: torch's few ops
    half = x.bfloat16()
    fused, fused_grads = values_and_grads(lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)),
                                          half, norm.weight)
    assert kernel_calls == [False] and fused.dtype == torch.bfloat16
    plain, plain_grads = values_and_grads(lambda x, w: F.rms_norm(x.float(), (24,), w, 1e-5).bfloat16(),
                                          half, norm.weight)
    torch.testing.assert_close(fused.float(), plain.float(), rtol=1e-2, atol=1e-2)
    for got, want in zip(fused_grads, plain_grads):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(same, F.rms_norm(x, (24,), norm.weight, 1e-5))


@needs_interp
def test_interp_output_norm_and_silu_gate_in_one_kernel(kernel_calls):
    norm = random_norm(16, 1e-6)
    o, gate = torch.randn(2, 5, 3, 16), torch.randn(2, 5, 3, 16)
    fused, fused_grads = values_and_grads(
        lambda o, g, w: norms.norm_then_silu_gate(_with_weight(norm, w), o, g), o, gate, norm.weight)
    assert kernel_calls == [True]
    plain, plain_grads = values_and_grads(lambda o, g, w: silu_mul(g, F.rms_norm(o, (16,), w, 1e-6)),
                                          o, gate, norm.weight)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    for got, want in zip(fused_grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _with_weight(norm, weight):
    """`norm` with `weight` (a leaf that wants its gradient) in place of its parameter."""
    copy = norms.RMSNorm(norm.normalized_shape, eps=norm.eps)
    del copy.weight
    copy.weight = weight
    return copy


@needs_interp
def test_interp_a_model_gives_the_same_logits_and_gradients_on_the_kernel(kernel_calls, monkeypatch):
    config = LazooConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         layer_types=["gated_delta_net", "softmax"], zero_centered_norm=True,
                         mixer_kwargs={"softmax": {"qk_rmsnorm": True}})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 40, (2, 9))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fused_logits, fused_grads = run()
    assert kernel_calls == [True]  # the Gated DeltaNet layer's output norm with its gate; the rest: one dtype
    monkeypatch.setattr(norms, "fused_norm_runs", lambda *a, **k: False)
    plain_logits, plain_grads = run()
    torch.testing.assert_close(fused_logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert fused_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(fused_grads[name], plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_mixed_dtype_and_gated_norms_take_the_kernel_by_default():
    norm = norms.RMSNorm(128, eps=1e-6).cuda()
    x = torch.randn(4, 512, 16, 128, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn_like(x)
    assert norms.fused_norm_runs(x, norm.weight, gate)
    want = F.rms_norm(x.float(), (128,), norm.weight, 1e-6)
    torch.testing.assert_close(norm(x).float(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(norms.norm_then_silu_gate(norm, x, gate).float(), want * F.silu(gate.float()),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("module", ["lazoo.kernels.rms_norm", "lazoo.kernels.gates"])
def test_without_the_kernels_the_layers_take_their_pytorch_forms(module, monkeypatch):
    """An exported model folder has no kernels (importing them raises ImportError): on CUDA the norms and the Gated
    DeltaNet gates then run in PyTorch instead of failing."""
    import sys
    import types

    from lazoo.layers.mixers import delta as mixers

    monkeypatch.setitem(sys.modules, module, None)  # `import` of it raises ImportError
    on_cuda = types.SimpleNamespace(is_cuda=True)
    if module.endswith("rms_norm"):
        assert norms.fused_norm_runs(on_cuda, None) is False
    else:
        assert mixers.gates_kernel_runs(on_cuda, None, None, None) is False
