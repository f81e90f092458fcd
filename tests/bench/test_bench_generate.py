"""lazoo.bench.generate on the CPU with tiny models: a row per setting with consistent timings, failures
recorded in their rows, fla models only through --fla-site, and the markdown table."""

import json
import sys

import pytest
import torch

from lazoo.bench import generate as bench

TINY_ARGS = ["--device", "cpu", "--dtype", "float32", "--hidden-size", "32", "--layers", "2", "--heads", "2",
             "--intermediate-size", "64", "--vocab-size", "101", "--warmup-tokens", "2"]


def run(tmp_path, *extra):
    """main() with tiny sizes; returns (env, rows) as read back from the JSONL file."""
    out = tmp_path / "bench_generate.jsonl"
    result = bench.main([*TINY_ARGS, "--out", str(out), *extra])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0] == {"env": json.loads(json.dumps(result["env"]))}
    assert lines[1:] == json.loads(json.dumps(result["rows"]))
    return lines[0]["env"], lines[1:]


def by_setting(rows):
    return {(r["model"], r["mode"], r["batch"], r["prompt"]): r for r in rows}


def test_a_row_per_setting_with_consistent_timings(tmp_path, capsys, single_thread):
    env, rows = run(tmp_path, "--models", "gated_delta_net,llama", "--modes", "default,eager,static", "--prompts", "16",
                    "--batch-sizes", "1,2", "--new-tokens", "12", "--repeats", "3")  # 11 steps: above timer noise
    assert env["device"] == "cpu" and env["gpu"] is None and env["torch"] and env["transformers"]
    assert env["arguments"]["new_tokens"] == 12 and env["fla"] is None
    assert env["sizes"] == dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                vocab_size=101)
    settings = by_setting(rows)
    assert len(settings) == len(rows) == 12
    assert set(settings) == {(m, mode, b, 16) for m in ("gated_delta_net", "llama")
                             for mode in ("default", "eager", "static") for b in (1, 2)}
    for key, r in settings.items():
        model, mode, batch, _ = key
        assert r["error"] is None, (key, r["error"])
        assert r["impl"] == ("transformers" if model == "llama" else "lazoo")
        assert r["params"] > 0 and r["peak_mem_GiB"] is None and r["new_tokens"] == 12
        assert r["prefill_ms"] > 0 and r["total_ms"] > r["prefill_ms"] and r["ms_per_token"] > 0, key
        assert len(r["prefill_ms_all"]) == len(r["total_ms_all"]) == 3
        decode_s = (r["total_ms"] - r["prefill_ms"]) / 1e3
        assert r["ms_per_token"] == pytest.approx(decode_s * 1e3 / 11)
        assert r["tokens_per_s"] == pytest.approx(batch * 11 / decode_s)
        assert r["tokens_per_s"] == pytest.approx(batch * 1e3 / r["ms_per_token"])
        static = "StaticCache" if model == "llama" else "LazooCache(static)"
        assert (r["cache"] == static) == (mode == "static"), (key, r["cache"])  # the CPU's default is dynamic
        assert r["first_call_s"] > 0 and r["other_prompt_s"] > 0
        assert r["recompiles_other_prompt"] == 0  # nothing is compiled on the CPU
    table = capsys.readouterr().out
    assert "| model | mode | batch | prompt | prefill ms | ms/token | tokens/s | peak GiB | note |" in table
    table_rows = [line for line in table.splitlines() if line.startswith(("| gated_delta_net |", "| llama |"))]
    assert len(table_rows) == 12
    assert "| llama | eager | 2 | 16 |" in table


def test_prompt_ids_are_the_same_for_every_model():
    a, b = bench.prompt_ids(2, 16, 101, seed=0), bench.prompt_ids(2, 16, 101, seed=0)
    assert a.equal(b) and a.shape == (2, 16) and int(a.max()) < 101
    assert not a.equal(bench.prompt_ids(2, 16, 101, seed=1))


def test_failures_are_recorded_in_rows(tmp_path, monkeypatch, capsys, single_thread):
    """An out-of-memory setting (and the longer prompt after it), a refused compile and an unknown model end up as
    errors in their rows; the other settings still run and the table is printed."""
    real_generate_once = bench.generate_once

    def out_of_memory_at_batch_2(model, ids, mode, new_tokens, cache_length=None, graph_steps=16):
        if ids.shape[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return real_generate_once(model, ids, mode, new_tokens, cache_length)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(bench, "generate_once", out_of_memory_at_batch_2)
    monkeypatch.setattr(torch, "compile", no_compiler)
    _, rows = run(tmp_path, "--models", "sw-gdn,no_such_model", "--modes", "eager,compile", "--prompts", "16,8",
                  "--batch-sizes", "1,2", "--new-tokens", "3", "--repeats", "1")
    settings = by_setting(rows)
    assert len(settings) == len(rows) == 16
    for prompt in (8, 16):
        ok = settings[("sw-gdn", "eager", 1, prompt)]
        assert ok["error"] is None and ok["cache"] == "LazooCache" and ok["prefill_ms"] > 0, ok
        for batch in (1, 2):
            assert settings[("sw-gdn", "compile", batch, prompt)]["error"] == "RuntimeError: no compiler here"
            for mode in ("eager", "compile"):
                bad = settings[("no_such_model", mode, batch, prompt)]
                assert "unknown layout 'no_such_model'" in bad["error"] and bad["prefill_ms"] is None
    # prompts run shortest first: 8 ran out, 16 was not tried
    assert settings[("sw-gdn", "eager", 2, 8)]["error"] == "out of memory"
    skipped = settings[("sw-gdn", "eager", 2, 16)]["error"]
    assert skipped.startswith("out of memory (skipped") and "prompt 8" in skipped
    assert settings[("sw-gdn", "eager", 2, 8)]["tokens_per_s"] is None
    out = capsys.readouterr().out
    assert "| sw-gdn | compile | 1 | 8 | - | - | - | - | RuntimeError: no compiler here |" in out
    assert "| sw-gdn | eager | 2 | 8 | - | - | - | - | out of memory |" in out


def test_fla_models_need_fla_site(tmp_path, capsys):
    out = tmp_path / "never.jsonl"
    with pytest.raises(SystemExit) as stop:
        bench.main([*TINY_ARGS, "--models", "llama,fla:gated_deltanet", "--prompts", "8", "--batch-sizes", "1",
                    "--new-tokens", "2", "--repeats", "1", "--out", str(out)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--fla-site" in err and "fla:gated_deltanet" in err
    assert not out.exists()  # stopped before anything ran


@pytest.fixture
def isolated_fla(monkeypatch):
    """sys.path and the `fla` modules as they were before the test (a fake fla must not outlive it)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    is_fla = lambda name: name == "fla" or name.startswith("fla.")  # noqa: E731
    saved = {name: module for name, module in sys.modules.items() if is_fla(name)}
    for name in saved:
        del sys.modules[name]
    yield
    for name in [name for name in sys.modules if is_fla(name)]:
        del sys.modules[name]
    sys.modules.update(saved)


#: a stand-in for fla: one model type registered on the Auto classes by `import fla.models`, taking fla's
#: field names (num_heads), built on lazoo's classes so it can generate on the CPU
FAKE_FLA_MODELS = '''
from transformers import AutoConfig, AutoModelForCausalLM

from lazoo.models.configuration_lazoo import LazooConfig
from lazoo.models.modeling_lazoo import LazooForCausalLM


class FakeDeltaConfig(LazooConfig):
    model_type = "fake_fla_delta"

    def __init__(self, hidden_size=16, num_hidden_layers=1, num_heads=1, intermediate_size=32, vocab_size=50,
                 **kwargs):
        self.num_heads = num_heads
        super().__init__(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, num_attention_heads=num_heads,
                         intermediate_size=intermediate_size, vocab_size=vocab_size,
                         layer_types=["gated_delta_net"] * num_hidden_layers, **kwargs)


class FakeDeltaForCausalLM(LazooForCausalLM):
    config_class = FakeDeltaConfig


AutoConfig.register(FakeDeltaConfig.model_type, FakeDeltaConfig, exist_ok=True)
AutoModelForCausalLM.register(FakeDeltaConfig, FakeDeltaForCausalLM, exist_ok=True)
'''


def test_fla_models_come_from_fla_site(tmp_path, isolated_fla, single_thread):
    site = tmp_path / "site"
    (site / "fla" / "models").mkdir(parents=True)
    (site / "fla" / "__init__.py").write_text('__version__ = "0.0.fake"\n')
    (site / "fla" / "models" / "__init__.py").write_text(FAKE_FLA_MODELS)
    env, rows = run(tmp_path, "--models", "fla:fake_fla_delta,fla:no_such_type", "--fla-site", str(site),
                    "--prompts", "8", "--batch-sizes", "1", "--new-tokens", "3", "--repeats", "1")
    assert env["fla"] == "0.0.fake" and env["fla_error"] is None
    fake, missing = rows
    assert fake["model"] == "fla:fake_fla_delta" and fake["impl"] == "fla"
    # measured (a tiny CPU model's decode can fall inside the timer's noise: then no rate, and the row says so)
    assert fake["error"] is None and fake["params"] > 0 and fake["total_ms"] > 0, fake
    assert (fake["tokens_per_s"] or 0) > 0 or fake.get("note") == "decode time not above the prefill time", fake
    assert "fla registers no model type 'no_such_type'" in missing["error"]
    # the sizes reach fla's config under fla's field name for the heads (the fake's own default is 1 head)
    model = bench.build_fla("fake_fla_delta", bench.parse_args(TINY_ARGS).sizes, max_len=16)
    assert model.config.num_heads == 2 and model.config.hidden_size == 32 and model.config.tie_word_embeddings


def test_a_broken_fla_site_is_recorded_in_the_fla_rows(tmp_path, isolated_fla, single_thread):
    site = tmp_path / "site"
    (site / "fla").mkdir(parents=True)
    (site / "fla" / "__init__.py").write_text('raise ImportError("this fla needs a GPU")\n')
    env, rows = run(tmp_path, "--models", "fla:gated_deltanet,gated_delta_net", "--fla-site", str(site),
                    "--prompts", "8", "--batch-sizes", "1", "--new-tokens", "2", "--repeats", "1")
    assert env["fla"] is None and "this fla needs a GPU" in env["fla_error"]
    fla_row, lazoo_row = rows
    assert "--fla-site" in fla_row["error"] and "this fla needs a GPU" in fla_row["error"]
    assert lazoo_row["error"] is None and lazoo_row["prefill_ms"] > 0


def test_the_graph_mode(tmp_path, single_thread):
    """lazoo's rounds of decode steps (uncaptured on the CPU) make the N tokens; llama's generate refuses the field."""
    _, rows = run(tmp_path, "--models", "gated_delta_net,llama", "--modes", "graph", "--prompts", "16",
                  "--batch-sizes", "2", "--new-tokens", "6", "--repeats", "1", "--graph-steps", "4")
    settings = by_setting(rows)
    lazoo_row, llama_row = settings["gated_delta_net", "graph", 2, 16], settings["llama", "graph", 2, 16]
    assert lazoo_row["error"] is None and lazoo_row["cache"] == "LazooCache(static), rounds of 4 (uncaptured)"
    assert lazoo_row["total_ms"] > lazoo_row["prefill_ms"] > 0
    assert "decode_steps_per_graph" in llama_row["error"]
