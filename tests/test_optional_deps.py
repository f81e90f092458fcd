"""`import lazoo` never fails because an optional piece is missing (torchvision, pycocotools, lm-eval,
matplotlib, scikit-learn, peft, triton): the models build and generate without them, and the piece that
needs one names it when it is used. Runs in a fresh interpreter over a copy of site-packages (links) that
lacks those packages and their metadata, so that libraries probing for them see them as not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

OPTIONAL = ["torchvision", "pycocotools", "lm_eval", "matplotlib", "sklearn", "peft", "triton"]
#: site-packages entries (modules, their data and their .dist-info) left out, by name before "-" or "."
LEFT_OUT = {"torchvision", "pycocotools", "lm_eval", "matplotlib", "mpl_toolkits", "sklearn", "scikit_learn",
            "peft", "triton"}

SCRIPT = textwrap.dedent('''
    import json, site, sys

    site.addsitedir(sys.argv[2])  # the copy of site-packages without the optional packages (python -S)
    BLOCKED = set(sys.argv[1].split(","))
    import importlib.util
    assert not [m for m in BLOCKED if importlib.util.find_spec(m) is not None], "an optional package is visible"
    import torch

    import lazoo
    import lazoo.cli, lazoo.data, lazoo.eval, lazoo.vision  # noqa: F401  (all importable)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    out = {"imported": sorted({m.split(".")[0] for m in sys.modules} & BLOCKED)}
    prompt = torch.tensor([[5, 17, 42, 8, 9, 23], [0, 0, 61, 7, 30, 12]])
    mask = (prompt != 0).long()
    same = {}
    for name in lazoo.list_mechanisms():
        config = AutoConfig.for_model(f"lazoo_{name}", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=64, sliding_window=4)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        cached = model.generate(prompt, use_cache=True, **kw)
        same[name] = torch.equal(cached, model.generate(prompt, use_cache=False, **kw))
    out["cache_equals_no_cache"] = same

    errors = {}
    def error_of(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None

    q = torch.randn(1, 8, 2, 16)
    errors["triton"] = error_of(lambda: lazoo.ops.linear_attention(q, q, q, backend="triton"))
    from lazoo.eval.detection import coco_map
    errors["pycocotools"] = error_of(lambda: coco_map([], {"images": [], "annotations": [], "categories": []}))
    errors["lm_eval"] = error_of(lambda: lazoo.eval.evaluate(None, ["lazoo_mqar"], "/nonexistent"))
    errors["sklearn"] = error_of(lambda: lazoo.data.digits_dataset())
    out["errors"] = errors
    print("RESULT" + json.dumps(out))
''')


def site_packages_without_optional(folder) -> str:
    """A folder of links to every site-packages entry except the optional packages'."""
    import site

    for directory in site.getsitepackages():
        for entry in os.listdir(directory) if os.path.isdir(directory) else []:
            if entry.split("-")[0].split(".")[0].lower() not in LEFT_OUT and not (folder / entry).exists():
                (folder / entry).symlink_to(os.path.join(directory, entry))
    return str(folder)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("TRITON_INTERPRET", None)
    site_dir = site_packages_without_optional(tmp_path_factory.mktemp("site"))
    proc = subprocess.run([sys.executable, "-S", "-c", SCRIPT, ",".join(OPTIONAL), site_dir], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path_factory.mktemp("optional"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_lazoo_imports_and_generates_without_the_optional_packages(result):
    assert result["imported"] == []
    assert result["cache_equals_no_cache"] and all(result["cache_equals_no_cache"].values()), \
        result["cache_equals_no_cache"]


@pytest.mark.parametrize("piece, words", [
    ("triton", ["Triton is not installed"]),
    ("pycocotools", ["pycocotools"]),
    ("lm_eval", ["lm-eval"]),
    ("sklearn", ["scikit-learn"]),
])
def test_the_piece_that_needs_a_missing_package_names_it(result, piece, words):
    message = result["errors"][piece]
    assert message is not None, f"{piece}: no error although it is missing"
    assert all(w in message for w in words), message
