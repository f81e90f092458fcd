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
