"""Multi-head latent attention (MLA: "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language
Model", DeepSeek-AI, 2024), as transformers' `KimiLinearAttention` computes it for Kimi Linear ("Kimi Linear: An
Expressive, Efficient Attention Architecture", Kimi Team, 2025): keys and values come from one normalised latent per
token, the keys' last `qk_rope_head_dim` channels from a part shared by all heads.

    q_h       = q_proj(x)_h,  or q_b_proj(RMSNorm(q_a_proj(x)))_h with q_lora_rank    [dn + dr]
    [c, k_r]  = kv_a_proj_with_mqa(x),  c = RMSNorm(c)                                  c: [r], k_r: [dr]
    [kn_h, v_h] = kv_b_proj(c)_h                                                        [dn], [dv]
    k_h       = [kn_h, k_r]
    o_h       = softmax attention of q_h over the k_h, v_h seen, scale (dn + dr)^-1/2;  out = o_proj([o_1 ... o_H])

No rotary embedding by default (Kimi Linear's attention is NoPE); with `use_rope`, RoPE turns the last dr channels of
q_h and k_r (half-split pairs, positions counting real tokens).

The cache keeps the latent only (`kv_b_proj` has no bias, so it folds into the queries and the output): with
W_UK_h, W_UV_h the rows of `kv_b_proj` for head h, `q_h · k_h = (W_UK_hᵀ q_h[:dn]) · c + q_h[dn:] · k_r` and
`o_h = W_UV_h Σ_s p_s c_s`, which is multi-query attention with one key [c, k_r] (r + dr channels) and one value c
(r channels) per token. The cache keeps that latent (`softmax_attention`'s state: {"k": [B, T, 1, r + dr], "v":
[B, T, 1, r], "mask"}, against H·(dn + dr + dv) numbers a token for the expanded keys and values). A forward with
nothing cached yet (training, a prompt) runs the expanded form and writes the latent to the cache; a forward
against a filled cache (decoding) runs the latent form. Both compute the same function (float64: to rounding). The
latent form reads `kv_b_proj`'s matrix (through the module where a wrapper such as a LoRA adapter holds it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import ops
from ...ops.softmax import kv_cache_state
from ...registry import Mechanism, register
from ..rope import apply_rotary, rotary_cos_sin
from .base import TokenMixer


def latent_rms_norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """Kimi Linear's RMSNorm: the normalisation in float32 (float64 stays), cast back, then times the weight."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    return norm.weight * F.rms_norm(x.to(cdt), norm.normalized_shape, None, norm.eps).to(x.dtype)


class MultiHeadLatentAttentionMixer(TokenMixer):
    """MLA (module docstring); transformers' parameter names (`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`,
    `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`)."""

    mechanism = "mla"
    packing = "native"
    optional_int_options = ("num_heads", "q_lora_rank")
    defaults = {"num_heads": None, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "v_head_dim": 128, "attention_bias": False, "latent_norm_eps": 1e-6,
                "use_rope": False, "rope_theta": 10000.0}

    def __init__(self, config, layer_idx, options):
        self.check_options({k: options[k] for k in self.optional_int_options})
        dn, dr, dv = (self.check_positive_int(k, options[k]) if k != "qk_rope_head_dim" else options[k]
                      for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        if not isinstance(dr, int) or dr < 0 or (options["use_rope"] and dr % 2):
            raise ValueError(f"mla: qk_rope_head_dim must be an int >= 0 (even with use_rope), got {dr!r}")
        super().__init__(config, layer_idx, options, num_heads=options["num_heads"], head_dim=dn + dr)
        r = self.check_positive_int("kv_lora_rank")
        if not options["latent_norm_eps"] > 0:
            raise ValueError(f"mla: latent_norm_eps must be a number > 0, got {options['latent_norm_eps']!r}")
        self.nope_dim, self.rope_dim, self.v_dim, self.latent_dim = dn, dr, dv, r
        d, H, bias = config.hidden_size, self.num_heads, options["attention_bias"]
        eps = float(options["latent_norm_eps"])
        q_rank = options["q_lora_rank"]
        if q_rank is None:
            self.q_proj = nn.Linear(d, H * (dn + dr), bias=False)
        else:
            self.q_a_proj = nn.Linear(d, q_rank, bias=bias)
            self.q_a_layernorm = nn.RMSNorm(q_rank, eps=eps)
            self.q_b_proj = nn.Linear(q_rank, H * (dn + dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, r + dr, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(r, eps=eps)
        self.kv_b_proj = nn.Linear(r, H * (dn + dv), bias=False)
        self.o_proj = nn.Linear(H * dv, d, bias=bias)
        self._config = config  # read `_attn_implementation` at call time

    def _kv_b_matrix(self) -> torch.Tensor:
        """The matrix `kv_b_proj` applies, `[H·(dn + dv), r]`: its weight, or, where the module is not a plain
        nn.Linear (a LoRA wrapper, which a read of `.weight` would bypass), the module applied to the identity."""
        if type(self.kv_b_proj) is nn.Linear:
            return self.kv_b_proj.weight
        eye = torch.eye(self.latent_dim, device=self.o_proj.weight.device, dtype=self.o_proj.weight.dtype)
        return self.kv_b_proj(eye).transpose(0, 1)

    def keeps_every_position(self) -> bool:
        """The latent cache holds every position seen (a static cache sizes it to max_cache_len)."""
        return True

    def forward(self, hidden_states, *, mask=None, position_ids=None, cache=None, cu_seqlens=None):
        x = hidden_states
        B, T, _ = x.shape
        H, dn, dr, r = self.num_heads, self.nope_dim, self.rope_dim, self.latent_dim
        if self.options["q_lora_rank"] is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(latent_rms_norm(self.q_a_layernorm, self.q_a_proj(x)))
        q = q.view(B, T, H, dn + dr)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([r, dr], dim=-1)
        c = latent_rms_norm(self.kv_a_layernorm, c)
        k_rot = k_rot[:, :, None]  # [B, T, 1, dr]: one part for all heads
        if self.options["use_rope"] and dr:
            cos, sin = rotary_cos_sin(position_ids, dr, self.options["rope_theta"], q.dtype)
            q = torch.cat([q[..., :dn], apply_rotary(q[..., dn:], cos, sin)], -1)
            k_rot = apply_rotary(k_rot, cos, sin)
        eager = getattr(self._config, "_attn_implementation", None) == "eager"
        backend = self.options.get("backend") or ("recurrent" if eager else None)
        scale = (dn + dr) ** -0.5
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        state = self.read_state(cache)
        latent_k = torch.cat([c[:, :, None], k_rot], -1)  # [B, T, 1, r + dr]: one key and value c a token
        if state is None:  # the expanded form: H keys and values per token (training, a prompt)
            k_nope, v = self.kv_b_proj(c).view(B, T, H, dn + self.v_dim).split([dn, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_rot.expand(B, T, H, dr)], -1)
            o, _ = ops.softmax_attention(q, k, v, scale=scale, mask=mask, backend=backend, **packed)
            if cache is not None:  # the cache keeps the latent (pads zeroed, as the op keeps its own keys)
                real = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask.bool()
                self.write_state(cache, kv_cache_state(latent_k.masked_fill(~real[:, :, None, None], 0),
                                                       c[:, :, None].masked_fill(~real[:, :, None, None], 0),
                                                       real, None))
        else:  # the latent form against the cache: kv_b_proj folded into the queries and the output
            w = self._kv_b_matrix().view(H, dn + self.v_dim, r)
            q_lat = torch.cat([torch.einsum("bthd,hdr->bthr", q[..., :dn], w[:, :dn]), q[..., dn:]], -1)
            o_lat, state = ops.softmax_attention(q_lat, latent_k, c[:, :, None], scale=scale, initial_state=state,
                                                 output_final_state=True, mask=mask, backend=backend)
            self.write_state(cache, state)
            o = torch.einsum("bthr,hvr->bthv", o_lat, w[:, dn:])
        return self.o_proj(o.reshape(B, T, H * self.v_dim))


register(Mechanism(
    name="mla", mixer=MultiHeadLatentAttentionMixer, op="softmax_attention", title="Multi-head latent attention",
    equation=("c_t = RMSNorm(W_DKV x_t); k_t = [W_UK c_t, k_rot_t] (k_rot shared by the heads), v_t = W_UV c_t; "
              "o_t = Σ_{s≤t} softmax_s(q_t·k_s / √d) v_s"),
    source=("DeepSeek-AI 2024, DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model; "
            "as in Kimi Team 2025, Kimi Linear: An Expressive, Efficient Attention Architecture"),
    state='the latent KV cache: {"k": [c_t, k_rot_t] [B, T, 1, r + dr], "v": c_t [B, T, 1, r], "mask"}',
    class_prefix="LazooMLA",
    option_docs={
        "num_heads": "attention heads (None: num_attention_heads)",
        "q_lora_rank": "None: q_proj from the hidden state; a rank r_q: q_b_proj(RMSNorm(q_a_proj(x)))",
        "kv_lora_rank": "the latent's width r (what the cache keeps per token, with qk_rope_head_dim)",
        "qk_nope_head_dim": "the per-head key/query channels dn that come from the latent",
        "qk_rope_head_dim": "the key/query channels dr shared by all heads (the keys' part from kv_a_proj_with_mqa)",
        "v_head_dim": "the value head dim dv",
        "attention_bias": "q_a_proj, kv_a_proj_with_mqa and o_proj have biases",
        "latent_norm_eps": "epsilon of the latent RMSNorms (kv_a_layernorm, q_a_layernorm)",
        "use_rope": "RoPE on the dr shared channels (Kimi Linear: none)",
        "rope_theta": "RoPE base θ (with use_rope)",
    },
    tiny_options={"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
))
