"""The Mamba-2 mixer ("Transformers are SSMs", Dao and Gu, 2024): its layer written out by hand in float64 (in_proj
split, convolution, softplus step, the SSD recurrence token by token, the gate and the grouped RMSNorm), its head
layout options and their errors. The model-level tests (cache = no cache, padding, packing, save/load, Trainer, PEFT,
export) run it with every other mechanism; `tests/convert/test_convert_mamba.py` compares it with transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

import lazoo  # noqa: F401  (registers the mechanisms)
from lazoo.layers.mixers.mamba2 import Mamba2Mixer


def _mixer(**options):
    config = AutoConfig.for_model("lazoo_mamba2", hidden_size=24, num_attention_heads=3, num_hidden_layers=1,
                                  intermediate_size=0, **options)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(config, 0, config.mixer_options("mamba2")).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return mixer


def by_hand(mixer, h):
    """The layer one token at a time, in float64, from the module docstring's equations."""
    H, P, G, N = mixer.num_heads, mixer.head_dim, mixer.num_groups, mixer.state_size
    z, xBC, dt = mixer.in_proj(h).split([H * P, H * P + 2 * G * N, H], dim=-1)
    K = mixer.conv1d.kernel_size[0]
    padded = F.pad(xBC, (0, 0, K - 1, 0))
    w = mixer.conv1d.weight[:, 0]  # [C, K]: tap j multiplies x_{t - (K - 1 - j)}
    conv = torch.stack([(padded[:, t:t + K].transpose(1, 2) * w).sum(-1) for t in range(h.shape[1])], dim=1)
    x, B, C = F.silu(conv + mixer.conv1d.bias).split([H * P, G * N, G * N], dim=-1)
    dt = F.softplus(dt + mixer.dt_bias)
    A = -mixer.A_log.exp()
    S = h.new_zeros(h.shape[0], H, P, N)
    ys = []
    for t in range(h.shape[1]):
        xt = x[:, t].view(-1, H, P)
        Bt = B[:, t].view(-1, G, N).repeat_interleave(H // G, dim=1)
        Ct = C[:, t].view(-1, G, N).repeat_interleave(H // G, dim=1)
        S = (dt[:, t] * A).exp()[..., None, None] * S + dt[:, t, :, None, None] * xt[..., None] * Bt[:, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ct) + mixer.D[:, None] * xt)
    y = torch.stack(ys, dim=1).flatten(2) * F.silu(z)
    groups = y.unflatten(-1, (G, -1))
    y = (groups / groups.pow(2).mean(-1, keepdim=True).add(mixer.norm.eps).sqrt()).flatten(-2) * mixer.norm.weight
    return mixer.out_proj(y)


@pytest.mark.parametrize("options", [{"state_size": 5, "chunk_size": 4},
                                     {"num_heads": 6, "head_dim": 5, "n_groups": 3, "state_size": 4, "use_bias": True,
                                      "conv_kernel": 3, "chunk_size": 8}], ids=["defaults", "grouped"])
def test_the_layer_equals_its_equations_token_by_token(options):
    mixer = _mixer(**options)
    h = torch.randn(2, 19, 24, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mixer(h), by_hand(mixer, h), rtol=1e-10, atol=1e-12)


def test_the_head_layout_follows_the_options():
    mixer = _mixer(state_size=4)  # 3 heads of 2·24/3 = 16 channels (expand = 2)
    assert (mixer.num_heads, mixer.head_dim, mixer.num_groups) == (3, 16, 1)
    assert mixer.in_proj.out_features == 2 * 48 + 2 * 4 + 3 and mixer.conv1d.weight.shape == (48 + 8, 1, 4)
    assert mixer.norm.group_size == 48


@pytest.mark.parametrize("options,message", [
    ({"n_groups": 2}, r"mamba2: n_groups = 2 must divide the 3 heads"),
    ({"num_heads": 5}, r"hidden_size=24 must be divisible by the 'mamba2' option num_heads=5 .*head_dim for "
                       r"attention and mamba2"),
    ({"time_step_min": 0.5, "time_step_max": 0.1}, r"mamba2: time_step_min and time_step_max"),
    ({"state_size": 0}, r"mamba2: state_size must be a positive int"),
])
def test_bad_options_are_refused_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        _mixer(**options)
