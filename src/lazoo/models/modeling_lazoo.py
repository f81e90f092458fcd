"""GPT-style causal language models whose token mixers come from `config.layer_types`."""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

try:  # guarded init functions: never overwrite weights that were loaded
    from transformers import initialization as hf_init
except ImportError:  # pragma: no cover - older transformers
    hf_init = nn.init

from ..layers.mixers import TokenMixer, mixer_class
from ..layers.mlp import GatedMLP
from .cache import LazooCache
from .configuration_lazoo import MECHANISM_CONFIGS, LazooConfig


class LazooDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: `h = x + mixer(norm(x))`, `out = h + mlp(norm(h))`."""

    def __init__(self, config: LazooConfig, layer_idx: int):
        super().__init__()
        name = config.layer_types[layer_idx]
        self.input_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = mixer_class(name)(config, layer_idx, config.mixer_options(name))
        self.post_mixer_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, hidden_states, mask=None, position_ids=None, past_key_values=None, **kwargs):
        h = hidden_states + self.mixer(
            self.input_norm(hidden_states), mask=mask, position_ids=position_ids, cache=past_key_values
        )
        return h + self.mlp(self.post_mixer_norm(h))


class LazooPreTrainedModel(PreTrainedModel):
    config_class = LazooConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LazooDecoderLayer"]
    _supports_sdpa = True
    _is_stateful = True  # recurrent states cannot be rolled back (no assisted decoding)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, TokenMixer):
            module._init_lazoo_parameters(hf_init)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model creates its own LazooCache

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


def _new_token_mask(attention_mask, batch: int, length: int, past: int):
    """The `[B, T]` 0/1 mask of the new tokens, from a mask over the new or over past + new positions."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be 2-D [batch, sequence] with 1 for real tokens, got shape {tuple(attention_mask.shape)}"
        )
    if attention_mask.shape[1] == past + length:
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
    def __init__(self, config: LazooConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=None)
        self.layers = nn.ModuleList(LazooDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if past_key_values is not None and not isinstance(past_key_values, LazooCache):
            raise TypeError(f"past_key_values must be a LazooCache (or None), got {type(past_key_values).__name__}")
        if use_cache and past_key_values is None:
            past_key_values = LazooCache(self.config.num_hidden_layers)
        cache = past_key_values if use_cache else None
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )

        B, T = inputs_embeds.shape[:2]
        past = cache.seen_positions if cache is not None else 0
        new_mask = _new_token_mask(attention_mask, B, T, past)
        real = new_mask.long() if new_mask is not None else inputs_embeds.new_ones(B, T, dtype=torch.long)
        offset = cache.real_tokens if cache is not None and cache.real_tokens is not None else real.new_zeros(B)
        if position_ids is None:
            position_ids = (offset[:, None] + real.cumsum(1) - 1).clamp_min(0)
        # ops take mask=None as "all real", which is also their fast path
        op_mask = None if new_mask is None or bool(new_mask.all()) else new_mask.bool()

        hidden_states = inputs_embeds
        all_hidden = (hidden_states,) if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask=op_mask, position_ids=position_ids, past_key_values=cache)
            if output_hidden_states:
                all_hidden += (hidden_states,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden = all_hidden[:-1] + (hidden_states,)
        if cache is not None:
            cache.seen_positions = past + T
            cache.real_tokens = offset + real.sum(1)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states, past_key_values=cache, hidden_states=all_hidden
        )


class LazooForCausalLM(LazooPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LazooConfig):
        super().__init__(config)
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
        return_dict=None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
        )
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            # Trainer passes num_items_in_batch in kwargs: the loss is then sum / count over the whole batch
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states
        )


def _mechanism_classes(mechanism: str, prefix: str, config_class):
    base = type(f"{prefix}Model", (LazooModel,), {"config_class": config_class, "__module__": __name__})
    lm = type(f"{prefix}ForCausalLM", (LazooForCausalLM,), {"config_class": config_class, "__module__": __name__})
    return base, lm


LazooSoftmaxModel, LazooSoftmaxForCausalLM = _mechanism_classes("softmax", "LazooSoftmax", MECHANISM_CONFIGS["softmax"])
LazooSlidingWindowModel, LazooSlidingWindowForCausalLM = _mechanism_classes(
    "sliding_window", "LazooSlidingWindow", MECHANISM_CONFIGS["sliding_window"])
LazooLinearModel, LazooLinearForCausalLM = _mechanism_classes("linear", "LazooLinear", MECHANISM_CONFIGS["linear"])
LazooGatedLinearModel, LazooGatedLinearForCausalLM = _mechanism_classes(
    "gated_linear", "LazooGatedLinear", MECHANISM_CONFIGS["gated_linear"])
LazooDeltaNetModel, LazooDeltaNetForCausalLM = _mechanism_classes(
    "delta_net", "LazooDeltaNet", MECHANISM_CONFIGS["delta_net"])
LazooGatedDeltaNetModel, LazooGatedDeltaNetForCausalLM = _mechanism_classes(
    "gated_delta_net", "LazooGatedDeltaNet", MECHANISM_CONFIGS["gated_delta_net"])
LazooVLAModel, LazooVLAForCausalLM = _mechanism_classes("vla", "LazooVLA", MECHANISM_CONFIGS["vla"])
LazooELAModel, LazooELAForCausalLM = _mechanism_classes("ela", "LazooELA", MECHANISM_CONFIGS["ela"])
LazooGLAModel, LazooGLAForCausalLM = _mechanism_classes("gla", "LazooGLA", MECHANISM_CONFIGS["gla"])
LazooDeltaProductModel, LazooDeltaProductForCausalLM = _mechanism_classes(
    "delta_product", "LazooDeltaProduct", MECHANISM_CONFIGS["delta_product"])

#: model_type -> (config class, base model class, causal LM class)
MODEL_CLASSES = {
    "lazoo_hybrid": (LazooConfig, LazooModel, LazooForCausalLM),
    "lazoo_softmax": (MECHANISM_CONFIGS["softmax"], LazooSoftmaxModel, LazooSoftmaxForCausalLM),
    "lazoo_sliding_window": (MECHANISM_CONFIGS["sliding_window"], LazooSlidingWindowModel, LazooSlidingWindowForCausalLM),
    "lazoo_linear": (MECHANISM_CONFIGS["linear"], LazooLinearModel, LazooLinearForCausalLM),
    "lazoo_gated_linear": (MECHANISM_CONFIGS["gated_linear"], LazooGatedLinearModel, LazooGatedLinearForCausalLM),
    "lazoo_delta_net": (MECHANISM_CONFIGS["delta_net"], LazooDeltaNetModel, LazooDeltaNetForCausalLM),
    "lazoo_gated_delta_net": (MECHANISM_CONFIGS["gated_delta_net"], LazooGatedDeltaNetModel, LazooGatedDeltaNetForCausalLM),
    "lazoo_vla": (MECHANISM_CONFIGS["vla"], LazooVLAModel, LazooVLAForCausalLM),
    "lazoo_ela": (MECHANISM_CONFIGS["ela"], LazooELAModel, LazooELAForCausalLM),
    "lazoo_gla": (MECHANISM_CONFIGS["gla"], LazooGLAModel, LazooGLAForCausalLM),
    "lazoo_delta_product": (MECHANISM_CONFIGS["delta_product"], LazooDeltaProductModel, LazooDeltaProductForCausalLM),
}
