"""Float64 references for fla's (flash-linear-attention 0.6.0) softmax attention layer, `fla.layers.attn.Attention`,
and its MLP, written from fla's code with plain torch (no fla import here).

- `fla_attention`: fla's layer equations: q/k/v projections (optional biases), per-head RMSNorm of q and k with a
  learned weight (`qk_norm`, before RoPE), half-split RoPE at positions 0..T-1 of the padded row (fla's forward
  without a cache), grouped-query heads, causal softmax with scale head_dim^-0.5 over the real tokens only (fla
  unpads with the attention mask), the last `window_size` real tokens with a window (flash-attention's
  window (W-1, 0)), zeros at pads, the output projection (no bias).
- `flash_attn_func` / `flash_attn_varlen_func`, `rotary_embedding`, `rms_norm_forward`: torch stand-ins for the
  kernels fla's layer calls (flash-attention and fla's Triton kernels need a GPU), so that fla's own forward runs
  on the CPU in float64.
- `fla_intermediate_size`: fla's MLP width rule.

Weight names: fla's `Attention` and lazoo's attention mixer use the same names (`FLA_TO_LAZOO_ATTENTION`).
"""

from __future__ import annotations

import torch

#: fla `Attention` parameter -> lazoo attention-mixer parameter (the same shapes; biases only with qkv_bias,
#: norms only with qk_norm / lazoo's qk_rmsnorm). In a model: `model.layers.{i}.attn.X` -> `model.layers.{i}.mixer.X`.
FLA_TO_LAZOO_ATTENTION = {
    "q_proj.weight": "q_proj.weight", "k_proj.weight": "k_proj.weight", "v_proj.weight": "v_proj.weight",
    "o_proj.weight": "o_proj.weight", "q_proj.bias": "q_proj.bias", "k_proj.bias": "k_proj.bias",
    "v_proj.bias": "v_proj.bias", "q_norm.weight": "q_norm.weight", "k_norm.weight": "k_norm.weight",
}


def fla_intermediate_size(hidden_size: int, hidden_ratio: int | float | None, intermediate_size: int | None) -> int:
    """The width of fla's GatedMLP (`fla.modules.GatedMLP`): `intermediate_size` when given; else
    int(hidden_size · hidden_ratio · 2/3) rounded up to a multiple of 256, with hidden_ratio 4 when None."""
    if intermediate_size is not None:
        return int(intermediate_size)
    ratio = 4 if hidden_ratio is None else hidden_ratio
    width = int(hidden_size * ratio * 2 / 3)
    return 256 * ((width + 256 - 1) // 256)


def gated_mlp(x, gate_weight, up_weight, down_weight):
    """fla's GatedMLP with hidden_act 'swish': down(swish(gate x) · up x), no biases."""
    gate = x @ gate_weight.T
    return (gate * torch.sigmoid(gate) * (x @ up_weight.T)) @ down_weight.T


def rms_norm(x, weight, eps):
    """fla's RMSNorm (`rms_norm_ref`): x / sqrt(mean(x²) + eps) · weight over the last dim."""
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def rope_tables(positions, dim: int, theta: float):
    """cos/sin `[..., dim // 2]` of fla's RotaryEmbedding at `positions` (inv_freq = θ^(−2i/dim))."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def rotate_half_split(x, cos, sin):
    """fla's non-interleaved rotation of `x` `[..., H, D]` with cos/sin `[..., D // 2]` (broadcast over H)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def attend(q, k, v, window: int | None, offset: int):
    """Causal softmax attention of one sequence, q `[Tq, H, D]`, k/v `[Tk, Hkv, D]`, scale D^-0.5, query head h
    reading key/value head h // (H // Hkv). Query i sits at key position i + offset (flash-attention aligns the
    queries to the end of the keys: offset = Tk − Tq) and sees keys j ≤ i + offset, and j > i + offset − window."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * q.shape[-1] ** -0.5
    i = torch.arange(q.shape[0])[:, None] + offset
    j = torch.arange(k.shape[0])[None, :]
    visible = (j <= i) & (j > i - window) if window is not None else j <= i
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v)


def fla_attention(x, params: dict, *, num_heads: int, num_kv_heads: int | None = None, qk_norm: bool = False,
                  norm_eps: float = 1e-5, window_size: int | None = None, rope_theta: float = 10000.0,
                  attention_mask=None):
    """fla's `Attention.forward` without a cache, in the dtype of `x` `[B, T, hidden]`; `params` holds fla's
    parameter names (`q_proj.weight`, optional `q_proj.bias`, `q_norm.weight`, ...). `attention_mask` `[B, T]`
    (1 = real token) or None."""
    B, T, hidden = x.shape
    head_dim = hidden // num_heads
    kv_heads = num_kv_heads or num_heads

    def project(name, heads):
        y = x @ params[f"{name}.weight"].T
        if f"{name}.bias" in params:
            y = y + params[f"{name}.bias"]
        return y.view(B, T, heads, head_dim)

    q, k, v = project("q_proj", num_heads), project("k_proj", kv_heads), project("v_proj", kv_heads)
    if qk_norm:
        q, k = rms_norm(q, params["q_norm.weight"], norm_eps), rms_norm(k, params["k_norm.weight"], norm_eps)
    cos, sin = rope_tables(torch.arange(T), head_dim, rope_theta)  # no cache: positions of the padded row
    q, k = rotate_half_split(q, cos, sin), rotate_half_split(k, cos, sin)
    mask = torch.ones(B, T, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    o = torch.zeros_like(q)
    for b in range(B):
        real = mask[b].nonzero()[:, 0]  # fla unpads: the window counts real tokens
        o[b, real] = attend(q[b, real], k[b, real], v[b, real], window_size, offset=0)
    return o.reshape(B, T, hidden) @ params["o_proj.weight"].T


# ---------------------------------------------------------------------------- stand-ins for fla's kernels
def _flash_window(window_size) -> int | None:
    """flash-attention's (left, right) window -> the number of keys a query sees (None: unbounded)."""
    left, right = window_size
    if right not in (0, -1):
        raise NotImplementedError(f"stand-in: right window {right} (fla uses 0 or -1)")
    return None if left < 0 else left + 1


def flash_attn_func(q, k, v, causal=True, window_size=(-1, -1), softmax_scale=None, **unused):
    """flash_attn_func on `[B, T, H, D]` inputs (causal, default scale D^-0.5, queries aligned to the last keys)."""
    if not causal or softmax_scale is not None or unused:
        raise NotImplementedError("stand-in: only what fla's Attention passes")
    window = _flash_window(window_size)
    offset = k.shape[1] - q.shape[1]
    return torch.stack([attend(q[b], k[b], v[b], window, offset) for b in range(q.shape[0])])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=True,
                           window_size=(-1, -1), softmax_scale=None, **unused):
    """flash_attn_varlen_func on packed `[total, H, D]` inputs, one sequence per cu_seqlens interval."""
    if not causal or softmax_scale is not None or unused:
        raise NotImplementedError("stand-in: only what fla's Attention passes")
    window = _flash_window(window_size)
    o = torch.zeros_like(q)
    bounds = zip(cu_seqlens_q.tolist(), cu_seqlens_q.tolist()[1:], cu_seqlens_k.tolist(), cu_seqlens_k.tolist()[1:])
    for qs, qe, ks, ke in bounds:
        if qe > qs:
            o[qs:qe] = attend(q[qs:qe], k[ks:ke], v[ks:ke], window, offset=(ke - ks) - (qe - qs))
    return o


def rotary_embedding(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     chunk_indices=None):
    """fla's `rotary_embedding` kernel: x `[B, T, H, D]`, cos/sin tables `[TR, D // 2]`; token t of sequence n sits
    at table row t + seqlen_offsets[n] (t counted from each sequence's start with cu_seqlens); a token whose row is
    outside the table comes out as zeros, as in the kernel."""
    if interleaved or inplace:
        raise NotImplementedError("stand-in: fla's Attention rotates half-split pairs, out of place")
    B, T = x.shape[:2]
    if cu_seqlens is None:
        starts = torch.zeros(B, T, dtype=torch.long)
        seq = torch.arange(B)[:, None].expand(B, T)
    else:
        seq = torch.bucketize(torch.arange(T), cu_seqlens[1:].cpu(), right=True)[None]
        starts = cu_seqlens.cpu()[seq]
    offsets = torch.as_tensor(seqlen_offsets).reshape(-1).expand(int(seq.max()) + 1)
    rows = torch.arange(T)[None] - starts + offsets[seq]
    inside = (rows >= 0) & (rows < cos.shape[0])
    rows = rows.clamp(0, cos.shape[0] - 1)
    y = rotate_half_split(x, cos[rows], sin[rows])
    return y * inside[..., None, None]


def rms_norm_forward(norm, x, residual=None, prenorm=False, residual_in_fp32=False):
    """`fla.modules.RMSNorm.forward` without its kernel (fla's `rms_norm_ref`, in x's dtype)."""
    if residual is not None or prenorm or norm.bias is not None:
        raise NotImplementedError("stand-in: fla's attention q/k norms take x only")
    return rms_norm(x, norm.weight, norm.eps)
