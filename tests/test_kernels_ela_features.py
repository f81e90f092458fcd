"""The features of ELA's polynomial kernels (lazoo.kernels.ela_features) against their definition in float64
(``lazoo.ops.ela._poly_parts``): q', k', a, c, and dq, dk from random gradients of all four, with pads (c zero there).

CPU (default run): the ``interp_*`` tests run under the Triton interpreter (tests/test_interpreter.py runs them).
GPU: through ``tests/test_ops_ela.py -m gpu``."""

from __future__ import annotations

import pytest
import torch

from lazoo.ops._testing import assert_close, left_pad_mask
from lazoo.ops.ela import _poly_parts

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

needs_interp = pytest.mark.skipif(not interpreter_ready(), reason="needs TRITON_INTERPRET=1 from the start "
                                                                  "(tests/test_interpreter.py runs it)")
KERNELS = ["sum_sq_euclid", "sub_sq_euclid", "magnitude_direction"]


@needs_interp
@pytest.mark.parametrize("kernel", KERNELS)
def test_interp_features_and_gradients_match_the_definition(kernel):
    from lazoo.kernels.ela_features import poly_features

    B, T, H, D = 2, 13, 3, 20  # D not a power of two
    gen = torch.Generator().manual_seed(3)
    mask = left_pad_mask([T, T - 4], T, holes=[(0, 6)])
    q, k = (torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) * mask[..., None, None] for _ in range(2))
    grads = None
    outs = {}
    for name, dtype in (("ref", torch.float64), ("kernel", torch.float32)):
        qi, ki = q.to(dtype).requires_grad_(True), k.to(dtype).requires_grad_(True)
        if name == "ref":
            q1, k1, a, c = _poly_parts(kernel, qi, ki)
            c = c * mask[..., None, None]
        else:
            q1, k1, a, c = poly_features(qi, ki, kernel, mask)
        if grads is None:
            grads = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (q1, k1, a, c)]
        loss = sum((x * g.to(x.dtype)).sum() for x, g in zip((q1, k1, a, c), grads))
        dq, dk = torch.autograd.grad(loss, (qi, ki))
        outs[name] = [x.detach().double() for x in (q1, k1, a, c, dq, dk)]
    for what, x, y in zip(("q'", "k'", "a", "c", "dq", "dk"), outs["kernel"], outs["ref"]):
        assert_close(x, y, 1e-5, what)


@needs_interp
def test_interp_refuses_an_unknown_kernel():
    from lazoo.kernels.ela_features import poly_features

    x = torch.ones(1, 2, 1, 16)
    with pytest.raises(ValueError, match="hadamard_exp"):
        poly_features(x, x, "hadamard_exp")
