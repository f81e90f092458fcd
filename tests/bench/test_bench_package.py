"""lazoo.bench as a package: every benchmark imports without a GPU and describes itself as its `lazoo bench`
parser does, the parser's static lists are the modules' own, and the wheel ships lazoo.bench but not the
experiments."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

from lazoo_cli.bench import BENCHMARKS, GENERATE_DTYPES, GENERATE_MODES, MODEL_SIZES, bench_parser

ROOT = Path(__file__).resolve().parents[2]
HARNESSES = [*BENCHMARKS, "profile_op", "profile_decode", "kernel_resources"]


@pytest.mark.parametrize("name", HARNESSES)
def test_every_harness_imports_without_a_gpu_and_has_a_main(name):
    module = importlib.import_module(f"lazoo.bench.{name}")
    assert callable(module.main)


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_the_parser_describes_the_benchmark_as_its_module_does(name):
    module = importlib.import_module(f"lazoo.bench.{name}")
    assert bench_parser(name).description == module.__doc__.splitlines()[0]


def test_the_static_lists_are_the_modules_own():
    from lazoo.bench import generate, models

    assert list(GENERATE_DTYPES) == list(generate.DTYPES) and GENERATE_MODES == generate.MODES
    assert models.MODEL_SIZES is MODEL_SIZES


def test_the_wheel_ships_the_benchmarks_and_not_the_experiments():
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = set(find_packages(where=str(ROOT / find["where"][0]), include=find.get("include", ["*"])))
    assert {"lazoo", "lazoo.bench", "lazoo_cli"} <= packages
    assert not any(p.startswith(("experiments", "scripts", "tests")) for p in packages)
    assert (ROOT / "experiments").is_dir() and not (ROOT / "src" / "experiments").exists()


def test_packed_training_step_runs_packed_and_batched_and_clears_the_gradients():
    """lazoo.bench.models.packed_training_step on the CPU: both forms step through forward + backward (the packed one
    through the model's packed path), and no gradient is left behind."""
    from lazoo.bench.models import TINY_SIZES, lazoo_model, packed_training_step

    model = lazoo_model("gated_delta_net", TINY_SIZES)
    step = packed_training_step(model, documents=3, length=8, device="cpu")
    calls = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(kwargs), with_kwargs=True)
    for batched in (False, True):
        step(batched)
        assert all(p.grad is None for p in model.parameters())
    handle.remove()
    packed, batched = calls
    assert packed["input_ids"].shape == (1, 24) and packed["position_ids"][0, :9].tolist() == [*range(8), 0]
    assert batched["input_ids"].shape == (3, 8) and "position_ids" not in batched
