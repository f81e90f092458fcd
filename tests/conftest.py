"""Shared helpers for the model-level tests: tiny configs and models, the corpus, a small tokenizer."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may touch the Hub

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import lazoo

#: every mechanism, then "hybrid" (a `lazoo_hybrid` model mixing attention and a recurrent mixer)
MECHANISMS = lazoo.list_mechanisms()
ALL_MODELS = MECHANISMS + ["hybrid"]
HYBRID_LAYERS = ["sliding_window", "vla"]
ATTENTION = ("softmax", "sliding_window")

VOCAB = 101
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    # smaller than the prompts + generations below, so the window (and the cache's trimming) matters
    sliding_window=6,
)


def load_experiment(name: str):
    """Import ``experiments/<name>.py`` as a module (the experiments are scripts, not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tiny_config(name: str, **overrides):
    """`AutoConfig.for_model("lazoo_<name>", ...)` with tiny sizes ("hybrid": sliding window + VLA)."""
    kwargs = {**TINY, **overrides}
    if name in MECHANISMS:
        # each mechanism's tiny options (its declaration in lazoo.registry): chunks, refreshes and mini-batches
        # small enough that the tests' 20-90 token sequences cross them many times (a VLA refresh every 7 real
        # tokens, strong enough to show in the logits; OVQ dictionaries that grow and merge; partial chunks)
        for key, value in lazoo.registry.get(name).tiny_options.items():
            kwargs.setdefault(key, value)
    if name == "hybrid":
        kwargs.setdefault("layer_types", list(HYBRID_LAYERS))
        kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
    return AutoConfig.for_model(f"lazoo_{name}", **kwargs)


@torch.no_grad()
def perturb_(model, scale: float = 0.05, seed: int = 0):
    """Add noise to every parameter, so no weight keeps its init value (identity maps, unit norms):
    a loader that re-initialises instead of loading, or a path that skips a weight, then shows."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device))
    return model


def tiny_model(name: str, seed: int = 0, perturb: bool = True, eval: bool = True, **overrides):
    """A seeded fp32 tiny causal LM of mechanism `name` (or "hybrid")."""
    attn = overrides.pop("attn_implementation", None)
    config = tiny_config(name, **overrides)
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_config(config, **kwargs)
    if perturb:
        perturb_(model, seed=seed + 1)
    return model.eval() if eval else model.train()


def random_ids(*shape, seed: int, low: int = 1, high: int = VOCAB) -> torch.Tensor:
    """Fresh random token ids (0 is kept free for padding)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=gen)


def left_padded(batch: int = 3, length: int = 9, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids and an attention mask with rows 0 and 2 padded on the left (3 and 6 pads; batch >= 3)."""
    ids = random_ids(batch, length, seed=seed)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :6] = 0
    return ids, mask


@pytest.fixture
def kernel_cache_env(monkeypatch):
    """The kernel-cache variables unset for the test and put back after it (their absence too): what the code under
    test writes to os.environ reaches no later test."""
    for name in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "TILELANG_CACHE_DIR"):
        monkeypatch.setenv(name, "")  # recorded, so that undoing it removes a variable that was not set
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _stop_after_a_lost_cuda_context(request):
    """A GPU test whose kernel faulted ends its process (``cuda_guard``), so no later test inherits the fault."""
    yield
    if request.node.get_closest_marker("gpu") is not None:
        from cuda_guard import lost_cuda_context, stop_process

        why = lost_cuda_context()
        if why:
            stop_process(request.node.nodeid, why)


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core CI machine OpenMP threads
    that wait on each other make the run several times slower: use one thread, then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- corpus and tokenizer
@pytest.fixture(scope="session")
def chapters():
    import lazoo.data  # needs `datasets`, which the GPU machine lacks: imported only where used

    return lazoo.data.load_default_corpus()


@pytest.fixture(scope="session")
def tokenizer(chapters):
    """A byte-level BPE of 320 tokens trained on 300 KJV chapters."""
    import lazoo.data

    return lazoo.data.train_tokenizer(chapters[:300], vocab_size=320)


@pytest.fixture(scope="session")
def lm_blocks(chapters, tokenizer):
    """256 real 32-token training blocks (input_ids + labels) from chapters the tokenizer saw."""
    from datasets import Dataset

    import lazoo.data

    blocks = lazoo.data.tokenize_and_chunk(Dataset.from_dict({"text": chapters[:40]}), tokenizer, block_size=32)
    assert len(blocks) >= 256, len(blocks)
    return blocks.shuffle(seed=0).select(range(256))


# ----------------------------------------------------------------------------- the Triton interpreter
# Every test named ``test_interp_*`` needs TRITON_INTERPRET=1 set before triton is imported, so they run in one
# child process (``tests/interpreter_run.py``), started as soon as collection ends so that it runs beside
# the other tests; ``tests/test_interpreter.py`` checks its results, one test per file, after everything else.
INTERPRETER_CHECK = "test_kernels_in_interpreter"
_interpreter_run = None


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: getattr(item, "originalname", "") == INTERPRETER_CHECK)  # stable: last, in order


def pytest_collection_finish(session):
    global _interpreter_run
    from interpreter_run import InterpreterRun

    from lazoo.kernels._utils import interpreter_ready

    checks = [item for item in session.items if getattr(item, "originalname", "") == INTERPRETER_CHECK]
    if not checks or interpreter_ready() or session.config.option.collectonly:
        return
    files = sorted({item.callspec.params["path"] for item in checks})
    kinds = {item.callspec.params["kind"] for item in checks}
    markexpr = {frozenset({"default"}): "not slow and not gpu", frozenset({"slow"}): "slow and not gpu"}.get(
        frozenset(kinds), "not gpu")
    _interpreter_run = InterpreterRun(files, markexpr)


def pytest_unconfigure(config):
    if _interpreter_run is not None:
        _interpreter_run.stop()


@pytest.fixture(scope="session")
def interpreter_run():
    """The session's interpreter run (None when this process interprets: its tests then run here directly)."""
    return _interpreter_run
