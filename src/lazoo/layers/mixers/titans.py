"""Titans neural-memory mixer (Behrouz et al. 2024), the memory as a layer (the "MAL"-style use).

Per head, a linear memory M (``[head_dim, head_dim]``, from a learned M₀; momentum S₀ = 0) learns k_t → v_t
while reading: ``S_t = η_t S_{t−1} − θ_t ∇ℓ(M; k_t, v_t)``, ``M_t = (1 − α_t) M_{t−1} + S_t``, ``o_t = M_t q_t``,
with ``θ_t = lr_scale · σ(·)`` (lr_scale = 0.3: the momentum multiplies the effective step by up to 1/(1 − η)),
``η_t = σ(·)``, ``α_t = σ(· + forget_bias)`` from one projection ``gate_proj``
(3 scalars per head and token). Gradients within a mini-batch of ``mini_batch_size`` tokens are taken at the
mini-batch's start memory (see ``lazoo.ops.titans``). The cache entry is ``{"op": {M, S, M_start, n}, "conv": …}``.

`memory_as_context=True` (a config field) selects the memory-as-context (MAC) layout instead: the sequence is cut
into segments of ``mini_batch_size`` real tokens; for each segment, h = M_{segment start}(q) is retrieved from the
memory (no update), softmax attention runs over [``num_persistent`` learned persistent tokens; h; the segment]
(causal inside the segment; P, h and the segment all through the layer's k/v projections), its output y feeds
the memory (keys, values and queries from y through ``mk_proj``, ``mv_proj``, ``mq_proj``; gates from x), and the
layer outputs ``y ⊙ M_t(q_y)``. The cache then also holds the current segment's keys/values (``"seg"``).
"""

from __future__ import annotations

import torch
from torch import nn

from ... import ops
from ...ops.norms import l2norm
from ...ops.ttt import slot_grid
from ...registry import Mechanism, register
from .base import normal_parameter
from .recurrent import RecurrentMixer


class TitansMixer(RecurrentMixer):
    mechanism = "titans"
    defaults = {**RecurrentMixer.defaults, "mini_batch_size": 16, "lr_scale": 0.3, "forget_bias": -4.0,
                "use_qk_l2norm": True, "memory_as_context": False, "num_persistent": 4}

    def __init__(self, config, layer_idx, options):
        super().__init__(config, layer_idx, options)
        self.check_positive_int("mini_batch_size")
        self.gate_proj = nn.Linear(config.hidden_size, 3 * self.num_heads, bias=True)
        self.M0 = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.head_dim))
        self.persistent = None
        if options["memory_as_context"]:
            p = self.check_positive_int("num_persistent")
            if options["use_short_conv"]:
                raise ValueError("titans: memory_as_context does not support use_short_conv")
            d = config.hidden_size
            self.persistent = nn.Parameter(torch.empty(p, d))
            self.mq_proj = nn.Linear(d, d, bias=False)
            self.mk_proj = nn.Linear(d, d, bias=False)
            self.mv_proj = nn.Linear(d, d, bias=False)
        self._init_lazoo_parameters(None)

    def _init_lazoo_parameters(self, init):
        params = [self.M0] + ([self.persistent] if self.persistent is not None else [])
        for p in params:
            normal_parameter(p, 0.02, init)

    def _gates(self, x, dtype):
        o = self.options
        cdt = torch.promote_types(x.dtype, torch.float32)
        z = self.gate_proj(x).to(cdt).view(*x.shape[:2], 3, self.num_heads)
        theta = (o["lr_scale"] * torch.sigmoid(z[:, :, 0])).to(dtype)
        eta = torch.sigmoid(z[:, :, 1]).to(dtype)
        alpha = torch.sigmoid(z[:, :, 2] + o["forget_bias"]).to(dtype)
        return theta, eta, alpha

    def mix(self, q, k, v, x, *, mask, state, want_state):
        o = self.options
        if o["use_qk_l2norm"]:
            q, k = l2norm(q), l2norm(k)
        theta, eta, alpha = self._gates(x, q.dtype)
        if state is None:
            state = {"M": self.M0[None].expand(q.shape[0], *self.M0.shape)}
        return ops.titans(q, k, v, theta, eta, alpha, mini_batch_size=o["mini_batch_size"],
                          **self.op_kwargs(mask, state, want_state))

    # ------------------------------------------------------------------ memory as context (MAC)
    def forward(self, hidden_states, *, mask=None, position_ids=None, cache=None, cu_seqlens=None):
        if not self.options["memory_as_context"]:
            return super().forward(hidden_states, mask=mask, position_ids=position_ids, cache=cache,
                                   cu_seqlens=cu_seqlens)
        if cu_seqlens is not None:
            if mask is not None or cache is not None:
                raise ValueError("TitansMixer: packed sequences (cu_seqlens) take no mask and no cache")
            bounds = cu_seqlens.tolist()
            return torch.cat([self._forward_mac(hidden_states[:, s:e], None, None)
                              for s, e in zip(bounds[:-1], bounds[1:]) if e > s], 1)
        return self._forward_mac(hidden_states, mask, cache)

    def _forward_mac(self, x, mask, cache):
        B, T, _ = x.shape
        hd, C = self.head_dim, self.options["mini_batch_size"]
        dev = x.device
        entry = self.read_state(cache) or {}
        state = entry.get("op") or {"M": self.M0[None].expand(B, *self.M0.shape)}
        n0 = state["n"] if "n" in state else torch.zeros(B, dtype=torch.long, device=dev)
        seg = entry.get("seg")
        # real tokens at slots n0 + rank: slot chunk c is segment c of every sample, whatever its padding
        real = torch.ones(B, T, dtype=torch.bool, device=dev) if mask is None else mask.bool()
        grid = slot_grid(real, n0, C, fresh="n" not in state)
        N, new_valid = grid.L // C, grid.valid
        xs = grid.to_slots(x)
        q, k, v = (self.split_heads(p(xs)) for p in (self.q_proj, self.k_proj, self.v_proj))
        theta, eta, alpha = self._gates(xs, q.dtype)
        kP = self.split_heads(self.k_proj(self.persistent)[None]).expand(B, -1, -1, -1)
        vP = self.split_heads(self.v_proj(self.persistent)[None]).expand(B, -1, -1, -1)
        nP = kP.shape[1]
        causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
        outs, bufs = [], []
        for c in range(N):
            sl = slice(c * C, (c + 1) * C)
            qc, kc, vc, nv = q[:, sl], k[:, sl], v[:, sl], new_valid[:, sl]
            Ms = state.get("M_start", state["M"]).to(q.dtype)  # the memory at the segment start
            h = torch.einsum("bhvk,bchk->bchv", Ms, l2norm(qc))  # retrieval, no update
            hm = self.merge_heads(h)
            kh, vh = self.split_heads(self.k_proj(hm)), self.split_heads(self.v_proj(hm))
            avail = nv
            if c == 0 and seg is not None:  # the earlier tokens of a segment resumed from the cache
                old = torch.arange(C, device=dev)[None] < n0[:, None]
                w = old[..., None, None]
                kc, vc = torch.where(w, seg["k"], kc), torch.where(w, seg["v"], vc)
                kh, vh = torch.where(w, seg["kh"], kh), torch.where(w, seg["vh"], vh)
                avail = nv | old
            keys, vals = torch.cat([kP, kh, kc], 1), torch.cat([vP, vh, vc], 1)
            seen = causal[None] & avail[:, None, :]  # [B, query, key]
            allowed = torch.cat([seen.new_ones(B, C, nP), seen, seen], -1)
            scores = torch.einsum("bqhd,bkhd->bhqk", qc, keys) * hd ** -0.5
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            y = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vals)
            ym = self.merge_heads(y)
            mq, mk = l2norm(self.split_heads(self.mq_proj(ym))), l2norm(self.split_heads(self.mk_proj(ym)))
            mv = self.split_heads(self.mv_proj(ym))
            om, state = ops.titans(mq, mk, mv, theta[:, sl], eta[:, sl], alpha[:, sl], mini_batch_size=C,
                                   initial_state=state, output_final_state=True, mask=nv,
                                   backend=self.options.get("backend"))
            outs.append(y * om)
            bufs.append({"k": kc, "v": vc, "kh": kh, "vh": vh})
        o = torch.cat(outs, 1)
        if self.o_norm is not None:
            o = self.o_norm(o)
        o = grid.from_slots(o)
        if cache is not None:
            # the segment the next call resumes (the last filled one when the segments end full)
            idx = torch.div(grid.total, C, rounding_mode="floor").clamp_max(grid.filled_chunks - 1)
            ar = torch.arange(B, device=dev)
            seg_new = {name: torch.stack([b_[name] for b_ in bufs], 0)[idx, ar] for name in bufs[0]}
            self.write_state(cache, {"op": state, "conv": None, "seg": seg_new})
        o = self.merge_heads(o)
        if self.g_proj is not None:
            o = o * torch.nn.functional.silu(self.g_proj(x))
        return self.o_proj(o)


register(Mechanism(
    name="titans", mixer=TitansMixer, op="titans", title="Titans neural memory (linear memory)",
    equation=(
        "S_t = η_t S_{t−1} − θ_t (M_{t'} k_t − v_t) k_tᵀ, M_t = (1 − α_t) M_{t−1} + S_t (gradients at the "
        "mini-batch start M_{t'}); o_t = M_t q_t"
    ),
    source="Behrouz, Zhong, Mirrokni 2024, Titans: Learning to Memorize at Test Time",
    state='{"op": memory, momentum and mini-batch-start state, "conv": short-conv tails}',
    tiny_options={"mini_batch_size": 4},
))
