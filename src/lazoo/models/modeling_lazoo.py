"""GPT-style causal language models whose token mixers come from `config.layer_types`, and sequence
classifiers on the same stack (`...ForSequenceClassification`; ELA also as a bidirectional encoder)."""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.utils import can_return_tuple, logging

try:  # guarded init functions: never overwrite weights that were loaded
    from transformers import initialization as hf_init
except ImportError:  # pragma: no cover - older transformers
    hf_init = nn.init

from ..layers.memory_lobe import MemoryLobe
from ..layers.mixers import TokenMixer, mixer_class
from ..layers.mlp import make_mlp
from ..layers.moe import MoEExperts, RoutedMoE
from ..layers.norms import ZeroCenteredRMSNorm, rms_norm
from ..ops.backend import host_sync_allowed
from ..ops.packing import cu_seqlens_from_position_ids
from ..registry import Mechanism, mechanisms, on_register
from ..registry import get as get_mechanism
from . import graph_decode
from .cache import LazooCache
from .compat import CACHE_FIELD, CacheAliases, cache_argument, output_cache_kwargs
from .configuration_lazoo import MECHANISM_CONFIGS, LazooConfig, has_feed_forward, mixer_names, refuse_taken_name
from .legacy_moe import stacked_experts_folder
from .stop_check import deferred_stop_for_lazoo_caches

logger = logging.get_logger(__name__)


@dataclass
class LazooModelOutputWithPast(CacheAliases, BaseModelOutputWithPast):
    """`BaseModelOutputWithPast` plus `aux_loss`: the MoE load-balancing loss (mean over layers; None
    without MoE). The cache reads as `.cache` and `.past_key_values` on every supported transformers."""

    aux_loss: torch.FloatTensor | None = None


@dataclass
class LazooCausalLMOutputWithPast(CacheAliases, CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus `aux_loss` (the MoE load-balancing loss; `loss` already includes
    `config.router_aux_loss_coef * aux_loss`, as in transformers' MoE models). The cache reads as `.cache`
    and `.past_key_values` on every supported transformers."""

    aux_loss: torch.FloatTensor | None = None


def _feed_forward(config: LazooConfig, layer_idx: int | None = None) -> nn.Module:
    """A gated MLP, or the routed MoE of the ELA paper (eqs. 14/15) when `config.moe_num_experts > 0` and the layer
    is one of `config.moe_layers` (None: every layer); with `moe_shared_expert_intermediate_size`, plus the gated
    shared expert of Qwen3-Next / Qwen3.5-MoE (ungated with `moe_shared_expert_gate=False`); Kimi Linear's routing
    from the `moe_router_score`, `moe_score_correction_bias`, `moe_num_groups`, `moe_top_k_groups` and
    `moe_routed_scaling_factor` fields. The MLP, the experts and the shared expert are gated or plain
    (`mlp_gated`), with the activation `mlp_activation`; `moe_latent_size` gives the experts a latent space."""
    experts = getattr(config, "moe_num_experts", 0)
    moe_layers = getattr(config, "moe_layers", None)
    gated, act = getattr(config, "mlp_gated", True), getattr(config, "mlp_activation", "silu")
    if not experts or (moe_layers is not None and layer_idx not in moe_layers):
        return make_mlp(config.hidden_size, config.intermediate_size, gated, act)
    size = config.moe_intermediate_size or config.intermediate_size
    return RoutedMoE(config.hidden_size, size, experts, config.moe_top_k, config.moe_bias,
                     norm_top_k=getattr(config, "moe_norm_top_k", None),
                     shared_intermediate_size=getattr(config, "moe_shared_expert_intermediate_size", None),
                     score=getattr(config, "moe_router_score", "softmax"),
                     score_correction_bias=getattr(config, "moe_score_correction_bias", False),
                     num_groups=getattr(config, "moe_num_groups", 1),
                     top_k_groups=getattr(config, "moe_top_k_groups", None),
                     routed_scaling_factor=getattr(config, "moe_routed_scaling_factor", 1.0),
                     shared_gate=getattr(config, "moe_shared_expert_gate", True), gated=gated, act=act,
                     latent_size=getattr(config, "moe_latent_size", None))


def decoder_norm(config: LazooConfig) -> nn.Module:
    """One of the decoder's RMSNorms (zero-centred where the config says so)."""
    return rms_norm(config.hidden_size, config.rms_norm_eps, getattr(config, "zero_centered_norm", False))


class LazooDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: `h = x + mixer(norm(x))`, `out = h + mlp(norm(h))`; with `config.residual_multiplier` m (Granite)
    each branch is scaled before it is added: `h = x + m·mixer(norm(x))`, `out = h + m·mlp(norm(h))`.

    A layer may lack either part: with no token mixer (its `layer_types` entry None) `h = x` (no `input_norm`, no
    `mixer`); with no feed-forward (not in `config.mlp_layers`) `out = h` (no `post_mixer_norm`, no `mlp`).

    ELA-GPT options (the ELA paper, §V; any mechanism): `hyper_link` drops the mixer's residual and its norm,
    `f = mlp(mixer(norm(x)))`, `out = x + f` (with `hyper_link_ffn_input="stream"` the feed-forward reads the
    normalised stream instead, `f = mlp(norm2(x + mixer(norm(x))))`); `memory_lobe` adds linear attention over
    the layer's flow `ΔX` (f with Hyper-Link, `mixer + mlp` otherwise): `out = x + ΔX + lobe(ΔX)`; the MLP may be a
    routed MoE (`moe_num_experts`), whose load-balancing loss is left in `mlp.aux_loss`."""

    def __init__(self, config: LazooConfig, layer_idx: int):
        super().__init__()
        name = config.layer_types[layer_idx]
        self.hyper_link = bool(getattr(config, "hyper_link", False))
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))
        self.input_norm = self.mixer = self.post_mixer_norm = self.mlp = None
        if name is not None:
            self.input_norm = decoder_norm(config)
            self.mixer = mixer_class(name)(config, layer_idx, config.mixer_options(name))
        if has_feed_forward(config, layer_idx):
            if not self.hyper_link or getattr(config, "hyper_link_ffn_input", "mixer") == "stream":
                self.post_mixer_norm = decoder_norm(config)
            self.mlp = _feed_forward(config, layer_idx)
        lobe = getattr(config, "memory_lobe", None)
        self.memory_lobe = None if lobe is None else MemoryLobe(
            config.hidden_size, config.num_attention_heads, layer_idx, mode=lobe,
            feature_map=config.memory_lobe_feature_map)

    def forward(self, hidden_states, mask=None, position_ids=None, cache=None, cu_seqlens=None,
                output_attentions=False, **kwargs):
        """The layer's output; with `output_attentions=True`, `(output, weights)`: the mixer's attention weights
        `[B, H, T, S]`, or None for a mixer that has none (`TokenMixer.has_attention_weights`)."""
        hidden_states = zero_pads(hidden_states, mask)
        weights = None
        if self.mixer is None:  # a layer of its feed-forward alone
            f = self._feed_forward(hidden_states, mask)
            out = hidden_states + self._scaled(f)
            if self.memory_lobe is not None:
                out = out + self.memory_lobe(f, mask=mask, cache=cache, cu_seqlens=cu_seqlens)
            return (out, weights) if output_attentions else out
        x = self.input_norm(hidden_states)
        if output_attentions and self.mixer.has_attention_weights:
            extra = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
            mixed, weights = self.mixer(x, mask=mask, position_ids=position_ids, cache=cache, output_attentions=True,
                                        **extra)
        elif cu_seqlens is None:
            mixed = self.mixer(x, mask=mask, position_ids=position_ids, cache=cache)
        else:  # packed sequences: the mixer keeps them apart (natively or one sequence at a time)
            mixed = self.mixer.forward_packed(x, position_ids=position_ids, cu_seqlens=cu_seqlens)
        moe = isinstance(self.mlp, RoutedMoE)
        if self.hyper_link:  # the whole layer is one transformation: no residual around the mixer
            # the feed-forward reads the mixer's output, or (a post-mixer norm made for it) the normalised stream
            ffn_in = mixed if self.post_mixer_norm is None else self.post_mixer_norm(hidden_states + mixed)
            flow = self.mlp(ffn_in, mask) if moe else self.mlp(ffn_in)
            out = hidden_states + self._scaled(flow)
        else:
            h = hidden_states + self._scaled(mixed)
            f = 0 if self.mlp is None else self._feed_forward(h, mask)
            out = h + self._scaled(f)
            flow = mixed + f if self.memory_lobe is not None else None
        if self.memory_lobe is not None:
            out = out + self.memory_lobe(flow, mask=mask, cache=cache, cu_seqlens=cu_seqlens)
        return (out, weights) if output_attentions else out

    def _feed_forward(self, h, mask):
        """`mlp(norm(h))` (a routed MoE also takes the mask, to leave pads out of its balance loss)."""
        normed = self.post_mixer_norm(h)
        return self.mlp(normed, mask) if isinstance(self.mlp, RoutedMoE) else self.mlp(normed)

    def _scaled(self, branch):
        """A residual branch times `residual_multiplier` (as it is where that is 1)."""
        return branch if self.residual_multiplier == 1 else branch * self.residual_multiplier

    @property
    def aux_loss(self):
        """The MoE load-balancing loss of the last forward (None without MoE)."""
        return getattr(self.mlp, "aux_loss", None)


class LazooPreTrainedModel(PreTrainedModel):
    config_class = LazooConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LazooDecoderLayer"]
    _supports_sdpa = True
    _is_stateful = True  # recurrent states cannot be rolled back (no assisted decoding)
    # a forward, and a decode step on the static cache, trace without graph breaks (tests/models/test_compile.py,
    # test_static_cache.py)
    _can_compile_fullgraph = True
    # False: the layers do not run through transformers' attention-function and mask interface (they build their
    # own masks from the 2-D attention mask), and there is no tensor-parallel plan
    _supports_attention_backend = False

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, TokenMixer):
            module._init_lazoo_parameters(hf_init)
        elif isinstance(module, MoEExperts):  # stacked experts: normal(0, initializer_range), as nn.Linear ones
            module._init_lazoo_parameters(hf_init, self.config.initializer_range)
        elif isinstance(module, RoutedMoE) and module.e_score_correction_bias is not None:
            hf_init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, ZeroCenteredRMSNorm):
            module.reset_parameters(hf_init)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model creates its own LazooCache

    @classmethod
    def from_pretrained(cls, *args, allow_layer_mismatch: bool = False, **kwargs):
        """`PreTrainedModel.from_pretrained`, refusing a folder whose decoder-layer weights do not fit the model its
        config builds: a weight with no place in the model, or a layer weight the folder lacks, means config.json no
        longer describes the weights (an edited `lazoo_format` or `model_type` reads the layers' options
        differently), and the model would compute other numbers. `allow_layer_mismatch=True` loads it anyway
        (unmatched weights dropped, missing ones newly initialised, as transformers does). Heads may differ as
        usual: a causal LM's folder loads into a sequence classifier with a new `score`. A folder saved when the
        routed MoE held one module per expert loads with its experts stacked (`lazoo.models.legacy_moe`)."""
        want_info = kwargs.pop("output_loading_info", False)
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        with stacked_experts_folder(source, kwargs) as stacked:
            if stacked is not None:  # read from a stacked copy, as a local folder
                args = (stacked, *args[1:]) if args else args
                kwargs = {k: v for k, v in kwargs.items() if k not in ("subfolder", "revision")}
                if not args:
                    kwargs["pretrained_model_name_or_path"] = stacked
            model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if stacked is not None:
            model.name_or_path = model.config._name_or_path = os.fspath(source)
        if not allow_layer_mismatch:
            check_layer_weights(info, source, model)
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`; the config's save adds the `trust_remote_code` export
        (`auto_map` and a flat copy of the model code, see `lazoo.models.export`), and a model card is
        written as README.md unless the folder already has one (`lazoo.models.card`)."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        is_main_process = kwargs.get("is_main_process", args[0] if args else True)
        if is_main_process and not os.path.exists(os.path.join(save_directory, "README.md")):
            try:
                from .card import write_model_card
            except ImportError:  # the exported copy (trust_remote_code) has no card writer
                return result
            write_model_card(self, save_directory)
        return result

    def _upload_modified_files(self, working_dir, *args, **kwargs):
        """`push_to_hub` saves into `working_dir`, then overwrites README.md with the Hub repo's card, or,
        for a new repo, with transformers' generic template: in that case lazoo's card goes back in."""
        readme = os.path.join(working_dir, "README.md")
        generic = "This is the model card of a 🤗 transformers model that has been pushed on the Hub"
        if os.path.exists(readme) and generic in open(readme, encoding="utf-8").read():
            try:
                from .card import write_model_card
            except ImportError:  # the exported copy (trust_remote_code) has no card writer
                pass
            else:
                write_model_card(self, working_dir)
        return super()._upload_modified_files(working_dir, *args, **kwargs)


_LAYER_WEIGHT = re.compile(r"(^|\.)layers\.\d+\.")


def check_layer_weights(loading_info: dict, source, model: nn.Module | None = None) -> None:
    """Refuse a load whose decoder-layer weights and config disagree (see `LazooPreTrainedModel.from_pretrained`). A
    folder holding none of the model's layer weights (and no other layer weights) is no such disagreement: every
    weight is newly initialised, as transformers does, and its loading report says so."""
    extra = sorted(k for k in loading_info.get("unexpected_keys", ()) if _LAYER_WEIGHT.search(k))
    missing = sorted(k for k in loading_info.get("missing_keys", ()) if _LAYER_WEIGHT.search(k))
    if not extra and not missing:
        return
    if model is not None and not extra and set(missing) == {k for k in model.state_dict() if _LAYER_WEIGHT.search(k)}:
        return
    found = []
    if extra:
        found.append(f"{len(extra)} weight(s) the model built from config.json has no place for ({extra[0]}, ...)")
    if missing:
        found.append(f"no weight for {len(missing)} of its parameters ({missing[0]}, ...)")
    raise ValueError(f"{source}: the weights do not match config.json: {' and '.join(found)}. The config no longer "
                     "describes these weights (an edited lazoo_format, model_type or layer option changes the layers); "
                     "restore it, or pass allow_layer_mismatch=True to load anyway")


def zero_pads(hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`hidden_states` `[B, T, hidden]` with the rows of pads (`mask` `[B, T]` bool, False = pad) set to 0.

    Every layer's input passes through this: a pad's value then reaches nothing, not even a weight's gradient
    (a NaN or inf at a pad, times the zero gradient a real token sends back there, would be NaN), and the real
    tokens' outputs and gradients are the same bits whatever the pads held."""
    if mask is None:
        return hidden_states
    return hidden_states.masked_fill(~mask[..., None], 0)


def check_attention_mask(attention_mask, check_values: bool = True) -> torch.Tensor | None:
    """The 2-D `attention_mask` as bool (True = real token), after refusing anything that is not one: a mask
    holds 0 and 1 only (or True / False), since a 2, 0.5 or -1 is no kind of token. The values cost one host
    sync, skipped under torch.compile and CUDA-graph capture, and with `check_values=False` (a mask `generate`
    made)."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.is_complex():
        raise ValueError(f"attention_mask must be a 2-D tensor of 0 and 1 (1 = real token), got "
                         f"{_describe(attention_mask)}")
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D [batch, sequence] with 1 for real tokens, got shape "
                         f"{tuple(attention_mask.shape)}")
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if check_values and host_sync_allowed():
        bad = (attention_mask != 0) & (attention_mask != 1)  # NaN too
        if bool(bad.any()):
            raise ValueError(f"attention_mask must hold only 0 (pad) and 1 (real token), got "
                             f"{attention_mask[bad][0].item()!r} ({int(bad.sum())} such value(s))")
    return attention_mask != 0


def check_model_inputs(input_ids, inputs_embeds, vocab_size: int, hidden_size: int, check_values: bool = True) -> None:
    """Clear errors for the model's token inputs: exactly one of `input_ids` (integer ids in
    [0, vocab_size), `[batch, sequence]`) and `inputs_embeds` (`[batch, sequence, hidden_size]`), with at
    least one sample and one position (an empty batch or sequence has nothing to compute: a ValueError,
    for both kinds of input alike). The id range costs one host sync; it is skipped under torch.compile and
    CUDA-graph capture, and with `check_values=False` (ids `generate` sampled)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype.is_floating_point or input_ids.is_complex() \
                or input_ids.dtype == torch.bool or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a 2-D integer tensor [batch, sequence], got "
                             f"{_describe(input_ids)}")
        _check_not_empty("input_ids", input_ids.shape)
        if not (check_values and host_sync_allowed()):  # one host sync: skipped when compiled or captured
            return
        bad = (input_ids < 0) | (input_ids >= vocab_size)
        if bool(bad.any()):
            value = int(input_ids[bad][0])
            raise ValueError(f"input_ids must be token ids in [0, vocab_size={vocab_size}), got {value} "
                             f"({int(bad.sum())} id(s) out of range)")
    else:
        if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3 \
                or inputs_embeds.shape[-1] != hidden_size:
            raise ValueError(f"inputs_embeds must be a 3-D tensor [batch, sequence, hidden_size={hidden_size}], "
                             f"got {_describe(inputs_embeds)}")
        _check_not_empty("inputs_embeds", inputs_embeds.shape)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _check_not_empty(name: str, shape) -> None:
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(shape)}): batch size and sequence length must both be >= 1")


def _cached_positions(cache) -> int | None:
    """The positions a cache has seen, or None where that is a device count that cannot be read here (a static
    cache while compiled or captured)."""
    if cache is None:
        return 0
    return cache.seen_positions if not cache.static or host_sync_allowed() else None


def _new_token_mask(attention_mask, batch: int, length: int, past: int | None):
    """The `[B, T]` 0/1 mask of the new tokens, from a mask over the new or over past + new positions (the last
    `T` columns when `past` is not known)."""
    if attention_mask is None:
        return None
    if past is None and attention_mask.shape[1] > length:
        attention_mask = attention_mask[:, -length:]
    elif past is not None and attention_mask.shape[1] == past + length:
        attention_mask = attention_mask[:, past:]
    elif attention_mask.shape[1] != length:
        raise ValueError(
            f"attention_mask has {attention_mask.shape[1]} positions; expected {length} (new tokens) or "
            f"{past + length} (cached + new)"
        )
    if attention_mask.shape[0] != batch:
        raise ValueError(f"attention_mask has batch {attention_mask.shape[0]}, input_ids has {batch}")
    return attention_mask


class LazooModel(LazooPreTrainedModel):
    """The decoder stack. Packed sequences (transformers' `DataCollatorWithFlattening`: one row, no attention
    mask, `position_ids` restarting at 0 at each sequence start) are detected when B = 1, nothing is cached yet
    and some `position_ids[0, t] == 0` for t > 0: the boundaries go to every layer as `cu_seqlens` and no
    sequence sees another (logits equal those of the sequences run one by one). No cache is built then."""

    def __init__(self, config: LazooConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=None)
        self.layers = nn.ModuleList(LazooDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = decoder_norm(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        output_hidden_states=None,
        past_key_values=None,
        output_attentions=None,
        _generated_step: bool = False,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """The cache may come as `cache` (transformers 5.24 and later), `past_key_values` or `cache_params`.

        Inputs: exactly one of `input_ids` (`[batch, sequence]` integer ids in [0, vocab_size)) and
        `inputs_embeds` (`[batch, sequence, hidden_size]`). An empty batch or sequence (batch size or
        sequence length 0) raises a ValueError for either input, as do ids outside the vocabulary (the
        message names the first offending id and vocab_size).

        `output_attentions=True` returns each layer's attention weights `[B, H, T, S]` (`attentions`; the explicit
        softmax of the softmax-type layers, None for layers that have no attention matrix).

        `_generated_step=True` (set by `generate` for its decode steps, whose ids and mask it made itself: ids it
        sampled, a mask column of ones) skips the value checks of the ids and the mask and the test for pads, each
        of which waits for the device."""
        cache = cache_argument(cache, past_key_values, kwargs)
        check_values = not _generated_step
        check_model_inputs(input_ids, inputs_embeds, self._vocabulary_size(), self.config.hidden_size, check_values)
        attention_mask = check_attention_mask(attention_mask, check_values)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1:  # Granite's scaled embeddings (given ones too, as transformers)
            inputs_embeds = inputs_embeds * self.config.embedding_multiplier
        if attention_mask is not None:
            attention_mask = attention_mask.to(inputs_embeds.device)
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if cache is not None and not isinstance(cache, LazooCache):
            raise TypeError(f"the cache (`cache` / `past_key_values`) must be a LazooCache or None, "
                            f"got {type(cache).__name__}")
        if cache is not None and len(cache) != self.config.num_hidden_layers:
            raise ValueError(f"the cache has {len(cache)} layers but the model has "
                             f"{self.config.num_hidden_layers}: a cache belongs to the model that filled it (start a "
                             f"new one with LazooCache({self.config.num_hidden_layers}), or pass none)")
        cu_seqlens = self._packed_boundaries(position_ids, attention_mask, cache, inputs_embeds)
        if cu_seqlens is not None:
            if cache is not None:
                raise ValueError("packed sequences (position_ids restarting at 0 in one row) cannot use a cache: "
                                 "pass cache=None (use_cache is ignored for packed inputs)")
            use_cache = False
        if use_cache and cache is None:
            cache = LazooCache(self.config.num_hidden_layers)
        cache = cache if use_cache else None
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions

        B, T = inputs_embeds.shape[:2]
        if cache is not None and cache.real_tokens is not None and cache.real_tokens.shape[0] != B:
            raise ValueError(f"the cache holds {cache.real_tokens.shape[0]} sequences but the input has {B}: a cache "
                             "keeps its batch (start a new cache, or select its rows with reorder_cache)")
        # a mask of the new tokens alone needs no count of the cached ones (for a static cache, a host read)
        wider = attention_mask is not None and attention_mask.shape[1] != T
        new_mask = _new_token_mask(attention_mask, B, T, _cached_positions(cache) if wider else 0)
        real = new_mask.long() if new_mask is not None else inputs_embeds.new_ones(B, T, dtype=torch.long)
        offset = cache.real_tokens if cache is not None and cache.real_tokens is not None else real.new_zeros(B)
        if position_ids is None:
            position_ids = (offset[:, None] + real.cumsum(1) - 1).clamp_min(0)
        # ops take mask=None as "all real", which is also their fast path; finding that out is a host sync, which
        # compiled or captured code cannot make: it passes the mask as it is
        if _generated_step:  # generate's decode step: every new token is real
            new_mask = None
        op_mask = None if new_mask is None or (host_sync_allowed() and bool(new_mask.all())) else new_mask

        hidden_states = zero_pads(inputs_embeds, op_mask)  # (each layer zeroes its input's pads again)
        all_hidden = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        aux_losses = []
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask=op_mask, position_ids=position_ids, cache=cache,
                                  cu_seqlens=cu_seqlens, **({"output_attentions": True} if output_attentions else {}))
            if output_attentions:
                hidden_states, weights = hidden_states
                all_attentions += (weights,)
            if layer.aux_loss is not None:
                aux_losses.append(layer.aux_loss)
            if output_hidden_states:
                all_hidden += (hidden_states,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden = all_hidden[:-1] + (hidden_states,)
        if cache is not None:
            cache.advance(T, real.sum(1))
        aux_loss = torch.stack([a.to(hidden_states.device) for a in aux_losses]).mean() if aux_losses else None
        return LazooModelOutputWithPast(
            last_hidden_state=hidden_states, hidden_states=all_hidden, attentions=all_attentions, aux_loss=aux_loss,
            **output_cache_kwargs(cache),
        )

    def _vocabulary_size(self) -> int:
        """The rows of the input embedding (`config.vocab_size` unless the embedding was swapped)."""
        return getattr(self.embed_tokens, "num_embeddings", self.config.vocab_size)

    @staticmethod
    def _packed_boundaries(position_ids, attention_mask, cache, inputs_embeds):
        """`cu_seqlens` `[N + 1]` of packed sequences, or None: B = 1, no padding, no cached tokens, and
        `position_ids` that restart at 0 after the first token."""
        if position_ids is None or inputs_embeds.shape[0] != 1 or position_ids.dim() != 2:
            return None
        if position_ids.shape[1] < 2 or _cached_positions(cache) != 0:
            return None  # one token, or decoding after a prompt (unknown while compiled): positions continue
        if attention_mask is not None and not bool(attention_mask.all()):
            return None  # a padded row (generate's position_ids put 1 on pads): not packing
        return cu_seqlens_from_position_ids(position_ids.to(inputs_embeds.device))


def default_cache_implementation(device: torch.device) -> str:
    """The cache `generate` takes when none is asked for: the static cache on CUDA, where `generate` compiles the
    decode step and replays it as a CUDA graph; the dynamic cache elsewhere, where a static cache is slower."""
    return "static" if device.type == "cuda" else "dynamic"


def cache_length_bucket(length: int) -> int:
    """`length` rounded up to a multiple of a quarter of its octave (at least 256): a static cache of this many
    positions serves every length in the bucket, so their `generate` calls share one compiled decode step. It
    keeps less than a quarter more positions than asked for (at most 255 more below 2048)."""
    step = 1 << max(8, length.bit_length() - 3)
    return -(-length // step) * step


class LazooForCausalLM(LazooPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LazooConfig):
        super().__init__(config)
        if getattr(config, "memory_lobe", None) == "bidirectional":
            logger.warning("memory_lobe='bidirectional' in a causal LM: every position reads the flow of later "
                           "positions, i.e. the tokens it predicts (future-token leakage; use 'causal')")
        self.model = LazooModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' cache preparation, with lazoo's cache. `cache_implementation`:

        - None (the default): `"static"` on CUDA, `"dynamic"` elsewhere (`default_cache_implementation`);
        - `"static"`: a `LazooCache(static=True)`, which `generate` compiles its decode steps against on CUDA. Its
          length is `max_length` (or `generation_config.max_cache_len` if larger) rounded up to a bucket, so prompts
          of other lengths reuse the cache and the compiled step; models whose layers keep no full-length key-value
          cache get one cache for every length;
        - `"dynamic"`: the eager path, a cache that grows (the opt-out of the static default on CUDA).

        Other cache implementations are transformers' attention caches, which lazoo layers cannot use: they are
        refused."""
        implementation = generation_config.cache_implementation
        user_cache = any(model_kwargs.get(name) is not None for name in ("cache", "past_key_values", "cache_params"))
        if user_cache or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if implementation is None:
            implementation = default_cache_implementation(self.device)
        if implementation not in ("static", "dynamic"):
            raise ValueError(f"lazoo models keep their own cache: cache_implementation may be 'static' (a cache of "
                             f"fixed shapes, for compiled decoding), 'dynamic' (eager) or None (static on CUDA, "
                             f"dynamic elsewhere), not {implementation!r}")
        if implementation == "dynamic":  # lazoo's growing cache, made by the model's first forward
            generation_config.cache_implementation = None  # generate's own copy of the config
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        # the arguments by the names of transformers' own signature, however generate passes them
        bound = inspect.signature(super()._prepare_cache_for_generation).bind(generation_config, model_kwargs, *args,
                                                                               **kwargs).arguments
        if "batch_size" not in bound or "max_cache_length" not in bound:
            raise TypeError("cache_implementation='static': this transformers version passes no batch_size and "
                            f"max_cache_length to _prepare_cache_for_generation (it passed {sorted(bound)})")
        batch_size = bound["batch_size"]
        max_length = max(bound["max_cache_length"] or 0, getattr(generation_config, "max_cache_len", None) or 0) or None
        batch_size *= max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        if max_length:  # room for the steps a graph round runs past the last token kept (lazoo.models.graph_decode)
            max_length += graph_decode.requested_steps(generation_config, self.device)
        length = cache_length_bucket(max_length) if self._keeps_every_position() and max_length else None
        model_kwargs[CACHE_FIELD] = self._static_cache(batch_size, length)

    def _prepare_generation_config(self, generation_config, *args, **kwargs):
        """transformers' preparation, taking lazoo's `decode_steps_per_graph` (`lazoo.models.graph_decode`) as a
        `generate` argument too, whether or not the model's generation config has the field."""
        steps = kwargs.pop(graph_decode.STEPS_FIELD, None)
        config, model_kwargs = super()._prepare_generation_config(generation_config, *args, **kwargs)
        if steps is not None:
            setattr(config, graph_decode.STEPS_FIELD, steps)
        return config, model_kwargs

    def _sample(self, *args, **kwargs):
        """transformers' decoding loop, its stopping check read one step late for a lazoo cache on CUDA that
        `generate` drops (`lazoo.models.stop_check`): the host queues the next step while the device runs this one.
        On CUDA (or wherever `generation_config.decode_steps_per_graph` is set above 0), greedy decoding and sampling
        run lazoo's loop of captured decode steps instead where it computes the same tokens
        (`lazoo.models.graph_decode`; `decode_steps_per_graph=0` opts out)."""
        bound = inspect.signature(super()._sample).bind(*args, **kwargs).arguments
        config = bound["generation_config"]
        if graph_decode.requested_steps(config, self.device):
            model_kwargs = bound.get("model_kwargs", {})
            asked = graph_decode.asked_for(config)
            reason = graph_decode.refusal(config, bound.get("logits_processor"), bound["stopping_criteria"],
                                          bound.get("streamer"), bound.get("synced_gpus", False),
                                          model_kwargs.get(CACHE_FIELD))
            if reason is None and not asked and graph_decode.capture_failed(self):
                reason = "an earlier capture of this model's decode steps failed"
            if reason is None:
                return graph_decode.decode(self, bound["input_ids"], bound.get("logits_processor"),
                                           bound["stopping_criteria"], config, bound.get("synced_gpus", False),
                                           bound.get("streamer"), model_kwargs, super()._sample)
            graph_decode.say_once(reason, asked=asked)
        with deferred_stop_for_lazoo_caches():
            return super()._sample(*args, **kwargs)

    def _keeps_every_position(self) -> bool:
        """Whether a layer keeps a key-value cache of every position (full softmax or local-linear attention):
        only then does a static cache's size depend on the length generated."""
        return any(module.keeps_every_position() for module in self.modules() if isinstance(module, TokenMixer))

    def _static_cache(self, batch_size: int, max_cache_len: int | None) -> LazooCache:
        """The static cache of the last `generate` of this batch size, length, dtype and device, reset (its buffers,
        and so the compiled decode step captured on them, are reused: as transformers does with its StaticCache),
        else a new one."""
        key = (batch_size, max_cache_len, self.dtype, self.device)
        cache = getattr(self, "_lazoo_static_cache", None)
        if cache is None or self._lazoo_static_cache_key != key:
            cache = LazooCache(self.config.num_hidden_layers, static=True, max_cache_len=max_cache_len)
            self._lazoo_static_cache, self._lazoo_static_cache_key = cache, key
        else:
            cache.reset()
        return cache

    def create_masks_for_generate(self, config=None, inputs_embeds=None, attention_mask=None, **kwargs):
        """transformers (before 5.24) turns the 2-D mask into 4-D attention masks for a compileable cache; lazoo
        layers read the 2-D mask and build their own, so it passes unchanged."""
        return attention_mask

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, **kwargs):
        """transformers' preparation, with the prompt's new positions counted from lazoo's own cache when
        `generate` continues a cache: a recurrent state must see each position exactly once, and transformers
        5.24 slices the prompt only for caches it recognises as attention caches (it would feed the cached part
        again). The positions not yet seen are those of the attention mask (or of the inputs, without one)
        beyond the cache's `seen_positions`. Later steps keep transformers' one new token."""
        cache = None
        for name in ("cache", "past_key_values", "cache_params"):
            cache = cache if cache is not None else kwargs.get(name)
        if is_first_iteration and isinstance(cache, LazooCache) and cache.seen_positions:
            if attention_mask is not None:
                total = attention_mask.shape[1]
            else:
                total = (input_ids if inputs_embeds is None else inputs_embeds).shape[1]
            fresh = total - cache.seen_positions
            if fresh < 1:
                raise ValueError(f"generate: the cache has seen {cache.seen_positions} positions but the inputs (and "
                                 f"attention mask) cover only {total}: pass the whole sequence the cache was built on "
                                 "plus at least one new token")
            next_sequence_length = fresh
        inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs)
        if not is_first_iteration and isinstance(cache, LazooCache):
            inputs["_generated_step"] = True  # ids generate sampled, a mask of ones: nothing to check on the device
        mask = inputs.get("attention_mask")
        if isinstance(cache, LazooCache) and cache.static and isinstance(mask, torch.Tensor):
            # the mask of the new tokens only: one shape at every decode step (the whole mask grows by one each step,
            # and a compiled step would be compiled again); a copy, since a slice keeps the growing mask's strides
            length = (inputs.get("input_ids") if inputs.get("input_ids") is not None else inputs["inputs_embeds"])
            inputs["attention_mask"] = mask[:, -length.shape[1]:].clone(memory_format=torch.contiguous_format)
        return inputs

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_hidden_states=None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values=None,
        output_attentions=None,
        _generated_step: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """The cache may come as `cache` (transformers 5.24 and later), `past_key_values` or `cache_params`.
        Inputs are checked as in `LazooModel.forward`: an empty batch or sequence, or ids outside
        [0, vocab_size), raise a ValueError (for `input_ids` and `inputs_embeds` alike)."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache_argument(cache, past_key_values, kwargs),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,  # read by field below, whatever config.return_dict says
            _generated_step=_generated_step,
        )
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        if self.config.logits_scaling != 1:  # Granite's logits, divided (not multiplied by the inverse)
            logits = logits / self.config.logits_scaling
        loss = None
        if labels is not None:
            # Trainer passes num_items_in_batch in kwargs: the loss is then sum / count over the whole batch
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            if outputs.aux_loss is not None:  # MoE load balancing, as in transformers' MoE models
                loss = loss + self.config.router_aux_loss_coef * outputs.aux_loss.to(loss.device)
        return LazooCausalLMOutputWithPast(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
            aux_loss=outputs.aux_loss, **output_cache_kwargs(outputs.cache),
        )


#: model_type -> (config class, base model class, causal LM class); filled from the registry (`bind_model_classes`)
MODEL_CLASSES: dict[str, tuple] = {"lazoo_hybrid": (LazooConfig, LazooModel, LazooForCausalLM)}


# ============================================================================ sequence classification
def _make_bidirectional(model: LazooModel, config: LazooConfig) -> None:
    """Switch every mixer of `model` to its mechanism's bidirectional form (`Mechanism.bidirectional_mixer`:
    same parameters, the non-causal op)."""
    forms = {name: get_mechanism(name).bidirectional_mixer for name in mixer_names(config.layer_types)}
    missing = sorted(name for name, form in forms.items() if form is None)
    if missing:
        having = sorted(n for n, m in mechanisms().items() if m.bidirectional_mixer is not None)
        raise ValueError(
            f"bidirectional=True needs every layer's mechanism to have a bidirectional form ({', '.join(having)}); "
            f"layer_types also has {missing}. Use only those in layer_types, or leave bidirectional unset for a "
            "causal encoder"
        )
    for name, layer in zip(config.layer_types, model.layers):
        if name is None:  # no token mixer: nothing to turn
            continue
        causal = get_mechanism(name).mixer
        if type(layer.mixer) is not causal:  # a subclass of ours would lose its own behaviour
            raise TypeError(f"bidirectional=True: expected a {causal.__name__}, got {type(layer.mixer).__name__}")
        layer.mixer.__class__ = forms[name]


class LazooForSequenceClassification(LazooPreTrainedModel):
    """A lazoo model with a linear classification head (`score`) on a pooled hidden state.

    Pooling, as transformers' LlamaForSequenceClassification: the hidden state of the last real token
    (from `attention_mask` when given, else the last token that is not `config.pad_token_id`, else the last
    position), so left and right padding both work. With `config.bidirectional=True` (ELA layers only) the
    encoder runs ELA's bidirectional form and the head reads the mean over real tokens. `config.num_labels`
    and `config.problem_type` ("regression", "single_label_classification", "multi_label_classification",
    inferred from the labels when unset) choose the loss, as in transformers.
    """

    accepts_loss_kwargs = False  # the mean loss over the batch; Trainer must not rescale it

    def __init__(self, config: LazooConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = LazooModel(config)
        if getattr(config, "bidirectional", False):
            _make_bidirectional(self.model, config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()

    @property
    def bidirectional(self) -> bool:
        return bool(getattr(self.config, "bidirectional", False))

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`LazooPreTrainedModel.save_pretrained`, with this head added to the config's `auto_map`
        (`AutoModelForSequenceClassification`, see `lazoo.models.export.head_auto_map`)."""
        try:
            from .export import head_auto_map
        except ImportError:  # the exported copy (trust_remote_code): transformers writes its own auto_map
            head_auto_map = None
        if head_auto_map is not None:
            self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **head_auto_map(self)}
        return super().save_pretrained(save_directory, *args, **kwargs)

    def _real_tokens(self, input_ids, attention_mask, batch: int, length: int, device):
        """`[B, T]` 0/1 of the real tokens, or None when every position counts."""
        if attention_mask is not None:
            if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, length):
                raise ValueError(f"attention_mask must have shape [batch, sequence] = {(batch, length)}, "
                                 f"got {tuple(attention_mask.shape)}")
            return attention_mask.to(device=device, dtype=torch.long)
        if self.config.pad_token_id is not None and input_ids is not None:
            return (input_ids != self.config.pad_token_id).to(device=device, dtype=torch.long)
        if batch != 1:
            raise ValueError("cannot find the last real token of a batch of several sequences: pass attention_mask, "
                             "or set config.pad_token_id (and pass input_ids)")
        return None

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_hidden_states=None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,  # a classifier reads whole sequences: no recurrent state to keep
            output_hidden_states=output_hidden_states,
            return_dict=True,  # read by field below, whatever config.return_dict says
        )
        hidden = outputs.last_hidden_state
        B, T = hidden.shape[:2]
        real = self._real_tokens(input_ids, attention_mask, B, T, hidden.device)
        if self.bidirectional:  # mean over real tokens
            weights = hidden.new_ones(B, T) if real is None else real.to(hidden.dtype)
            pooled = (hidden * weights[..., None]).sum(1) / weights.sum(1, keepdim=True).clamp_min(1)
        else:  # the last real token (the rightmost one, so left and right padding both work)
            if real is None:
                last = torch.full((B,), T - 1, dtype=torch.long, device=hidden.device)
            else:
                last = (torch.arange(T, device=hidden.device) * real).argmax(-1)
            pooled = hidden[torch.arange(B, device=hidden.device), last]
        logits = self.score(pooled)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
            if outputs.aux_loss is not None:  # MoE load balancing
                loss = loss + self.config.router_aux_loss_coef * outputs.aux_loss.to(loss.device)
        return SequenceClassifierOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states)


#: model_type -> sequence classification class (registered on AutoModelForSequenceClassification); filled from
#: the registry (`bind_model_classes`)
SEQUENCE_CLASSIFICATION_CLASSES: dict[str, type] = {"lazoo_hybrid": LazooForSequenceClassification}


#: the model classes of every lazoo model type: `<class_prefix><suffix>` (a hybrid's prefix is "Lazoo")
BASES = (LazooModel, LazooForCausalLM, LazooForSequenceClassification)


def extra_bases(base: type) -> tuple[type, ...]:
    """The bases a mechanism's class names besides `base`: `GenerationMixin` for the causal LM (transformers looks
    for it among a class's direct bases to tell a model that generates)."""
    return (GenerationMixin,) if base is LazooForCausalLM else ()


def model_class_names(mechanism: Mechanism) -> list[str]:
    """`<class_prefix>Model`, `...ForCausalLM`, `...ForSequenceClassification`."""
    return [mechanism.class_prefix + base.__name__.removeprefix("Lazoo") for base in BASES]


def model_docstring(mechanism: Mechanism, base: type, config_name: str) -> str:
    return f"{base.__name__} with `{mechanism.name}` layers ({mechanism.title}); config: `{config_name}`."


def are_model_classes_of(classes: tuple, mechanism: Mechanism, config_class: type) -> bool:
    """Whether `classes` are `mechanism`'s model classes on `config_class`: names, bases and config class."""
    return ([cls.__name__ for cls in classes] == model_class_names(mechanism)
            and all(issubclass(cls, base) and cls.config_class is config_class for cls, base in zip(classes, BASES)))


def derive_model_classes(declared: Mechanism, config: type, module: str) -> tuple[type, type, type]:
    """The model classes of a mechanism registered after import, made in module `module` as the written-out classes
    of lazoo's own mechanisms are (`lazoo.models.modeling_mechanisms`): each base bound to the config class `config`."""
    made = []
    for base, name in zip(BASES, model_class_names(declared)):

        class Derived(base, *extra_bases(base)):
            config_class = config

        Derived.__name__ = Derived.__qualname__ = name
        Derived.__module__, Derived.__doc__ = module, model_docstring(declared, base, config.__name__)
        made.append(Derived)
    return tuple(made)


def bind_model_classes(module: str, written: dict[str, tuple[type, type, type]]) -> None:
    """Keep `MODEL_CLASSES` and `SEQUENCE_CLASSIFICATION_CLASSES` filled from the registry: for every mechanism
    registered so far and from now on, its classes in `written` (lazoo's own mechanisms', written out in module
    `module` by `lazoo.models.generate_classes`) where they are the mechanism's on its config class, else classes
    derived for it in `module`; an unregistered mechanism leaves the tables."""

    def bind(mechanism: Mechanism) -> None:
        config_class = MECHANISM_CONFIGS[mechanism.name]
        classes = written.get(mechanism.name)
        if classes is None or not are_model_classes_of(classes, mechanism, config_class):
            for name in model_class_names(mechanism):
                refuse_taken_name(mechanism, name, (module, __name__))
            classes = derive_model_classes(mechanism, config_class, module)
        base_cls, lm_cls, seqcls_cls = classes
        MODEL_CLASSES[mechanism.model_type] = (config_class, base_cls, lm_cls)
        SEQUENCE_CLASSIFICATION_CLASSES[mechanism.model_type] = seqcls_cls

    def forget(mechanism: Mechanism) -> None:
        MODEL_CLASSES.pop(mechanism.model_type, None)
        SEQUENCE_CLASSIFICATION_CLASSES.pop(mechanism.model_type, None)

    on_register(bind, removal=forget)


def derived_model_class(module: str, name: str) -> type:
    """The model class named `name` derived in `module` (that module's `__getattr__`: pickling and `auto_map` look
    classes up by name in their module)."""
    for classes in (*MODEL_CLASSES.values(), SEQUENCE_CLASSIFICATION_CLASSES.values()):
        for cls in classes:
            if cls.__name__ == name and cls.__module__ == module:
                return cls
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
