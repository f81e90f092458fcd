"""The mechanism registry (`lazoo.registry`): every mechanism is declared once and everything else is derived.

- each declaration says what the code does (the op its mixer calls, the Triton kernels that op reaches);
- a mechanism declared in a file outside lazoo (tests/mechanisms/toy_decay.py) gets config and model classes,
  Auto registration, generation, Trainer and the `trust_remote_code` export, with no other edit;
- the package has no import circle and no module imports another module's private names.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Trainer,
    TrainingArguments,
)

import lazoo
from lazoo import ops
from lazoo.models.card import render_model_card
from lazoo.registry import Mechanism

SRC = Path(lazoo.__file__).resolve().parent
TOY_FILE = Path(__file__).parent / "mechanisms" / "toy_decay.py"


# ----------------------------------------------------------------------------- declarations vs the code
def _ops_called(mixer_cls) -> set[str]:
    """The `lazoo.ops` functions a mixer class's `mix` / `forward` call (`ops.<name>(` in their source, or the
    op named after the mechanism for `getattr(ops, self.mechanism)`)."""
    from lazoo.layers.mixers import TokenMixer

    found = set()
    for method in (getattr(mixer_cls, "mix", None), mixer_cls.forward):
        if method is None or method is TokenMixer.forward:
            continue
        source = inspect.getsource(method)
        found |= set(re.findall(r"\bops\.(\w+)\(", source))
        if "getattr(ops, self.mechanism)" in source:
            found.add(mixer_cls.mechanism)
    return found


def _kernel_modules(module_name: str, function: str, seen: set) -> set[str]:
    """The `lazoo.kernels.*` modules `module_name.function` can reach: the kernel imports in its body and,
    recursively, in the functions it calls (same module, or imported from a sibling op module), and the kernel
    modules those import."""
    if (module_name, function) in seen:
        return set()
    seen.add((module_name, function))
    module = importlib.import_module(module_name)
    tree = ast.parse(inspect.getsource(module))
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    imported = {}  # name -> the sibling module it comes from
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                imported[alias.asname or alias.name] = f"lazoo.ops.{node.module}"
    found = set()
    for node in ast.walk(defs.get(function, ast.Module(body=[], type_ignores=[]))):
        if isinstance(node, ast.ImportFrom) and node.level == 2 and (node.module or "").startswith("kernels"):
            if node.module == "kernels":
                found.update(f"lazoo.kernels.{a.name}" for a in node.names)
            else:
                found.add(f"lazoo.{node.module}")
        elif isinstance(node, ast.Name):
            if node.id in defs and node.id != function:
                found |= _kernel_modules(module_name, node.id, seen)
            elif node.id in imported:
                found |= _kernel_modules(imported[node.id], node.id, seen)
    found = {k for k in found if importlib.util.find_spec(k) is not None}
    # private helpers (_tiles, _launch, _segments, _utils, ...) are shared plumbing and limits a table: not kernels
    return {k for k in _with_kernel_imports(found)
            if not k.rsplit(".", 1)[1].startswith("_") and k != "lazoo.kernels.limits"}


def _with_kernel_imports(modules: set[str]) -> set[str]:
    """``modules`` and the sibling kernel modules they import (anywhere in them, e.g. inside a launcher),
    recursively: a kernel module may call another one."""
    todo, out = list(modules), set(modules)
    while todo:
        module = importlib.import_module(todo.pop())
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), module.__package__)
                names = [base] if node.module else [f"{base}.{a.name}" for a in node.names]
                for name in names:
                    if name not in out and importlib.util.find_spec(name) is not None:
                        out.add(name)
                        todo.append(name)
    return out


@pytest.mark.parametrize("name", lazoo.list_mechanisms())
def test_the_declaration_says_what_the_code_does(name):
    m = lazoo.registry.get(name)
    assert _ops_called(m.mixer) == {m.op}, f"{name}: the mixer calls {_ops_called(m.mixer)}, declared {m.op!r}"
    fn = getattr(ops, m.op)
    fn = getattr(fn, "__wrapped__", fn)  # the autocast wrapper
    kernels = _kernel_modules(fn.__module__, fn.__name__, set())
    assert kernels == set(m.kernels), f"{name}: the op reaches {sorted(kernels)}, declared {list(m.kernels)}"
    assert ("triton" in m.backends) == bool(kernels)


@pytest.mark.parametrize("name", lazoo.list_mechanisms())
def test_everything_is_derived_from_the_declaration(name):
    m = lazoo.registry.get(name)
    config = AutoConfig.for_model(m.model_type, vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, **m.tiny_options)
    assert type(config).__name__ == f"{m.class_prefix}Config" and config.layer_types == [name]
    assert type(config) is lazoo.MECHANISM_CONFIGS[name]
    for key in m.defaults:  # every option is a typed field of the mechanism's config, documented in its class
        assert key == "use_short_conv" or hasattr(config, key)
        assert f"    {key} = " in type(config).__doc__
    classes = lazoo.MODEL_CLASSES[m.model_type]
    assert [c.__name__ for c in classes[1:]] == [f"{m.class_prefix}Model", f"{m.class_prefix}ForCausalLM"]
    from lazoo.models import modeling_mechanisms

    assert getattr(modeling_mechanisms, f"{m.class_prefix}ForSequenceClassification").config_class is type(config)
    card = render_model_card(config)
    assert m.title in card and m.source in card


# ----------------------------------------------------------------------------- a mechanism added from outside
@pytest.fixture(scope="module")
def toy():
    """tests/mechanisms/toy_decay.py imported (which registers `toy_decay`), unregistered afterwards."""
    spec = importlib.util.spec_from_file_location("toy_decay_mechanism", TOY_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the export reads its source through sys.modules
    spec.loader.exec_module(module)
    yield module
    lazoo.registry.unregister("toy_decay")
    del sys.modules[spec.name]


def toy_model(seed=0, **overrides):
    config = AutoConfig.for_model("lazoo_toy_decay", vocab_size=101, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def test_a_mechanism_from_a_test_file_gets_every_class(toy, single_thread):
    assert "toy_decay" in lazoo.list_mechanisms()
    config = AutoConfig.for_model("lazoo_toy_decay", hidden_size=16, num_attention_heads=2, decay=0.5)
    assert type(config).__name__ == "LazooToyDecayConfig" and config.decay == 0.5
    assert "decay = 0.9: γ, the state's decay per token" in type(config).__doc__
    assert type(AutoModel.from_config(config)).__name__ == "LazooToyDecayModel"
    assert type(AutoModelForCausalLM.from_config(config)).__name__ == "LazooToyDecayForCausalLM"
    seqcls = AutoModelForSequenceClassification.from_config(config)
    assert type(seqcls).__name__ == "LazooToyDecayForSequenceClassification"
    with pytest.raises(ValueError, match="decay"):
        AutoConfig.for_model("lazoo_toy_decay", decay="fast")  # options are type-checked like lazoo's own
    hybrid = AutoConfig.for_model("lazoo_hybrid", layer_types=["sliding_window", "toy_decay"], num_hidden_layers=2,
                                  mixer_kwargs={"toy_decay": {"decay": 0.7}})
    assert AutoModelForCausalLM.from_config(hybrid).model.layers[1].mixer.options["decay"] == 0.7


def test_a_mechanism_from_a_test_file_generates_with_its_cache(toy, single_thread):
    model = toy_model()
    prompt = torch.tensor([[5, 17, 42, 8, 99, 23, 4], [0, 0, 0, 61, 7, 30, 12]])
    mask = (prompt != 0).long()
    with torch.no_grad():
        cached = model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False)
        uncached = model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=False)
        alone = model.generate(prompt[1:, 3:], max_new_tokens=6, do_sample=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[1, 7:], alone[0, 4:])  # a pad never changes a real token


def test_a_mechanism_from_a_test_file_trains_with_trainer(toy, tmp_path, single_thread):
    model = toy_model().train()
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(1, 101, (8,), generator=gen)
    rows = [{"input_ids": torch.roll(base, i).repeat(3), "labels": torch.roll(base, i).repeat(3)} for i in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=30,
                             learning_rate=3e-3, logging_steps=5, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < 0.7 * losses[0], losses


def test_a_mechanism_from_a_test_file_is_exported_with_the_model(toy, tmp_path):
    from export_helpers import PROMPT, run_loader

    model = toy_model()
    folder = tmp_path / "toy"
    model.save_pretrained(folder)
    assert (folder / "lazoo_extension_toy_decay_mechanism.py").is_file()
    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(prompt, attention_mask=(prompt != 0).long()).logits
    results = run_loader([str(folder)], tmp_path)
    assert results.pop("lazoo_imported") == []
    torch.testing.assert_close(torch.tensor(results[str(folder)]["logits"]), logits, rtol=1e-5, atol=1e-5)


def test_a_mechanism_in_a_notebook_cell_cannot_be_exported(toy, tmp_path):
    class NotebookMixer(toy.ToyDecayMixer):
        mechanism = "toy_notebook"

    NotebookMixer.__module__ = "__main__"
    lazoo.registry.register(Mechanism(name="toy_notebook", mixer=NotebookMixer, op="toy_decay", title="t",
                                      equation="e", source="s", state="S", backends=("recurrent",)))
    try:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "lazoo_toy_notebook", hidden_size=16, num_attention_heads=2, num_hidden_layers=1, vocab_size=50))
        with pytest.raises(ValueError, match="toy_notebook.*no source file"):
            model.save_pretrained(tmp_path / "nb")
    finally:
        lazoo.registry.unregister("toy_notebook")
    assert "toy_notebook" not in lazoo.list_mechanisms() and "lazoo_toy_notebook" not in lazoo.MODEL_CLASSES


@pytest.mark.parametrize("change,message", [
    ({"name": "Toy"}, "lower_snake_case"),
    ({"backends": ("cuda",)}, "backends must be"),
    ({"backends": ("recurrent", "triton")}, "kernel modules"),
    ({"tiny_options": {"speed": 1}}, "unknown options"),
])
def test_a_bad_declaration_names_the_problem(toy, change, message):
    fields = dict(name="toy_decay", mixer=toy.ToyDecayMixer, op="toy_decay", title="t", equation="e", source="s",
                  state="S", backends=("recurrent",))
    with pytest.raises(ValueError, match=message):
        Mechanism(**{**fields, **change})


def test_a_second_declaration_of_a_name_is_refused(toy):
    class Other(toy.ToyDecayMixer):
        pass

    with pytest.raises(ValueError, match="already registered"):
        lazoo.registry.register(Mechanism(name="toy_decay", mixer=Other, op="toy_decay", title="t", equation="e",
                                          source="s", state="S", backends=("recurrent",)))


# ----------------------------------------------------------------------------- the package's imports
def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _import_edges():
    """(module -> lazoo modules it imports, anywhere in it) and the private names imported across modules."""
    modules, edges, private = _modules(), {}, []
    for name, (path, is_package) in modules.items():
        edges[name] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges[name] |= {a.name for a in node.names if a.name in modules}
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "lazoo":
                continue
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    edges[name].add(f"{target}.{alias.name}")
                    continue
                edges[name].add(target)
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    private.append(f"{name} imports {alias.name} from {target}")
    return edges, private


def test_no_module_imports_another_modules_private_names():
    assert _import_edges()[1] == []


def test_no_import_circle_inside_lazoo():
    edges, _ = _import_edges()
    state, stack, cycles = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert cycles == [], "import circles: " + "; ".join(" -> ".join(c) for c in cycles)
