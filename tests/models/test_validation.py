"""Bad input to the models, configs and vision classes gets a clear error naming the field or argument,
replayed case by case. Every case asserts the error type and the words of its message; the positive controls
next to each table show that the checks do not refuse valid input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForCausalLM

import lazoo
from lazoo import (
    YoloLatBackbone,
    YoloLatConfig,
    YoloLatForImageClassification,
    YoloLatForObjectDetection,
    YoloLatImageProcessor,
)

VOCAB, HIDDEN = 37, 16
SIZES = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)


def raises(error, fragments, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` raises `error` whose message holds every one of `fragments`."""
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# ============================================================================ model inputs
@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("lazoo_linear", **SIZES)).eval()


def _ids(*rows):
    return torch.tensor(rows)


#: (case, forward kwargs, words the ValueError must hold)
INPUT_CASES = [
    ("ids_batch_0", lambda: dict(input_ids=torch.zeros(0, 5, dtype=torch.long)), ["input_ids", "empty", "(0, 5)"]),
    ("ids_length_0", lambda: dict(input_ids=torch.zeros(2, 0, dtype=torch.long)), ["input_ids", "empty", "(2, 0)"]),
    ("embeds_batch_0", lambda: dict(inputs_embeds=torch.randn(0, 5, HIDDEN)), ["inputs_embeds", "empty"]),
    ("embeds_length_0", lambda: dict(inputs_embeds=torch.randn(2, 0, HIDDEN)), ["inputs_embeds", "empty"]),
    ("id_equal_vocab", lambda: dict(input_ids=_ids([1, 2, VOCAB])), ["input_ids", str(VOCAB), f"vocab_size={VOCAB}"]),
    ("id_above_vocab", lambda: dict(input_ids=_ids([1, 1000, 2])), ["input_ids", "1000", f"vocab_size={VOCAB}"]),
    ("id_negative", lambda: dict(input_ids=_ids([1, -3, 2])), ["input_ids", "-3", f"vocab_size={VOCAB}"]),
    ("ids_float", lambda: dict(input_ids=torch.tensor([[1.0, 2.0]])), ["input_ids", "integer", "float32"]),
    ("ids_1d", lambda: dict(input_ids=torch.tensor([1, 2])), ["input_ids", "2-D", "(2,)"]),
    ("embeds_wrong_width", lambda: dict(inputs_embeds=torch.randn(1, 3, HIDDEN + 1)),
     ["inputs_embeds", f"hidden_size={HIDDEN}", f"(1, 3, {HIDDEN + 1})"]),
    ("neither", lambda: dict(), ["exactly one of input_ids or inputs_embeds"]),
]


@pytest.mark.parametrize("make, fragments", [c[1:] for c in INPUT_CASES], ids=[c[0] for c in INPUT_CASES])
def test_bad_model_inputs_are_refused(lm, make, fragments):
    with torch.no_grad():
        raises(ValueError, fragments, lm, **make())
        raises(ValueError, fragments, lm.model, **make())  # the base model checks the same way


def test_bad_ids_are_refused_by_the_classifier_too():
    from transformers import AutoModelForSequenceClassification

    config = AutoConfig.for_model("lazoo_linear", num_labels=3, pad_token_id=0, **SIZES)
    clf = AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        raises(ValueError, ["input_ids", str(VOCAB + 4), f"vocab_size={VOCAB}"], clf, input_ids=_ids([1, VOCAB + 4]))
        raises(ValueError, ["input_ids", "empty"], clf, input_ids=torch.zeros(1, 0, dtype=torch.long))


def test_the_whole_vocabulary_is_accepted(lm):
    ids = torch.arange(VOCAB)[None]  # 0 and vocab_size - 1 included
    with torch.no_grad():
        out = lm(input_ids=ids).logits
        by_embeds = lm(inputs_embeds=lm.get_input_embeddings()(ids)).logits
    assert out.shape == (1, VOCAB, VOCAB) and torch.isfinite(out).all()
    torch.testing.assert_close(out, by_embeds, rtol=0, atol=0)


# ============================================================================ configs
#: (case, model_type, field, bad value, words the ValueError must hold besides the field)
CONFIG_CASES = [
    ("hidden_negative", "lazoo_hybrid", "hidden_size", -8, ["positive int", "-8"]),
    ("hidden_zero", "lazoo_linear", "hidden_size", 0, ["positive int", "0"]),
    ("hidden_str", "lazoo_vla", "hidden_size", "32", ["positive int", "'32'"]),
    ("hidden_float", "lazoo_softmax", "hidden_size", 32.0, ["positive int", "32.0"]),
    ("heads_zero", "lazoo_linear", "num_attention_heads", 0, ["positive int"]),
    ("heads_negative", "lazoo_gla", "num_attention_heads", -2, ["positive int"]),
    ("heads_not_dividing", "lazoo_linear", "num_attention_heads", 3, ["hidden_size=16", "divisible"]),
    ("vocab_zero", "lazoo_linear", "vocab_size", 0, ["positive int"]),
    ("vocab_negative", "lazoo_hybrid", "vocab_size", -5, ["positive int"]),
    ("layers_zero", "lazoo_delta_net", "num_hidden_layers", 0, ["positive int"]),
    ("max_positions_zero", "lazoo_linear", "max_position_embeddings", 0, ["positive int"]),
    ("intermediate_negative", "lazoo_linear", "intermediate_size", -1, ["int >= 0", "0 = no MLP"]),
    ("intermediate_str", "lazoo_linear", "intermediate_size", "64", ["int >= 0"]),
    ("window_zero", "lazoo_sliding_window", "sliding_window", 0, ["positive int or None"]),
    ("window_negative", "lazoo_hybrid", "sliding_window", -4, ["positive int or None"]),
    ("window_float", "lazoo_hybrid", "sliding_window", 6.5, ["positive int or None"]),
    ("eps_negative", "lazoo_linear", "rms_norm_eps", -1, ["finite number > 0", "-1"]),
    ("eps_zero", "lazoo_linear", "rms_norm_eps", 0.0, ["finite number > 0"]),
    ("eps_nan", "lazoo_linear", "rms_norm_eps", math.nan, ["finite number > 0", "nan"]),
    ("init_range_negative", "lazoo_linear", "initializer_range", -0.1, ["finite number >= 0"]),
    ("short_conv_str", "lazoo_linear", "use_short_conv", "yes", ["True, False or None"]),
    ("layer_types_str", "lazoo_hybrid", "layer_types", "linear", ["list of mechanism names", "'linear'"]),
    ("layer_types_not_str", "lazoo_hybrid", "layer_types", ["linear", 3], ["mechanism names (str)", "3"]),
    ("layer_types_unknown", "lazoo_linear", "layer_types", ["linear", "flash"], ["'flash'", "softmax", "vla"]),
    ("layer_types_count", "lazoo_linear", "layer_types", ["linear"], ["1 entries", "num_hidden_layers=2"]),
    ("mixer_kwargs_unused", "lazoo_linear", "mixer_kwargs", {"ovq": {"max_dict_size": 8}},
     ["'ovq'", "layer_types=['linear', 'linear']"]),
    ("mixer_kwargs_unknown_mechanism", "lazoo_linear", "mixer_kwargs", {"flash": {}}, ["'flash'", "known mechanisms"]),
    ("mixer_kwargs_unknown_option", "lazoo_vla", "mixer_kwargs", {"vla": {"lambda_zero": 0.2}},
     ["'vla'", "lambda_zero", "lambda0"]),
    ("mixer_kwargs_option_type", "lazoo_vla", "mixer_kwargs", {"vla": {"refresh_period": 2.5}},
     ["['vla']['refresh_period']", "an int", "2.5"]),
    ("mixer_kwargs_option_nan", "lazoo_softmax", "mixer_kwargs", {"softmax": {"rope_theta": math.nan}},
     ["['softmax']['rope_theta']", "finite number"]),
    ("mixer_kwargs_not_dict", "lazoo_vla", "mixer_kwargs", {"vla": 3}, ["['vla']", "dict"]),
    ("mixer_kwargs_list", "lazoo_vla", "mixer_kwargs", [("vla", {})], ["dict"]),
    ("typed_field_type", "lazoo_vla", "lambda0", "0.1", ["finite number", "'0.1'"]),
    ("typed_field_int", "lazoo_ovq", "chunk_size", "64", ["an int", "'64'"]),
    ("typed_field_bool", "lazoo_delta_product", "allow_neg_eigval", "no", ["True or False"]),
]


@pytest.mark.parametrize("model_type, field, value, fragments", [c[1:] for c in CONFIG_CASES],
                         ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_fields_are_refused(model_type, field, value, fragments):
    label = "mixer_kwargs" if field == "mixer_kwargs" else field
    raises(ValueError, [label, *fragments], AutoConfig.for_model, model_type, **{**SIZES, field: value})
    # the same check in `validate` (which transformers runs when saving) after a change of the attribute
    config = AutoConfig.for_model(model_type, **SIZES)
    setattr(config, field, value)
    raises(ValueError, [label, *fragments], config.validate)


def test_validate_refuses_a_layer_change_that_orphans_mixer_kwargs():
    config = AutoConfig.for_model("lazoo_hybrid", layer_types=["sliding_window", "ovq"],
                                  mixer_kwargs={"ovq": {"max_dict_size": 8}}, **{**SIZES, "num_hidden_layers": 2})
    config.validate()
    config.layer_types = ["sliding_window", "vla"]
    raises(ValueError, ["mixer_kwargs['ovq']", "layer_types=['sliding_window', 'vla']"], config.validate)


@pytest.mark.parametrize("model_type", sorted(lazoo.MODEL_CLASSES))
def test_every_config_builds_with_no_arguments(model_type):
    """transformers builds default configs with no arguments (e.g. to save only the non-default fields)."""
    config = lazoo.MODEL_CLASSES[model_type][0]()
    config.validate()
    assert len(config.layer_types) == config.num_hidden_layers


def test_valid_edge_values_are_accepted():
    AutoConfig.for_model("lazoo_linear", **{**SIZES, "intermediate_size": 0}).validate()  # 0 = no MLP
    AutoConfig.for_model("lazoo_linear", **{**SIZES, "sliding_window": None}).validate()
    AutoConfig.for_model("lazoo_vla", **SIZES, lambda0=1).validate()  # an int where a float is the default
    AutoConfig.for_model("lazoo_hybrid", **SIZES, layer_types=("sliding_window", "ovq"),
                         mixer_kwargs={"ovq": {"chunk_size": 4}, "sliding_window": {"qk_norm": True}}).validate()
    AutoConfig.for_model("lazoo_rls", **SIZES, mixer_kwargs={"rls": {"chunk_size": None}}).validate()
    from lazoo.presets import build_config

    for layout in ("sw-ovq", "sw-nope", "sw-vq", "gdn-ovq"):
        build_config(layout, **SIZES).validate()
    # a preset cut short by few layers leaves a mechanism out, and its options with it
    short = build_config("kda-mla", **{**SIZES, "num_hidden_layers": 2})
    assert list(short.layer_types) == ["kda", "kda"] and "mla" not in short.mixer_kwargs
    assert build_config("kda-mla", **{**SIZES, "num_hidden_layers": 4}).mixer_kwargs["mla"]["kv_lora_rank"] == 128


# ============================================================================ vision
VISION = dict(widths=(8, 16, 32, 64, 64), depths=(1, 1, 1, 1), attention_heads=2, image_size=64, num_labels=3)

#: (case, field, bad value, words the ValueError must hold besides the field)
VISION_CONFIG_CASES = [
    ("depth_negative", "depths", (1, -1, 1, 1), ["int >= 0", "-1"]),
    ("depths_short", "depths", (1, 1, 1), ["list of 4 ints"]),
    ("depths_str", "depths", "1111", ["list of 4 ints"]),
    ("width_zero", "widths", (8, 0, 32, 64, 64), ["int >= 2"]),
    ("num_labels_zero", "num_labels", 0, ["positive int"]),
    ("num_labels_negative", "num_labels", -2, ["positive int"]),
    ("heads_zero", "attention_heads", 0, ["positive int"]),
    ("image_size_zero", "image_size", 0, ["positive int"]),
    ("channels_zero", "num_channels", 0, ["positive int"]),
    ("topk_zero", "assigner_topk", 0, ["positive int"]),
    ("head_width_negative", "head_width", -1, ["positive int or None"]),
    ("box_weight_nan", "box_loss_weight", math.nan, ["finite number >= 0"]),
    ("bn_eps_zero", "batch_norm_eps", 0, ["finite number > 0"]),
    ("dropout_one", "classifier_dropout", 1.0, ["[0, 1)"]),
]


@pytest.mark.parametrize("field, value, fragments", [c[1:] for c in VISION_CONFIG_CASES],
                         ids=[c[0] for c in VISION_CONFIG_CASES])
def test_bad_vision_config_fields_are_refused(field, value, fragments):
    raises(ValueError, [field, *fragments], YoloLatConfig, **{**VISION, field: value})
    if field != "num_labels":  # num_labels is transformers' property over id2label
        config = YoloLatConfig(**VISION)
        setattr(config, field, value)
        raises(ValueError, [field, *fragments], config.validate)


def test_vision_validate_refuses_an_emptied_label_map():
    config = YoloLatConfig(**VISION)
    config.id2label = {}
    raises(ValueError, ["num_labels", "positive int"], config.validate)


@pytest.fixture(scope="module")
def detector():
    torch.manual_seed(0)
    return YoloLatForObjectDetection(YoloLatConfig(**VISION))


GOOD_BOX = [[0.5, 0.5, 0.25, 0.25]]

#: (case, class_labels, boxes, words the ValueError must hold)
DETECTION_LABEL_CASES = [
    ("class_negative", [-1], GOOD_BOX, ["labels[0]['class_labels']", "num_labels=3", "-1"]),
    ("class_too_large", [3], GOOD_BOX, ["labels[0]['class_labels']", "num_labels=3", "3"]),
    ("box_above_one", [0], [[0.5, 0.5, 1.5, 0.2]], ["labels[0]['boxes']", "normalised cxcywh", "[0, 1]"]),
    ("box_negative_centre", [0], [[-0.1, 0.5, 0.2, 0.2]], ["labels[0]['boxes']", "normalised cxcywh"]),
    ("box_absolute_pixels", [0], [[10.0, 20.0, 30.0, 40.0]], ["labels[0]['boxes']", "normalised cxcywh"]),
    ("box_zero_width", [0], [[0.5, 0.5, 0.0, 0.2]], ["labels[0]['boxes']", "width and a height > 0"]),
    ("box_zero_height", [0], [[0.5, 0.5, 0.2, 0.0]], ["labels[0]['boxes']", "width and a height > 0"]),
    ("box_nan", [0], [[math.nan, 0.5, 0.2, 0.2]], ["labels[0]['boxes']", "NaN"]),
    ("box_inf", [0], [[0.5, 0.5, math.inf, 0.2]], ["labels[0]['boxes']", "NaN or Inf"]),
    ("boxes_missing_one", [0, 1], GOOD_BOX, ["labels[0]['boxes']", "[2, 4]"]),
    ("float_classes", [0.0], GOOD_BOX, ["labels[0]['class_labels']", "integer"]),
]


@pytest.mark.parametrize("classes, boxes, fragments", [c[1:] for c in DETECTION_LABEL_CASES],
                         ids=[c[0] for c in DETECTION_LABEL_CASES])
def test_bad_detection_labels_are_refused(detector, classes, boxes, fragments):
    labels = [{"class_labels": torch.tensor(classes), "boxes": torch.tensor(boxes, dtype=torch.float32)}]
    raises(ValueError, fragments, detector, torch.randn(1, 3, 64, 64), labels=labels)


def test_detection_label_structure_is_checked(detector):
    x = torch.randn(2, 3, 64, 64)
    good = {"class_labels": torch.tensor([1]), "boxes": torch.tensor(GOOD_BOX)}
    raises(ValueError, ["one dict per image", "1 entries", "batch of 2"], detector, x, labels=[good])
    raises(ValueError, ["labels[1]", "'class_labels' and 'boxes'"], detector, x, labels=[good, {"boxes": []}])
    with torch.no_grad():  # the positive control: edge values (a box filling the image) give a finite loss
        full = {"class_labels": torch.tensor([0, 2]), "boxes": torch.tensor([[0.5, 0.5, 1.0, 1.0], GOOD_BOX[0]])}
        empty = {"class_labels": torch.zeros(0, dtype=torch.long), "boxes": torch.zeros(0, 4)}
        assert torch.isfinite(detector(x, labels=[full, empty]).loss)


#: (case, model class, pixel_values shape, words the ValueError must hold)
PIXEL_CASES = [
    ("detector_0x0", YoloLatForObjectDetection, (1, 3, 0, 0), ["pixel_values", "empty"]),
    ("detector_batch_0", YoloLatForObjectDetection, (0, 3, 64, 64), ["pixel_values", "empty"]),
    ("detector_not_32", YoloLatForObjectDetection, (1, 3, 48, 64), ["multiples of 32", "48x64"]),
    ("classifier_0x0", YoloLatForImageClassification, (1, 3, 0, 0), ["pixel_values", "empty"]),
    ("backbone_height_0", YoloLatBackbone, (1, 3, 0, 32), ["pixel_values", "empty"]),
    ("backbone_channels", YoloLatBackbone, (1, 1, 32, 32), ["pixel_values", "1 channels", "num_channels=3"]),
    ("classifier_3d", YoloLatForImageClassification, (3, 32, 32), ["pixel_values", "[batch, 3, height, width]"]),
]


@pytest.mark.parametrize("cls, shape, fragments", [c[1:] for c in PIXEL_CASES], ids=[c[0] for c in PIXEL_CASES])
def test_bad_pixel_values_are_refused(cls, shape, fragments):
    model = cls(YoloLatConfig(**VISION))
    raises(ValueError, fragments, model, torch.randn(shape))


@pytest.mark.parametrize("labels, fragments", [
    (torch.tensor([-1, 0]), ["labels", "num_labels=3", "-1"]),
    (torch.tensor([0, 3]), ["labels", "num_labels=3", "3"]),
    (torch.tensor([0.0, 1.0]), ["labels", "integer class ids"]),
    (torch.tensor([0]), ["labels", "[batch] = [2]"]),
], ids=["negative", "too_large", "float", "wrong_batch"])
def test_bad_classification_labels_are_refused(labels, fragments):
    model = YoloLatForImageClassification(YoloLatConfig(**VISION))
    raises(ValueError, fragments, model, torch.randn(2, 3, 32, 32), labels=labels)


# ---------------------------------------------------------------------------- image processor
#: (case, processor kwargs, error type, words the message must hold)
PROCESSOR_CASES = [
    ("size", dict(size=64), TypeError, ["'size'", "image_size"]),
    ("size_dict", dict(size={"height": 64, "width": 64}), TypeError, ["'size'", "image_size"]),
    ("unknown", dict(image_sise=64), TypeError, ["image_sise"]),
    ("image_size_zero", dict(image_size=0), ValueError, ["image_size", "positive int"]),
    ("image_size_str", dict(image_size="64"), ValueError, ["image_size", "positive int"]),
    ("pad_value_too_large", dict(pad_value=300), ValueError, ["pad_value", "[0, 255]"]),
    ("std_zero", dict(image_std=[0.2, 0.0, 0.2]), ValueError, ["image_std", "> 0"]),
    ("mean_two_channels", dict(image_mean=[0.5, 0.5]), ValueError, ["image_mean", "3 numbers"]),
]


@pytest.mark.parametrize("kwargs, error, fragments", [c[1:] for c in PROCESSOR_CASES],
                         ids=[c[0] for c in PROCESSOR_CASES])
def test_bad_processor_arguments_are_refused(kwargs, error, fragments):
    raises(error, fragments, YoloLatImageProcessor, **kwargs)


IMAGE = np.full((20, 30, 3), 200, dtype=np.uint8)

#: (case, call kwargs, error type, words the message must hold)
PREPROCESS_CASES = [
    ("empty_array", dict(images=np.zeros((0, 0, 3), np.uint8)), ValueError, ["images[0]", "empty", "0x0"]),
    ("empty_pil", dict(images=[IMAGE, Image.new("RGB", (0, 0))]), ValueError, ["images[1]", "empty"]),
    ("empty_tensor", dict(images=torch.zeros(3, 0, 0)), ValueError, ["images[0]", "empty"]),
    ("zero_width", dict(images=np.zeros((10, 0, 3), np.uint8)), ValueError, ["images[0]", "empty", "0x10"]),
    ("size_kwarg", dict(images=IMAGE, size=32), TypeError, ["preprocess", "'size'", "image_size"]),
    ("box_nan", dict(images=IMAGE, annotations={"boxes": [[1, 1, math.nan, 5]], "class_labels": [0]}),
     ValueError, ["annotations[0]['boxes']", "NaN"]),
    ("box_inverted", dict(images=IMAGE, annotations={"boxes": [[10, 1, 4, 5]], "class_labels": [0]}),
     ValueError, ["annotations[0]['boxes']", "x2 >= x1"]),
    ("class_negative", dict(images=IMAGE, annotations={"boxes": [[1, 1, 9, 9]], "class_labels": [-1]}),
     ValueError, ["annotations[0]['class_labels']", ">= 0", "-1"]),
]


@pytest.mark.parametrize("kwargs, error, fragments", [c[1:] for c in PREPROCESS_CASES],
                         ids=[c[0] for c in PREPROCESS_CASES])
def test_bad_processor_inputs_are_refused(kwargs, error, fragments):
    raises(error, fragments, YoloLatImageProcessor(image_size=32), **kwargs)


def test_processor_round_trip_and_one_pixel_image(tmp_path):
    proc = YoloLatImageProcessor(image_size=32, pad_value=0)
    proc.save_pretrained(tmp_path)
    loaded = YoloLatImageProcessor.from_pretrained(tmp_path)  # transformers passes its own keys back: accepted
    assert loaded.to_dict() == proc.to_dict()
    out = loaded(np.full((1, 1, 3), 255, np.uint8), annotations={"boxes": [[0, 0, 1, 1]], "class_labels": [0]})
    assert out["pixel_values"].shape == (1, 3, 32, 32) and torch.isfinite(out["pixel_values"]).all()
    torch.testing.assert_close(out["labels"][0]["boxes"], torch.tensor([[0.5, 0.5, 1.0, 1.0]]))
