"""`lazoo convert` / `lazoo.convert.from_fla`: fla checkpoint folders into lazoo folders.

The fla folders are written here, never downloaded: by hand in fla's layout (config.json with fla's fields, fla's
parameter names in safetensors; always), and by fla 0.6.0's own model classes built on the CPU where fla is
importable (/tmp/fla/site or LAZOO_FLA_SITE). The converted model's float64 logits equal a float64 transcription of
fla's model (tests/fla_reference.py, tests/fla_attention_reference.py: fla's layer code and naive recurrences,
written without fla or lazoo) for every supported model type and two hybrid patterns.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import types

import fla_attention_reference as attn_ref
import fla_reference as ref
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from lazoo.convert import UnsupportedCheckpointError, fla_config_to_lazoo, from_fla

pytestmark = pytest.mark.usefixtures("single_thread")

FLA_SITE = os.environ.get("LAZOO_FLA_SITE", "/tmp/fla/site")
VOCAB, T = 101, 23  # the vocabulary holds export_helpers.PROMPT

#: small fla configs of each supported model type and two hybrid patterns (fla's field names)
CASES = {
    "gated_deltanet": dict(model_type="gated_deltanet", hidden_size=40, num_heads=3, head_dim=10, expand_v=2,
                           num_hidden_layers=2, hidden_ratio=4),
    "gated_deltanet+attn": dict(model_type="gated_deltanet", hidden_size=40, num_heads=2, head_dim=12, expand_v=1,
                                num_v_heads=4, num_hidden_layers=3, hidden_ratio=2, tie_word_embeddings=True,
                                attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2}),
    "delta_net": dict(model_type="delta_net", hidden_size=32, num_heads=4, num_hidden_layers=2, use_gate=True,
                      intermediate_size=48),
    "gla": dict(model_type="gla", hidden_size=32, num_heads=4, num_hidden_layers=2, intermediate_size=48,
                clamp_min=-0.1),
    "gla+swa": dict(model_type="gla", hidden_size=32, num_heads=4, num_kv_heads=2, num_hidden_layers=3,
                    intermediate_size=48, use_short_conv=True,
                    attn={"layers": [0, 2], "num_heads": 2, "qkv_bias": True, "window_size": 5, "rope_theta": 500.0}),
    "kda": dict(model_type="kda", hidden_size=32, num_heads=2, head_dim=8, num_v_heads=4, expand_v=1.5,
                num_hidden_layers=2, hidden_ratio=2, allow_neg_eigval=True),
    "kda+attn": dict(model_type="kda", hidden_size=40, num_heads=2, head_dim=10, num_hidden_layers=3,
                     intermediate_size=48, use_short_conv=False, safe_gate=True, lower_bound=-5.0,
                     tie_word_embeddings=True, attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2}),
    "transformer": dict(model_type="transformer", hidden_size=32, num_heads=4, num_kv_heads=2, qkv_bias=True,
                        qk_norm=True, num_hidden_layers=2, intermediate_size=48, rope_theta=1000.0),
}
#: fla's defaults for the fields the transcription reads (fla's configuration classes)
FLA_DEFAULTS = {"norm_eps": 1e-6, "hidden_act": "swish", "tie_word_embeddings": False, "vocab_size": VOCAB,
                "bos_token_id": 1, "eos_token_id": 2}


def fla_config(case: str) -> dict:
    return {**FLA_DEFAULTS, **CASES[case]}


# ----------------------------------------------------------------------------- fla's model, transcribed
def _attention_spec(cfg: dict, i: int) -> dict | None:
    if cfg["model_type"] == "transformer":
        return {"num_heads": cfg["num_heads"], "num_kv_heads": cfg.get("num_kv_heads"), "qk_norm": cfg.get("qk_norm",
                False), "window_size": cfg.get("window_size"), "rope_theta": cfg.get("rope_theta", 10000.0)}
    attn = cfg.get("attn")
    if attn is None or i not in attn["layers"]:
        return None
    return {"num_heads": attn["num_heads"], "num_kv_heads": attn.get("num_kv_heads"), "qk_norm": False,
            "window_size": attn.get("window_size"), "rope_theta": attn.get("rope_theta", 10000.0)}


def _layer_args(cfg: dict) -> dict:
    """The arguments fla's blocks pass to the linear layers (from the model config)."""
    args = {k: v for k, v in cfg.items() if k not in ("attn", "model_type")}
    args["gate_fn"] = cfg.get("hidden_act", "swish")  # GLA's block passes hidden_act as the gate function
    return args


def fla_logits(weights: dict, cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    """fla's causal LM on one sequence `ids` [T], float64, from its parameters by fla's names."""
    eps = cfg["norm_eps"]
    x = weights["model.embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        layer = {k[len(pre) + 5:]: v for k, v in weights.items() if k.startswith(pre + "attn.")}
        h = attn_ref.rms_norm(x, weights[pre + "attn_norm.weight"], eps)
        spec = _attention_spec(cfg, i)
        if spec is None:
            o = ref.LAYERS[cfg["model_type"]](layer, h, **_layer_args(cfg))
        else:
            o = attn_ref.fla_attention(h[None], layer, **spec)[0]
        x = x + o
        h = attn_ref.rms_norm(x, weights[pre + "mlp_norm.weight"], eps)
        x = x + attn_ref.gated_mlp(h, *(weights[f"{pre}mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))
    x = attn_ref.rms_norm(x, weights["model.norm.weight"], eps)
    return x @ weights.get("lm_head.weight", weights["model.embeddings.weight"]).T


def random_fla_checkpoint(cfg: dict, seed: int, dtype=torch.float64) -> dict:
    """Fresh random parameters of a fla model `cfg` under fla's names (never fla's constant inits)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = cfg["hidden_size"]
    width = ref_intermediate(cfg)

    def rand(*shape, scale=None):
        w = torch.randn(shape, generator=gen, dtype=dtype)
        return 1 + 0.3 * w if scale == "norm" else w / shape[-1] ** 0.5

    vocab = cfg["vocab_size"]
    weights = {"model.embeddings.weight": rand(vocab, hidden), "model.norm.weight": rand(hidden, scale="norm")}
    if not cfg.get("tie_word_embeddings"):
        weights["lm_head.weight"] = rand(vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        weights.update({pre + "attn_norm.weight": rand(hidden, scale="norm"),
                        pre + "mlp_norm.weight": rand(hidden, scale="norm"),
                        pre + "mlp.gate_proj.weight": rand(width, hidden),
                        pre + "mlp.up_proj.weight": rand(width, hidden),
                        pre + "mlp.down_proj.weight": rand(hidden, width)})
        spec = _attention_spec(cfg, i)
        if spec is None:
            layer = ref.random_fla_weights(cfg["model_type"], gen, dtype, **_layer_args(cfg))
        else:
            heads, kv = spec["num_heads"], spec["num_kv_heads"] or spec["num_heads"]
            d = hidden // heads
            layer = {"q_proj.weight": rand(heads * d, hidden), "k_proj.weight": rand(kv * d, hidden),
                     "v_proj.weight": rand(kv * d, hidden), "o_proj.weight": rand(hidden, heads * d)}
            if cfg.get("qkv_bias") or (cfg.get("attn") or {}).get("qkv_bias"):
                layer.update({"q_proj.bias": rand(heads * d) * 3, "k_proj.bias": rand(kv * d) * 3,
                              "v_proj.bias": rand(kv * d) * 3})
            if spec["qk_norm"]:
                layer.update({"q_norm.weight": rand(d, scale="norm"), "k_norm.weight": rand(d, scale="norm")})
        weights.update({pre + "attn." + k: v for k, v in layer.items()})
    return weights


def ref_intermediate(cfg: dict) -> int:
    return attn_ref.fla_intermediate_size(cfg["hidden_size"], cfg.get("hidden_ratio", 4), cfg.get("intermediate_size"))


def write_fla_folder(folder, cfg: dict, weights: dict, shards: int = 1) -> None:
    """A fla checkpoint folder: config.json and safetensors (`shards` files with an index when > 1)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["X"], "transformers_version": "5.0"}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n].contiguous() for n in names}, str(folder / "model.safetensors"))
        return
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n].contiguous() for n in part}, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def ids_for(seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (T,), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- conversion is exact
@pytest.mark.parametrize("case", list(CASES))
def test_the_converted_model_computes_fla_s_equations(case, tmp_path):
    cfg = fla_config(case)
    weights = random_fla_checkpoint(cfg, seed=len(case))
    write_fla_folder(tmp_path / "fla", cfg, weights, shards=2 if "+" in case else 1)
    from_fla(tmp_path / "fla", tmp_path / "lazoo")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "lazoo").double().eval()
    ids = ids_for(7)
    with torch.no_grad():
        got = model(ids[None]).logits[0]
    torch.testing.assert_close(got, fla_logits(weights, cfg, ids), rtol=1e-9, atol=1e-9)


def test_a_converted_folder_names_its_source_and_keeps_the_tokenizer(tmp_path):
    cfg = fla_config("gated_deltanet+attn")
    write_fla_folder(tmp_path / "gdn-h", cfg, random_fla_checkpoint(cfg, seed=1, dtype=torch.float32))
    out = from_fla(tmp_path / "gdn-h", tmp_path / "out")
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "README.md", "modeling_lazoo.py"} <= files
    card = (out / "README.md").read_text()
    assert "lazoo convert" in card and "`gdn-h`" in card and "gated_deltanet" in card
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["gated_delta_net", "softmax", "gated_delta_net"]
    assert config["torch_dtype" if "torch_dtype" in config else "dtype"] == "float32"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def test_the_converted_folder_loads_where_lazoo_is_not_installed(tmp_path):
    from export_helpers import PROMPT, run_loader

    cfg = fla_config("gla+swa")
    write_fla_folder(tmp_path / "fla", cfg, random_fla_checkpoint(cfg, seed=3, dtype=torch.float32))
    from_fla(tmp_path / "fla", tmp_path / "lazoo")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "lazoo").eval()
    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(prompt, attention_mask=(prompt != 0).long()).logits
    results = run_loader([str(tmp_path / "lazoo")], tmp_path)
    assert results.pop("lazoo_imported") == []
    torch.testing.assert_close(torch.tensor(results[str(tmp_path / "lazoo")]["logits"]), logits,
                               rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("change,field", [
    ({"model_type": "retnet"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attnres_block_size": 2}, "attnres_block_size"),
    ({"feature_map": "gelu"}, "feature_map"),
    ({"use_future_trick": True}, "use_future_trick"),
    ({"attn": {"layers": [0], "num_heads": 2, "window_size": 4, "sink_tokens": 2}}, "attn.sink_tokens"),
    ({"attn": [{"layers": [0], "num_heads": 2, "window_size": 4},
               {"layers": [1], "num_heads": 2, "window_size": 8}]}, "attn.window_size"),
])
def test_an_unsupported_checkpoint_is_refused_naming_the_field_and_nothing_is_written(change, field, tmp_path):
    cfg = {**fla_config("gla"), **change}
    write_fla_folder(tmp_path / "fla", cfg, random_fla_checkpoint(fla_config("gla"), seed=0, dtype=torch.float32))
    with pytest.raises(UnsupportedCheckpointError, match=f"'{field}'"):
        from_fla(tmp_path / "fla", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fla"]


def test_a_destination_with_files_is_never_touched(tmp_path):
    cfg = fla_config("delta_net")
    write_fla_folder(tmp_path / "fla", cfg, random_fla_checkpoint(cfg, seed=0, dtype=torch.float32))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        from_fla(tmp_path / "fla", tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


def test_missing_or_extra_tensors_are_refused(tmp_path):
    cfg = fla_config("delta_net")
    weights = random_fla_checkpoint(cfg, seed=0, dtype=torch.float32)
    weights.pop("model.layers.1.attn.b_proj.weight")
    write_fla_folder(tmp_path / "fla", cfg, weights)
    with pytest.raises(UnsupportedCheckpointError, match="b_proj"):
        from_fla(tmp_path / "fla", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_command_line_says_what_is_wrong_in_one_line(tmp_path, capsys):
    from lazoo.cli import main

    cfg = {**fla_config("gla"), "hidden_act": "relu"}
    write_fla_folder(tmp_path / "fla", cfg, random_fla_checkpoint(fla_config("gla"), seed=0, dtype=torch.float32))
    assert main(["convert", str(tmp_path / "fla"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'hidden_act'" in err[0]
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2


def test_fla_s_config_fields_become_lazoo_options():
    fields = fla_config_to_lazoo(fla_config("gated_deltanet+attn"))
    assert fields["model_type"] == "lazoo_hybrid" and fields["tie_word_embeddings"] is True
    gdn = fields["mixer_kwargs"]["gated_delta_net"]
    assert (gdn["head_k_dim"], gdn["num_v_heads"], gdn["beta_bias"]) == (12, 4, False)
    assert fields["mixer_kwargs"]["softmax"]["num_kv_heads"] == 2
    assert fields["intermediate_size"] == 256  # fla's rule: 2/3 · 2 · 40 rounded up to a multiple of 256


# ----------------------------------------------------------------------------- fla's own classes
@pytest.fixture(scope="module")
def fla_models():
    """fla's model classes, imported from FLA_SITE with a stand-in `flash_attn` (fla checks it at construction
    only); skip when fla cannot be imported."""
    if not os.path.isdir(FLA_SITE):
        pytest.skip(f"fla 0.6.0 not found at {FLA_SITE} (set LAZOO_FLA_SITE); the hand-written checkpoints still run")
    import transformers.activations  # noqa: F401  (transformers probes flash_attn at import: before the stand-in)

    if "flash_attn" not in sys.modules:
        stub = types.ModuleType("flash_attn")
        stub.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
        stub.flash_attn_func = stub.flash_attn_varlen_func = attn_ref.flash_attn_func
        sys.modules["flash_attn"] = stub
    sys.path.insert(0, FLA_SITE)
    try:
        import fla.models as models
    except Exception as err:  # noqa: BLE001 - any import failure means: no fla here
        pytest.skip(f"fla is not importable from {FLA_SITE}: {type(err).__name__}: {err}")
    finally:
        sys.path.remove(FLA_SITE)
    return {"transformer": (models.TransformerConfig, models.TransformerForCausalLM),
            "gla": (models.GLAConfig, models.GLAForCausalLM),
            "delta_net": (models.DeltaNetConfig, models.DeltaNetForCausalLM),
            "gated_deltanet": (models.GatedDeltaNetConfig, models.GatedDeltaNetForCausalLM),
            "kda": (models.KDAConfig, models.KDAForCausalLM),
            "mamba2": (models.Mamba2Config, models.Mamba2ForCausalLM)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_saved_by_fla_s_own_classes_converts_exactly(case, fla_models, tmp_path):
    cfg = fla_config(case)
    config_cls, model_cls = fla_models[cfg["model_type"]]
    torch.manual_seed(0)
    fla_model = model_cls(config_cls(**{k: v for k, v in cfg.items() if k != "model_type"}))
    with torch.no_grad():  # off fla's constant inits (A_log, dt_bias, norms): every tensor random
        for p in fla_model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    fla_model.save_pretrained(tmp_path / "fla")
    from_fla(tmp_path / "fla", tmp_path / "lazoo")
    saved = {k: v.double() for k, v in load_file(str(tmp_path / "fla" / "model.safetensors")).items()}
    saved_cfg = {**FLA_DEFAULTS, **json.loads((tmp_path / "fla" / "config.json").read_text())}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "lazoo").double().eval()
    ids = ids_for(11)
    with torch.no_grad():
        got = model(ids[None]).logits[0]
    torch.testing.assert_close(got, fla_logits(saved, saved_cfg, ids), rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- the worked path (docs/pretrained.md)
def test_a_converted_model_fine_tunes_with_lora_evaluates_and_loads_without_lazoo(tmp_path, tokenizer, lm_blocks,
                                                                                   capsys):
    from export_helpers import run_loader
    from lora_helpers import lora_fine_tune

    from lazoo.eval import main as eval_main

    cfg = {**fla_config("gated_deltanet+attn"), "vocab_size": len(tokenizer)}
    write_fla_folder(tmp_path / "fla", cfg, random_fla_checkpoint(cfg, seed=5, dtype=torch.float32))
    tokenizer.save_pretrained(tmp_path / "fla")
    from_fla(tmp_path / "fla", tmp_path / "converted")
    assert (tmp_path / "converted" / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "converted")
    peft_model, losses = lora_fine_tune(model, lm_blocks, tmp_path / "run")
    assert losses[-1] < losses[0], losses
    tuned = tmp_path / "tuned"
    peft_model.merge_and_unload().save_pretrained(tuned)
    tokenizer.save_pretrained(tuned)
    assert "lazoo convert" in (tuned / "README.md").read_text()  # the card still names the source
    out = tmp_path / "eval.json"
    assert eval_main([str(tuned), "--limit", "2", "--batch-size", "2", "--device", "cpu", "--output", str(out)]) == 0
    metrics = json.loads(out.read_text())["metrics"][str(tuned)]
    assert metrics["lazoo_kjv_ppl"]["word_perplexity"] > 1
    results = run_loader([str(tuned)], tmp_path)
    assert results.pop("lazoo_imported") == [] and results[str(tuned)]["tokens"]


def test_push_to_hub_of_a_converted_model_uploads_code_and_card(tmp_path, monkeypatch):
    """push_to_hub with the Hub calls stubbed (offline): the exported code and the card naming the source go up."""
    from export_helpers import stub_push_to_hub

    cfg = fla_config("gla")
    write_fla_folder(tmp_path / "my-gla", cfg, random_fla_checkpoint(cfg, seed=2, dtype=torch.float32))
    from_fla(tmp_path / "my-gla", tmp_path / "lazoo")
    uploaded = stub_push_to_hub(monkeypatch)
    AutoModelForCausalLM.from_pretrained(tmp_path / "lazoo").push_to_hub("someone/gla-converted")
    assert {"config.json", "model.safetensors", "modeling_lazoo.py"} <= set(uploaded["files"])
    assert "`my-gla`" in uploaded["card"] and "Gated Linear Attention" in uploaded["card"]
