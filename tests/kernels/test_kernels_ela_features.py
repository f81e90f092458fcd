"""The features of ELA's polynomial kernels (lazoo.kernels.ela_features) against their definition in float64
(``lazoo.ops.ela._poly_parts``): q', k', a, c with pads (c zero there).

CPU (default run): the ``interp_*`` tests run under the Triton interpreter (tests/test_interpreter.py runs them).
GPU: through ``tests/ops/test_ops_ela.py -m gpu``."""

from __future__ import annotations

import pytest
import torch
from op_helpers import assert_close, left_pad_mask

from lazoo.ops.ela import _poly_parts

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402  (defines no kernel)

needs_interp = pytest.mark.skipif(not interpreter_ready(), reason="needs TRITON_INTERPRET=1 from the start "
                                                                  "(tests/test_interpreter.py runs it)")
KERNELS = ["sum_sq_euclid", "sub_sq_euclid", "magnitude_direction"]


@needs_interp
@pytest.mark.parametrize("kernel", KERNELS)
def test_interp_features_match_the_definition(kernel):
    """q', k', a, c against the float64 definition, with pads; they carry no gradient (the normalised kernel's
    backward forms dq and dk: tests/ops/test_ops_ela.py checks them against the float64 reference)."""
    from lazoo.kernels.ela_features import poly_features

    B, T, H, D = 2, 13, 3, 20  # D not a power of two
    gen = torch.Generator().manual_seed(3)
    mask = left_pad_mask([T, T - 4], T, holes=[(0, 6)])
    q, k = (torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) * mask[..., None, None] for _ in range(2))
    q1, k1, a, c = _poly_parts(kernel, q, k)
    ref = (q1, k1, a, c * mask[..., None, None])
    got = poly_features(q.float().requires_grad_(True), k.float().requires_grad_(True), kernel, mask)
    for what, x, y in zip(("q'", "k'", "a", "c"), got, ref):
        assert not x.requires_grad, f"{what} carries a gradient"
        assert_close(x.double(), y, 1e-5, what)


@needs_interp
def test_interp_refuses_an_unknown_kernel():
    from lazoo.kernels.ela_features import poly_features

    x = torch.ones(1, 2, 1, 16)
    with pytest.raises(ValueError, match="hadamard_exp"):
        poly_features(x, x, "hadamard_exp")
