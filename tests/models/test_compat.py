"""The cache under both of its names (transformers 5.24 renamed `past_key_values` / `cache_params` to
`cache`): forwards take any of them, outputs answer to both without a deprecation warning, Trainer's
evaluation leaves the cache out of the predictions, and the declared range matches the oldest lock."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
import transformers
from conftest import random_ids, tiny_model
from packaging.requirements import Requirement
from packaging.version import Version

from lazoo.models import LazooCache
from lazoo.models.compat import CACHE_FIELD

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    return tiny_model("gated_delta_net")


@pytest.fixture
def transformers_warnings():
    """Warnings logged by transformers while the test runs (its deprecation notes go through logging)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, root = Keep(level=logging.WARNING), logging.getLogger("transformers")
    root.addHandler(handler)
    yield records
    root.removeHandler(handler)


def test_the_cache_field_is_the_installed_releases():
    expected = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"
    assert CACHE_FIELD == expected


@pytest.mark.parametrize("name", ["cache", "past_key_values", "cache_params"])
def test_every_cache_name_continues_the_same_state(model, name):
    ids = random_ids(2, 9, seed=3)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        prefix = model(ids[:, :6], use_cache=True)
        assert isinstance(prefix.cache, LazooCache)
        rest = model(ids[:, 6:], use_cache=True, **{name: prefix.cache})
    assert rest.cache is prefix.cache and prefix.cache.seen_positions == 9
    torch.testing.assert_close(rest.logits, full[:, 6:], rtol=1e-5, atol=1e-5)


def test_two_different_caches_are_refused(model):
    ids = random_ids(1, 4, seed=4)
    with torch.no_grad():
        a, b = model(ids, use_cache=True).cache, model(ids, use_cache=True).cache
        with pytest.raises(ValueError, match="different caches"):
            model(ids[:, :1], cache=a, past_key_values=b)
        model(ids[:, :1], cache=a, past_key_values=a)  # the same object under two names is fine


def test_outputs_answer_to_both_names_without_a_deprecation_warning(model, transformers_warnings):
    with torch.no_grad():
        out = model(random_ids(1, 5, seed=5), use_cache=True)
        base = model.model(random_ids(1, 5, seed=5), use_cache=True)
    for o in (out, base):
        assert isinstance(o.cache, LazooCache) and o.past_key_values is o.cache
        assert o[CACHE_FIELD] is o.cache
    assert not [m for m in transformers_warnings if "deprecated" in m], transformers_warnings


def test_generate_on_this_release_warns_nothing_about_the_cache(model, transformers_warnings):
    ids = random_ids(2, 6, seed=6)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert not [m for m in transformers_warnings if "cache" in m.lower()], transformers_warnings


def test_trainer_predictions_leave_the_cache_out(model, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids = random_ids(4, 8, seed=7)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=2, report_to=[],
                             use_cpu=True)
    assert model.config.use_cache  # an evaluation forward builds a cache: it must not become a prediction
    prediction = Trainer(model=model, args=args).predict(data)
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    assert logits.shape == (4, 8, model.config.vocab_size)
    assert "cache" in model.config.keys_to_ignore_at_inference
    assert "past_key_values" in model.config.keys_to_ignore_at_inference


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_generate_continues_a_cache_passed_under_either_name(model, name):
    ids = random_ids(2, 12, seed=8)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, **kw)
    with torch.no_grad():
        cache = model(ids[:, :8], use_cache=True).cache
    continued = model.generate(ids, **kw, **{name: cache})
    assert torch.equal(continued, reference)
    assert cache.seen_positions == 12 + 4  # the prompt once, then every new token but the last


# ----------------------------------------------------------------------------- the declared range
def _declared() -> dict[str, Requirement]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {Requirement(r).name.lower(): Requirement(r) for r in reqs}


def _lock(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def _floor(req: Requirement) -> str | None:
    return next((s.version for s in req.specifier if s.operator == ">="), None)


def test_the_oldest_lock_pins_every_declared_floor():
    """requirements/oldest.lock is the range's floor: each dependency at the lowest release pyproject.toml
    allows (torch's floor, 2.11, runs on the GPU machine; the CPU lock takes the CPU build on disk)."""
    oldest = _lock("oldest.lock")
    for name, req in _declared().items():
        floor = _floor(req)
        if floor is None or name == "torch":
            continue
        assert name in oldest, f"{name} is missing from requirements/oldest.lock"
        assert Version(oldest[name]) >= Version(floor), f"{name}: oldest.lock has {oldest[name]} < floor {floor}"
        assert Version(oldest[name]).release[:len(Version(floor).release)] == Version(floor).release, \
            f"{name}: oldest.lock has {oldest[name]}, pyproject.toml's floor is {floor}"


def test_both_locks_satisfy_the_declared_ranges():
    declared = _declared()
    for lock in ("test.lock", "oldest.lock"):
        for name, version in _lock(lock).items():
            if name in declared:
                assert declared[name].specifier.contains(version, prereleases=True), \
                    f"{lock}: {name}=={version} is outside pyproject.toml's {declared[name]}"



def test_return_dict_false_gives_tuples_as_in_transformers():
    model = tiny_model("gated_delta_net")
    ids = random_ids(1, 9, seed=3)
    with torch.no_grad():
        full = model(ids, labels=ids)
        as_tuple = model(ids, labels=ids, return_dict=False)
        base = model.model(ids, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], full.loss) and torch.equal(as_tuple[1], full.logits)
    assert isinstance(base, tuple) and base[0].shape == (1, 9, model.config.hidden_size)
    model.config.return_dict = False  # the config's setting too; the model's own inner call still reads fields
    with torch.no_grad():
        assert torch.equal(model(ids)[0], full.logits)
