"""transformers' own common model tests against every lazoo causal LM: `ModelTesterMixin` and
`GenerationTesterMixin` from the installed release (`transformers_suite` says where they come from), run on
each mechanism's base model and causal LM, and on two hybrids, with tiny configs.

The default run checks a representative few (`DEFAULT`); `pytest -m slow` runs every mechanism.
"""

from __future__ import annotations

import unittest
from unittest import mock

import pytest
import torch
import transformers_suite
from conftest import tiny_config
from transformers.models.auto import modeling_auto

import lazoo
from lazoo.layers.mixers import mixer_class
from lazoo.models.modeling_lazoo import MODEL_CLASSES

SUITE = transformers_suite.load()
if isinstance(SUITE, str):
    pytest.skip(SUITE, allow_module_level=True)

pytestmark = pytest.mark.usefixtures("single_thread")

#: the hybrids checked besides the mechanisms: name -> layer_types
HYBRIDS = {"hybrid_sliding_window_gated_delta_net": ["sliding_window", "gated_delta_net"],
           "hybrid_softmax_vla": ["softmax", "vla"]}
#: the models of the default run (the others under -m slow)
DEFAULT = ("gated_delta_net", "vla", "hybrid_sliding_window_gated_delta_net")


class LazooModelTester:
    """The shapes and inputs transformers' mixins ask a model tester for."""

    def __init__(self, parent, name: str, layer_types: list[str] | None = None):
        self.parent, self.name, self.layer_types = parent, name, layer_types
        self.batch_size = 3
        self.seq_length = 7
        self.is_training = True
        self.vocab_size = 99
        self.hidden_size = 32
        self.num_hidden_layers = 2
        self.num_attention_heads = 2
        self.intermediate_size = 64

    def get_config(self):
        kwargs = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                      num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                      intermediate_size=self.intermediate_size, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if self.layer_types is not None:
            return tiny_config("hybrid", layer_types=list(self.layer_types), **kwargs)
        return tiny_config(self.name, **kwargs)

    def prepare_config_and_inputs_for_common(self):
        gen = torch.Generator().manual_seed(0)
        input_ids = torch.randint(3, self.vocab_size, (self.batch_size, self.seq_length), generator=gen)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[0, :2] = 0  # one left-padded row
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


def _less_flaky_config(config):
    """transformers' `set_config_for_less_flaky_test` (every norm's epsilon set to 1), writing an option of a layer
    type other than the config's own mechanism into `mixer_kwargs`, the one place such a config reads it from (a
    top-level field there is refused when the folder loads)."""
    _LESS_FLAKY(config)
    for name in dict.fromkeys(config.layer_types):
        if name == config.mechanism:
            continue
        for key in [k for k in mixer_class(name).defaults if k in vars(config) and vars(config)[k] == 1.0]:
            delattr(config, key)
            config.mixer_kwargs = {**config.mixer_kwargs, name: {**config.mixer_kwargs.get(name, {}), key: 1.0}}


_LESS_FLAKY = SUITE.common.set_config_for_less_flaky_test


class LazooMixinTest:
    """Common to every model's test class (`_make` sets `name`, `layer_types` and the classes)."""

    name: str = ""
    layer_types: list[str] | None = None
    model_type: str = ""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # transformers' generic tests tell a base model from a head, and build labels, by the class names in its
        # built-in auto mappings; lazoo's classes are registered with the Auto classes instead
        base, lm = cls.all_model_classes
        cls._patches = [mock.patch.dict(modeling_auto.MODEL_MAPPING_NAMES, {cls.model_type: base.__name__}),
                        mock.patch.dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                        {cls.model_type: lm.__name__}),
                        mock.patch.object(SUITE.common, "set_config_for_less_flaky_test", _less_flaky_config)]
        for patch in cls._patches:
            patch.start()

    @classmethod
    def tearDownClass(cls):
        for patch in cls._patches:
            patch.stop()
        super().tearDownClass()

    def setUp(self):
        self.model_tester = LazooModelTester(self, self.name, self.layer_types)

    def test_generation_tester_mixin_inheritance(self):
        if not SUITE.has_generation_tests:
            self.skipTest("GenerationTesterMixin is not in this copy of transformers' tests (see transformers_suite)")
        super().test_generation_tester_mixin_inheritance()


def _make(name: str, layer_types: list[str] | None) -> type:
    model_type = "lazoo_hybrid" if layer_types else lazoo.registry.get(name).model_type
    _, base, lm = MODEL_CLASSES[model_type]
    types = layer_types or [name]
    attributes = {
        "name": name, "layer_types": layer_types, "model_type": model_type,
        "all_model_classes": (base, lm),
        # attention weights come from the softmax-type layers (TokenMixer.has_attention_weights); a model with none of
        # them (a recurrent one, local-linear attention) has none to return
        "has_attentions": any(mixer_class(t).has_attention_weights for t in types),
    }
    bases = (LazooMixinTest, SUITE.ModelTesterMixin)
    if SUITE.has_generation_tests:
        bases += (SUITE.GenerationTesterMixin,)
    cls = type(f"Test{''.join(p.title() for p in name.split('_'))}", (*bases, unittest.TestCase), attributes)
    cls.__module__ = __name__
    if name not in DEFAULT:
        cls = pytest.mark.slow(cls)
    return cls


for _name in lazoo.list_mechanisms():
    _cls = _make(_name, None)
    globals()[_cls.__name__] = _cls
for _name, _types in HYBRIDS.items():
    _cls = _make(_name, _types)
    globals()[_cls.__name__] = _cls
del _name, _cls
