"""Routed mixture-of-experts feed-forward with the routing-score bias of the ELA paper (§V-A, eqs. 14-15), and the
shared expert of Qwen3-Next / Qwen3.5-MoE.

Router: `p = softmax(W_r x)` over E experts (`W_r ∈ R^{E×D}`, computed in float32 at least), the top-k experts per
token, their scores `s_e` renormalised to sum to 1 (`norm_top_k`: None = when k > 1, lazoo's original rule; True =
always, Qwen's `norm_topk_prob=True`; False = never). Each expert is a SwiGLU MLP f_e. The paper gives each expert a
"label vector" — the router's weight row `w_e = W_r[e]`, the key the token's query is matched against — and uses it
as the expert's bias, tying what the router looks for to what the expert adds:

    eq 14   y = Σ_{e∈topk} (s_e · f_e(x) + b_e)        b_e = w_e   (the bias does not pass through s_e)
    eq 15   y = Σ_{e∈topk}  s_e · (f_e(x) + b_e)                    (it does)
    None    y = Σ_{e∈topk}  s_e · f_e(x)                            (the usual MoE)

With a shared expert (`shared_intermediate_size > 0`, Qwen3-Next / Qwen3.5-MoE) every token also passes through one
more SwiGLU MLP, scaled by a learned sigmoid gate: `y += sigmoid(w_g · x) · f_shared(x)`; with `shared_gate=False`
(Kimi Linear, DeepSeek-V3) it is added as it is: `y += f_shared(x)`.

The routing of Kimi Linear ("Kimi Linear: An Expressive, Efficient Attention Architecture", Kimi Team, 2025; the
DeepSeek-V3 router), each option on its own, the defaults giving the softmax router above:

- `score="sigmoid"`: the scores are `s = sigmoid(W_r x)` (each in (0, 1), not a distribution) in place of the softmax;
- `score_correction_bias=True`: a per-expert bias `c` (the buffer `e_score_correction_bias` [E], no gradient: the
  checkpoints adjust it to balance the load) is added to the scores to choose the experts, `s + c`; the weights of
  the chosen experts are their unbiased scores `s_e`;
- `num_groups=G`, `top_k_groups=g` (group-limited top-k): the E experts form G groups of E / G consecutive ones, a
  group's score is the sum of its two highest choice scores (`s + c`), only the experts of the g best groups may be
  chosen; G = 1 (or g = G) chooses among all of them;
- the renormalisation (`norm_top_k`) divides by `Σ s_e + 1e-20` with sigmoid scores (Kimi's guard against a sum of
  0), by `Σ s_e` with softmax scores, as before;
- `routed_scaling_factor=λ`: the weights, renormalised or not, times λ (1.0: unscaled).

So the Kimi Linear block is `y = Σ_{e∈topk} λ · s_e / (Σ s + 1e-20) · f_e(x) + f_shared(x)`.

The experts of Nemotron-H ("Nemotron-H: A Family of Accurate and Efficient Hybrid Mamba-Transformer Models", NVIDIA,
2025), each option on its own, the defaults giving SwiGLU experts in the hidden space:

- `gated=False`: every expert, and the shared expert, is a plain MLP `down(act(up(x)))` (`lazoo.layers.mlp`), with
  `act` the activation of every expert (default "silu"; Nemotron-H's "relu2");
- `latent_size=L`: the routed experts work in a latent space of L channels: `latent_in_proj` [L, D] takes the token
  there, the weighted sum of the experts comes back through `latent_out_proj` [D, L]; the router and the shared
  expert read the token itself. `y = W_out Σ_{e∈topk} w_e · f_e(W_in x) + f_shared(x)`.

Parameters (`E` experts of width `I`, shared width `S`, hidden `D`), the layout of transformers' MoE blocks:

    router.weight                 [E, D]        (Qwen: mlp.gate.weight)
    experts.gate_up_proj          [E, 2I, D]    rows [:I] the gate projection, [I:] the up projection
    experts.up_proj               [E, I, D]     (gated=False, in place of gate_up_proj)
    experts.down_proj             [E, D, I]     (D is the latent width L with latent_size)
    latent_in_proj.weight [L, D], latent_out_proj.weight [D, L]   (with latent_size)
    shared_expert.{gate,up}_proj.weight  [S, D],  shared_expert.down_proj.weight  [D, S]
    shared_expert_gate.weight     [1, D]        (none with shared_gate=False)
    e_score_correction_bias       [E]           (a buffer, with score_correction_bias=True; Kimi: gate.e_score_...)

The experts are stored stacked (not one nn.Linear per expert) so that a grouped GEMM reads them in place; a state
dict of the first layout (`experts.{e}.gate_proj.weight` ...) is stacked when loaded (`stack_legacy_experts`). LoRA
reaches the stacked experts through PEFT's `target_parameters=["experts.gate_up_proj", "experts.down_proj"]`; the
router and the shared expert are nn.Linear modules (`target_modules`).

Expert computation (`backend`): "loop" sorts the (token, slot) pairs by expert once and runs each expert on its
rows (one host sync for the group sizes; the CPU default); "grouped" runs all experts in two grouped GEMMs
(`torch.nn.functional.grouped_mm` / `torch._grouped_mm`, no host sync; the default on CUDA in bfloat16 where the
device supports it). Both give the reference's numbers (to rounding).

Load balancing (as in Switch/Mixtral): `aux = E · Σ_e f_e P_e`, f_e the fraction of the N·k routing
slots that went to expert e and P_e the mean router probability of e, over real tokens (1 when balanced). With
sigmoid scores the probabilities are the scores normalised to sum 1 per token (DeepSeek-V3's balance loss).
The last forward's value is kept in `aux_loss` for the model to collect.
"""

from __future__ import annotations

import functools
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import activation, make_mlp, silu_mul

BIAS_MODES = (None, "eq14", "eq15")
#: how the router turns its logits into scores
ROUTER_SCORES = ("softmax", "sigmoid")
#: how the experts are computed: None = auto (see `RoutedMoE.expert_backend`)
EXPERT_BACKENDS = (None, "loop", "grouped")


def load_balancing_loss(probs: torch.Tensor, top_idx: torch.Tensor, num_experts: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """`E · Σ_e f_e P_e` from router probabilities `[N, E]` and chosen experts `[N, k]`; `mask` `[N]`
    (1 = real token) leaves pads out. Returns a scalar in probs' dtype."""
    chosen = torch.zeros_like(probs).scatter_(1, top_idx, 1.0)  # [N, E]: 1 where e is among the top k
    if mask is None:
        weights = probs.new_ones(probs.shape[0])
    else:  # pads selected out, not multiplied by 0 (which keeps a NaN)
        real = mask.reshape(-1).bool()[:, None]
        probs = probs.masked_fill(~real, 0)
        chosen = chosen.masked_fill(~real, 0)
        weights = real[:, 0].to(probs.dtype)
    count = weights.sum().clamp_min(1.0)
    fraction = chosen.sum(0) / (count * top_idx.shape[1])
    mean_prob = probs.sum(0) / count
    return num_experts * (fraction * mean_prob).sum()


# ============================================================================ grouped GEMM
def _grouped_mm_function():
    """`torch.nn.functional.grouped_mm` (torch >= 2.10) or `torch._grouped_mm`, or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the auto choice may run the experts as grouped GEMMs on `device` in `dtype`: bfloat16 on a CUDA
    device of compute capability 9.x (Hopper, where `torch._grouped_mm` first ran), or 8.0 and up where torch has
    `torch.nn.functional.grouped_mm`. Everything else runs the sorted per-expert loop."""
    if device.type != "cuda" or dtype != torch.bfloat16 or _grouped_mm_function() is None:
        return False
    capability = torch.cuda.get_device_capability(device)
    return capability[0] == 9 or (capability >= (8, 0) and hasattr(F, "grouped_mm"))


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows `offsets[e-1]:offsets[e]` of `x` `[S, in]` times `weight[e]ᵀ` (`weight` `[E, out, in]`): `[S, out]`."""
    return _grouped_mm_function()(x, weight.transpose(-2, -1), offs=offsets)


# ============================================================================ the experts
_LEGACY_EXPERT = re.compile(r"^(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_LEGACY_EXPERT_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?experts\.)(?P<e>\d+)\.(?:gate_proj|up_proj|down_proj)\.weight$")


def stack_legacy_experts(state_dict: dict, prefix: str = "") -> dict:
    """`state_dict` with the experts of the first RoutedMoE layout (one GatedMLP per expert:
    `<p>experts.{e}.gate_proj.weight` [I, D], `...up_proj.weight` [I, D], `...down_proj.weight` [D, I]) stacked into
    the current one (`<p>experts.gate_up_proj` [E, 2I, D], `<p>experts.down_proj` [E, D, I]), for every MoE under
    `prefix`. A new dict; other entries (and an incomplete set of experts, left for the loader to report) unchanged."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key in state_dict:
        match = _LEGACY_EXPERT_KEY.match(key) if key.startswith(prefix) else None
        if match:
            groups.setdefault(match["prefix"], {})
    if not groups:
        return state_dict
    out = dict(state_dict)
    for group in groups:
        experts: dict[int, dict[str, torch.Tensor]] = {}
        for key in state_dict:
            if key.startswith(group):
                match = _LEGACY_EXPERT.match(key[len(group):])
                if match:
                    experts.setdefault(int(match["e"]), {})[match["proj"]] = state_dict[key]
        complete = sorted(experts) == list(range(len(experts))) and all(len(p) == 3 for p in experts.values())
        if not complete:
            continue
        for e in experts:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                del out[f"{group}{e}.{proj}.weight"]
        ordered = [experts[e] for e in range(len(experts))]
        out[group + "gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"], p["up_proj"]], 0) for p in ordered])
        out[group + "down_proj"] = torch.stack([p["down_proj"] for p in ordered])
    return out


def has_legacy_experts(keys) -> bool:
    """Whether state-dict `keys` hold experts in the first RoutedMoE layout (`...experts.{e}.gate_proj.weight`)."""
    return any(_LEGACY_EXPERT_KEY.match(key) for key in keys)


class MoEExperts(nn.Module):
    """E SwiGLU experts, stored stacked: `gate_up_proj` `[E, 2I, D]` (gate rows first, then up), `down_proj`
    `[E, D, I]` (transformers' layout); with `gated=False`, E plain MLPs `down(act(up(x)))`: `up_proj` `[E, I, D]` in
    place of `gate_up_proj`. `act` is the activation (transformers' names, `lazoo.layers.mlp.ACTIVATIONS`).
    `forward(x, top_idx, top_weights)` returns `Σ_k top_weights[n, k] · f_{top_idx[n, k]}(x[n])` `[N, D]`; PEFT's
    `target_parameters` LoRA applies during this forward."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, gated: bool = True,
                 act: str = "silu"):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gated, self.act = gated, act
        self.act_fn = activation(act)
        rows = 2 * intermediate_size if gated else intermediate_size
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, rows, hidden_size))
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, rows, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.reset_parameters()
        self._register_load_state_dict_pre_hook(self._stack_legacy_state)

    @property
    def in_proj(self) -> nn.Parameter:
        """The stacked input projections: `gate_up_proj` (gated) or `up_proj`."""
        return self.gate_up_proj if self.gated else self.up_proj

    def reset_parameters(self) -> None:
        """nn.Linear's default init, expert by expert (uniform in ±1/sqrt(fan_in))."""
        with torch.no_grad():
            self.in_proj.uniform_(-1 / math.sqrt(self.hidden_size), 1 / math.sqrt(self.hidden_size))
            bound = 1 / math.sqrt(max(self.intermediate_size, 1))
            self.down_proj.uniform_(-bound, bound)

    def _init_lazoo_parameters(self, init, std: float) -> None:
        """The model's init (`LazooPreTrainedModel._init_weights`): normal(0, std), as nn.Linear experts got; `init`
        is transformers' guarded `initialization` module (a loaded weight is left as it is)."""
        init.normal_(self.in_proj, mean=0.0, std=std)
        init.normal_(self.down_proj, mean=0.0, std=std)

    @staticmethod
    def _stack_legacy_state(state_dict, prefix, *args) -> None:
        """`load_state_dict` of a state dict with one GatedMLP per expert (the first layout): stacked in place."""
        if any(_LEGACY_EXPERT.match(key[len(prefix):]) for key in state_dict if key.startswith(prefix)):
            converted = stack_legacy_experts({k: v for k, v in state_dict.items() if k.startswith(prefix)}, prefix)
            for key in [k for k in state_dict if k.startswith(prefix)]:
                del state_dict[key]
            state_dict.update(converted)

    def extra_repr(self) -> str:
        form = "" if self.gated and self.act == "silu" else f", gated={self.gated}, act={self.act!r}"
        return f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, " \
               f"intermediate_size={self.intermediate_size}" + form

    def _hidden(self, projected: torch.Tensor) -> torch.Tensor:
        """The experts' inner activations from their input projections: `act(gate) · up`, or `act(up)`."""
        if not self.gated:
            return self.act_fn(projected)
        gate, up = projected.chunk(2, dim=-1)
        return silu_mul(gate, up) if self.act == "silu" else self.act_fn(gate) * up

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e` alone on rows `x` `[n, D]`: `down(act(gate(x)) · up(x))`, or `down(act(up(x)))`."""
        return F.linear(self._hidden(F.linear(x, self.in_proj[e])), self.down_proj[e])

    def __getitem__(self, e: int):
        """Expert `e` as a function of its input rows (the first layout's `experts[e](x)`)."""
        if not -self.num_experts <= e < self.num_experts:
            raise IndexError(f"expert index {e} out of range for {self.num_experts} experts")
        return functools.partial(self.expert_forward, e % self.num_experts)

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_weights: torch.Tensor,
                backend: str | None = None) -> torch.Tensor:
        """`x` `[N, D]`, `top_idx` `[N, k]` expert ids, `top_weights` `[N, k]` (cast to the experts' output dtype
        before they scale it); `backend` "loop", "grouped" or None (auto)."""
        if backend is None:
            backend = "grouped" if grouped_mm_supported(x.device, self._compute_dtype(x)) \
                and self.hidden_size % 8 == 0 and self.intermediate_size % 8 == 0 else "loop"
        if backend == "grouped":
            return self._grouped(x, top_idx, top_weights)
        if backend == "loop":
            return self._loop(x, top_idx, top_weights)
        raise ValueError(f"MoE expert backend must be one of {EXPERT_BACKENDS}, got {backend!r}")

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return self.in_proj.dtype

    def _loop(self, x, top_idx, top_weights):
        """Each expert on its rows, the (token, slot) pairs sorted by expert once (a stable sort: each expert sees
        its tokens in order, as in a loop over `(top_idx == e).nonzero()`); one host sync for the group sizes."""
        N, k = top_idx.shape
        flat_idx = top_idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=self.num_experts).tolist()
        flat_weights = top_weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            start += count
            token = pairs // k
            y = self.expert_forward(e, x[token])
            y = y * flat_weights[pairs, None].to(y.dtype)
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def _grouped(self, x, top_idx, top_weights):
        """All experts in two grouped GEMMs over the (token, slot) pairs sorted by expert; no host sync. The k
        outputs of a token are summed in a fixed order (deterministic, unlike an atomic index_add on CUDA)."""
        if _grouped_mm_function() is None:
            raise ValueError("MoE expert backend 'grouped' needs torch.nn.functional.grouped_mm or "
                             f"torch._grouped_mm, which torch {torch.__version__} lacks: use backend 'loop'")
        dtype = self._compute_dtype(x)
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"MoE expert backend 'grouped' computes in bfloat16, float16 or float32 (the dtypes "
                             f"grouped_mm takes), got {dtype}: use backend 'loop'")
        N, k = top_idx.shape
        flat_idx = top_idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        sorted_idx = flat_idx[order]
        experts = torch.arange(self.num_experts, device=x.device, dtype=sorted_idx.dtype)
        offsets = torch.searchsorted(sorted_idx, experts, right=True).to(torch.int32)  # end of each expert's rows
        rows = x[order // k].to(dtype)
        hidden = self._hidden(_grouped_linear(rows, self.in_proj.to(dtype), offsets))
        y = _grouped_linear(hidden, self.down_proj.to(dtype), offsets)
        y = y * top_weights.reshape(-1)[order, None].to(y.dtype)
        y = torch.zeros_like(y).index_copy(0, order, y)  # back to (token, slot) order
        return y.view(N, k, -1).sum(1).to(x.dtype)


# ============================================================================ routing options
def check_routing(num_experts, top_k, score="softmax", score_correction_bias=False, num_groups=1, top_k_groups=None,
                  routed_scaling_factor=1.0, shared_gate=True, prefix="", names=None) -> None:
    """Clear errors for the routing options (module docstring); `names` maps each option to the name an error gives
    it (the config's field names), `prefix` starts every message."""
    names = names or {}

    def name(option: str) -> str:
        return names.get(option, option)

    def is_count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if score not in ROUTER_SCORES:
        raise ValueError(f"{prefix}{name('score')} must be one of {ROUTER_SCORES}, got {score!r}")
    if not isinstance(score_correction_bias, bool):
        raise ValueError(f"{prefix}{name('score_correction_bias')} must be True or False, got "
                         f"{score_correction_bias!r}")
    if not isinstance(shared_gate, bool):
        raise ValueError(f"{prefix}{name('shared_gate')} must be True or False, got {shared_gate!r}")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)) \
            or not 0 < routed_scaling_factor < math.inf:
        raise ValueError(f"{prefix}{name('routed_scaling_factor')} must be a finite number > 0, got "
                         f"{routed_scaling_factor!r}")
    if not is_count(num_groups) or num_experts % num_groups:
        raise ValueError(f"{prefix}{name('num_groups')} must be an int >= 1 dividing the {num_experts} experts, got "
                         f"{num_groups!r}")
    if top_k_groups is not None and (not is_count(top_k_groups) or top_k_groups > num_groups):
        raise ValueError(f"{prefix}{name('top_k_groups')} must be None (every group) or an int in [1, "
                         f"{name('num_groups')}={num_groups}], got {top_k_groups!r}")
    chosen_groups = num_groups if top_k_groups is None else top_k_groups
    if chosen_groups < num_groups:
        per_group = num_experts // num_groups
        if per_group < 2:
            raise ValueError(f"{prefix}{name('num_groups')}={num_groups} leaves {per_group} expert a group; a group's "
                             "score is the sum of its two best scores, so each needs at least 2")
        if top_k > chosen_groups * per_group:
            raise ValueError(f"{prefix}{name('top_k')}={top_k} is more than the {chosen_groups * per_group} experts "
                             f"of the {name('top_k_groups')}={chosen_groups} groups it may choose from")


# ============================================================================ the block
class RoutedMoE(nn.Module):
    """Router + E routed experts (+ an optional shared expert, gated by a sigmoid or not); see the module
    docstring.

    `norm_top_k`: None renormalises the top-k scores when k > 1 (the original rule), True always, False never.
    `shared_intermediate_size`: the shared expert's width (None / 0: none); `shared_gate`: whether a learned sigmoid
    gate scales it. `score` ("softmax" or "sigmoid"), `score_correction_bias`, `num_groups` / `top_k_groups` and
    `routed_scaling_factor`: Kimi Linear's routing (module docstring). `backend`: the experts' computation ("loop",
    "grouped", None = auto), also settable later as the attribute `expert_backend`. `gated` / `act`: SwiGLU-style
    experts (and shared expert) or plain MLPs, and their activation; `latent_size`: the routed experts' latent width
    (None: they read the token itself), as in Nemotron-H (module docstring)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int = 2,
                 bias: str | None = "eq14", norm_top_k: bool | None = None,
                 shared_intermediate_size: int | None = None, backend: str | None = None, *,
                 score: str = "softmax", score_correction_bias: bool = False, num_groups: int = 1,
                 top_k_groups: int | None = None, routed_scaling_factor: float = 1.0, shared_gate: bool = True,
                 gated: bool = True, act: str = "silu", latent_size: int | None = None):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"RoutedMoE: num_experts must be >= 1, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"RoutedMoE: top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if bias not in BIAS_MODES:
            raise ValueError(f"RoutedMoE: bias must be one of {BIAS_MODES}, got {bias!r}")
        if norm_top_k not in (None, True, False):
            raise ValueError(f"RoutedMoE: norm_top_k must be None (renormalise when top_k > 1), True or False, "
                             f"got {norm_top_k!r}")
        if backend not in EXPERT_BACKENDS:
            raise ValueError(f"RoutedMoE: backend must be one of {EXPERT_BACKENDS}, got {backend!r}")
        check_routing(num_experts, top_k, score, score_correction_bias, num_groups, top_k_groups,
                      routed_scaling_factor, shared_gate, prefix="RoutedMoE: ")
        if latent_size is not None and (not isinstance(latent_size, int) or isinstance(latent_size, bool)
                                        or latent_size < 1):
            raise ValueError(f"RoutedMoE: latent_size must be None or a positive int, got {latent_size!r}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.bias = bias
        self.norm_top_k = norm_top_k
        self.score = score
        self.num_groups = num_groups
        self.top_k_groups = num_groups if top_k_groups is None else top_k_groups
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.expert_backend = backend
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.latent_size = latent_size
        if latent_size is not None:  # the routed experts' own space (the router and shared expert read x itself)
            self.latent_in_proj = nn.Linear(hidden_size, latent_size, bias=False)
            self.latent_out_proj = nn.Linear(latent_size, hidden_size, bias=False)
        self.experts = MoEExperts(num_experts, latent_size or hidden_size, intermediate_size, gated=gated, act=act)
        if score_correction_bias:  # persistent: saved and loaded with the weights, never trained by gradient
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None
        self.shared_expert = make_mlp(hidden_size, shared_intermediate_size, gated, act) \
            if shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if self.shared_expert is not None \
            and shared_gate else None
        self.aux_loss: torch.Tensor | None = None

    def extra_repr(self) -> str:
        routing = [f"top_k={self.top_k}", f"score={self.score!r}"]
        if self.num_groups > 1:
            routing.append(f"groups={self.top_k_groups}/{self.num_groups}")
        if self.routed_scaling_factor != 1.0:
            routing.append(f"routed_scaling_factor={self.routed_scaling_factor}")
        if self.latent_size is not None:
            routing.append(f"latent_size={self.latent_size}")
        return ", ".join(routing)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities `[N, E]` (float32 at least; with sigmoid scores, the scores normalised to sum 1, for
        the balance loss), the top-k weights `[N, k]` (renormalised as `norm_top_k` says and scaled by
        `routed_scaling_factor`, in the probabilities' dtype) and the top-k expert ids `[N, k]`."""
        logits = self.router(flat)
        # routed in float32 at least (float64 stays float64)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()  # [N, E]
        choice = scores if self.e_score_correction_bias is None \
            else scores + self.e_score_correction_bias.to(scores.dtype)
        if self.top_k_groups < self.num_groups:  # group-limited: the experts of the best groups only
            groups = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
            group_scores = groups.topk(2, dim=-1).values.sum(-1)  # [N, G]: each group's two best choice scores
            best = group_scores.topk(self.top_k_groups, dim=-1).indices
            allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = groups.masked_fill(~allowed[..., None], float("-inf")).view(-1, self.num_experts)
        top_idx = choice.topk(self.top_k, dim=-1).indices
        top_p = scores.gather(1, top_idx)
        if self.norm_top_k if self.norm_top_k is not None else self.top_k > 1:
            total = top_p.sum(-1, keepdim=True)
            top_p = top_p / (total if self.score == "softmax" else total + 1e-20)
        if self.routed_scaling_factor != 1.0:
            top_p = top_p * self.routed_scaling_factor
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return probs, top_p, top_idx

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, top_p, top_idx = self.route(flat)
        routed_in = flat if self.latent_size is None else self.latent_in_proj(flat)
        out = self.experts(routed_in, top_idx, top_p.to(x.dtype), backend=self.expert_backend)
        if self.latent_size is not None:
            out = self.latent_out_proj(out)
        if self.bias is not None:  # each chosen expert's label vector w_e (eqs 14/15)
            b = self.router.weight[top_idx].to(out.dtype)  # [N, k, D]
            if self.bias == "eq15":
                b = top_p[..., None].to(out.dtype) * b
            out = out + b.sum(1)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        self.aux_loss = load_balancing_loss(probs, top_idx, self.num_experts, mask)
        return out.view(shape)
