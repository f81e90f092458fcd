"""Online Vector-Quantized attention (the OVQ paper) and VQ-attention (its baseline) mixers.

Both use unit-norm queries and keys multiplied by a learned per-head scale β (QK-norm) and no
positional encoding (NoPE), as in the OVQ paper, §8.1–8.3; the op does the dictionary work. The cache entry
is `{"op": <the op's state dict>, "conv": None}` (dictionaries, counts, partial chunk, token count for
OVQ; value means and counts for VQ).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from ...registry import Mechanism, register
from .base import init_qk_scale, normal_parameter, unit_norm
from .recurrent import RecurrentMixer


class OVQMixer(RecurrentMixer):
    """Online VQ attention: per chunk, softmax over [key dictionary (log-count bias); the chunk's raw keys],
    then spread-maximising growth (N_t = tN/(t+N)) and count-weighted centroid updates of both dictionaries.

    `max_dict_size` is read from the config at every forward call, so it can be changed after loading
    (`model.config.max_dict_size = 4096`, or `mixer_kwargs["ovq"]["max_dict_size"]`)."""

    mechanism = "ovq"
    defaults = {
        **RecurrentMixer.defaults,
        "output_norm": False,  # the softmax read-out is already an average of values
        "chunk_size": 128,
        "max_dict_size": 2048,
        "triton_assign": True,  # the Triton backend's slot assignments as Triton kernels (lazoo.ops.ovq_attention)
    }

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self._config = config  # `max_dict_size` is read at call time
        self.qk_scale = nn.Parameter(torch.full((self.num_heads,), math.sqrt(self.head_dim)))

    def _init_lazoo_parameters(self, init):
        init_qk_scale(self, init)

    def current_options(self) -> dict:
        """The options as the config says now (a field changed after loading takes effect)."""
        resolve = getattr(self._config, "mixer_options", None)
        return resolve(self.mechanism) if resolve is not None else self.options

    def mix(self, q, k, v, x, *, mask, state, want_state):
        o = self.current_options()
        q, k = unit_norm(q), unit_norm(k)
        return ops.ovq_attention(q, k, v, scale=self.qk_scale, chunk_size=o["chunk_size"],
                                 max_dict_size=o["max_dict_size"], triton_assign=o["triton_assign"],
                                 **self.op_kwargs(mask, state, want_state))


class _AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on `x`; the backward pass adds the gradient of `loss` (as if it were added to the model's
    loss), so an auxiliary loss trains parameters without changing the model's forward code or output."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_dtype, ctx.needs = loss.dtype, loss.requires_grad
        return x.clone()

    @staticmethod
    def backward(ctx, grad_output):
        grad_loss = torch.ones((), dtype=ctx.loss_dtype, device=grad_output.device) if ctx.needs else None
        return grad_output, grad_loss


class VQMixer(RecurrentMixer):
    """VQ-attention: keys replaced by their nearest entry of a learned per-head codebook (unit-norm, dot
    product); causal softmax over the quantised keys in its linear form softmax(β q Cᵀ + log c_t) D_v,t.

    Codebook training (the classic VQ-VAE recipe, not the OVQ paper's DiVeQ / SF-DiVeQ): the codebook gets the
    task gradient through the attention logits, and during training a codebook loss ‖sg(k) − c‖² plus a
    commitment loss `commit_weight`·‖k − sg(c)‖² (mean over real tokens and heads, times `vq_loss_weight`)
    is added through the backward pass. Keys get no straight-through gradient from the op: the linear form
    aggregates keys per code, so only the commitment loss shapes them."""

    mechanism = "vq"
    defaults = {
        **RecurrentMixer.defaults,
        "output_norm": False,
        "chunk_size": 64,
        "codebook_size": 1024,
        "commit_weight": 0.25,
        "vq_loss_weight": 1.0,
    }

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        n = self.check_positive_int("codebook_size")
        self.qk_scale = nn.Parameter(torch.full((self.num_heads,), math.sqrt(self.head_dim)))
        self.codebook = nn.Parameter(torch.empty(self.num_heads, n, self.head_dim))
        self._init_lazoo_parameters(None)

    def _init_lazoo_parameters(self, init):
        init_qk_scale(self, init)
        normal_parameter(self.codebook, 1.0, init)

    def mix(self, q, k, v, x, *, mask, state, want_state):
        o = self.options
        q, k = unit_norm(q), unit_norm(k)
        codebook = F.normalize(self.codebook, dim=-1).to(q.dtype)
        out, new_state = ops.vq_attention(q, k, v, codebook, scale=self.qk_scale, chunk_size=o["chunk_size"],
                                          **self.op_kwargs(mask, state, want_state))
        if self.training and torch.is_grad_enabled() and o["vq_loss_weight"]:
            out = _AddAuxiliaryLoss.apply(out, self.vq_loss(k, codebook, mask))
        return out, new_state

    def vq_loss(self, k, codebook, mask=None):
        """VQ-VAE codebook + commitment loss of unit keys `[B, T, H, d]` against their nearest codes."""
        idx = torch.einsum("bthd,hnd->bthn", k.detach(), codebook.detach()).argmax(-1)
        code = codebook[torch.arange(self.num_heads, device=k.device)[None, None], idx]
        err_code = ((k.detach() - code) ** 2).sum(-1)  # moves the codebook
        err_commit = ((k - code.detach()) ** 2).sum(-1)  # moves the keys
        per_token = err_code + self.options["commit_weight"] * err_commit  # [B, T, H]
        if mask is not None:
            w = mask.to(per_token.dtype)[..., None]
            loss = (per_token * w).sum() / (w.sum() * per_token.shape[-1]).clamp_min(1)
        else:
            loss = per_token.mean()
        return self.options["vq_loss_weight"] * loss.float()


register(Mechanism(
    name="ovq", mixer=OVQMixer, op="ovq_attention", title="Online Vector-Quantized attention",
    equation=(
        "per chunk c: O_c = softmax(β Q_c [D_k; K_c]ᵀ + [log c; 0] + causal) [D_v; V_c]; then n_new = N_{Lc} − "
        "N_{L(c−1)} (N_t = tN/(t+N)) lowest-similarity keys become centroids, the others move theirs by (x − "
        "μ)/(c_old + c_chunk)"
    ),
    source="Online Vector Quantized Attention (2026), arXiv:2602.03922",
    state='{"op": key and value dictionaries, counts, the partial chunk and the token count; "conv": None}',
    backends=("recurrent", "chunk", "triton"),
    kernels=("lazoo.kernels.ovq.attention", "lazoo.kernels.ovq.assign", "lazoo.kernels.ovq.versions"),
    option_docs={
        "chunk_size": "L: tokens per chunk (the dictionaries are updated once per chunk)",
        "max_dict_size": "N: the dictionaries' size limit (read at every forward, can change after loading)",
        "triton_assign": "the Triton backend's slot assignments as Triton kernels (default on; off: a PyTorch loop)",
    },
    tiny_options={"chunk_size": 4, "max_dict_size": 12}, class_prefix="LazooOVQ",
))

register(Mechanism(
    name="vq", mixer=VQMixer, op="vq_attention", title="VQ-attention (learned key codebook)",
    equation=(
        "o_t = softmax(β q_t Cᵀ + log c_t) D_v,t: causal softmax over keys replaced by their nearest code; counts "
        "c_t and value means D_v,t per code"
    ),
    source=("Lingle 2023, Transformer-VQ: Linear-Time Transformers via Vector Quantization; "
            "Online Vector Quantized Attention (2026) §2.2"),
    state='{"op": per-code value means and counts, the partial chunk; "conv": None}',
    tiny_options={"chunk_size": 4, "codebook_size": 8}, class_prefix="LazooVQ",
))
