"""`trust_remote_code` export: a flat, self-contained copy of lazoo's model code next to the weights.

The `save_pretrained` of lazoo's configs (which a model's `save_pretrained` calls) and of its image processor call
`export_for_save(obj, folder)`: it sets the object's `auto_map` (`auto_map_for`) and writes the code the saved
folder needs (`export_remote_code`), so every saved lazoo model or processor (and `push_to_hub`, which saves through
`save_pretrained`) loads with

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)          # a language model
    AutoModelForObjectDetection / AutoModelForImageClassification / AutoModel    # a YOLO-LAT model
    AutoImageProcessor.from_pretrained(folder, trust_remote_code=True)            # its image processor

in a process that never imports lazoo, or where lazoo is not installed at all (a YOLO-LAT folder's `auto_map` names
AutoBackbone too, which transformers 5.17-5.24 follow only for a Hub repo: on a local path `AutoBackbone` asks the Hub
whether it is a repo before reading anything, and fails). Each kind of folder carries the
closure of its own entry modules (`LANGUAGE_ENTRIES`, `VISION_MODEL_ENTRIES`, `VISION_PROCESSOR_ENTRIES`); a
model and its processor saved into one folder carry both.

transformers copies the module named in `config.json`'s `auto_map` and, recursively, the modules it
imports relatively (`from .x import y`, a plain file `x.py` in the same folder; packages and subfolders
are not supported). lazoo is a package tree, so the export writes flat copies of the modules the model
needs, read from the installed sources at save time (so later edits of the ops are picked up):

    configuration_lazoo.py, modeling_lazoo.py     lazoo/models/*.py (the names in `auto_map`)
    configuration_mechanisms.py, modeling_mechanisms.py
    configuration_yolo_lat.py, modeling_yolo_lat.py, image_processing_yolo_lat.py   lazoo/vision/*.py
    lazoo_models_cache.py                         lazoo/models/cache.py
    lazoo_layers_mixers.py, lazoo_layers_mixers_vla.py, ...
    lazoo_ops.py, lazoo_ops_backend.py, lazoo_ops_delta.py, ...

with every relative (or absolute `lazoo.`) import rewritten to the flat names:
`from ..layers.mixers import X` -> `from .lazoo_layers_mixers import X`, and a module import
`from ... import ops` -> `from . import lazoo_ops as ops` (preceded by a `from .lazoo_ops import ...`
line, the form transformers scans for). The closure is found from the import statements themselves
(`ast`), so a new mixer or op module is exported without a change here. A mechanism declared outside lazoo (a
user's own mixer module, registered with `lazoo.registry.register`) that the saved model uses has its module
exported as well (`lazoo_extension_<module>.py`, imported at the end of the exported mixers package); it must import
lazoo absolutely.

Every exported file opens with `EXPORT_HEADER`; the export overwrites only such files and refuses (before
writing anything) a same-named file without it, which the user made.

The exported copy is the PyTorch (recurrent / chunk) code only: lazoo's Triton kernels (`lazoo.kernels`)
are not copied, except the table of their limits (`lazoo.kernels.limits`, no Triton), which the ops read. Imports
of them become `raise ImportError(...)`, and the exported `resolve_backend` never picks "triton" (auto uses the
chunk form, logging once why on CUDA; a forced "triton" raises a clear error).
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

#: the lazoo source tree (src/lazoo)
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lazoo"

#: the modules whose classes a language model's `auto_map` names (the hybrid's, and every mechanism's); they keep
#: their names in the exported folder
LANGUAGE_ENTRIES = {"lazoo.models.configuration_lazoo": "configuration_lazoo",
                    "lazoo.models.modeling_lazoo": "modeling_lazoo",
                    "lazoo.models.configuration_mechanisms": "configuration_mechanisms",
                    "lazoo.models.modeling_mechanisms": "modeling_mechanisms"}
#: those of a YOLO-LAT model's `auto_map` (config.json), and of its image processor's (preprocessor_config.json)
VISION_MODEL_ENTRIES = {"lazoo.vision.configuration_yolo_lat": "configuration_yolo_lat",
                        "lazoo.vision.modeling_yolo_lat": "modeling_yolo_lat"}
VISION_PROCESSOR_ENTRIES = {"lazoo.vision.image_processing_yolo_lat": "image_processing_yolo_lat"}
#: every entry module and its exported name
ENTRY_MODULES = {**LANGUAGE_ENTRIES, **VISION_MODEL_ENTRIES, **VISION_PROCESSOR_ENTRIES}
#: modules never exported (their imports raise ImportError in the exported copy): the Triton kernels, and
#: the export and card writers themselves (a model loaded from the folder is re-saved by transformers' own
#: `trust_remote_code` machinery, which copies these flat files)
SKIPPED_PACKAGES = ("lazoo.kernels", "lazoo.models.export", "lazoo.models.card")
#: the modules of the skipped packages that are exported all the same (they import no Triton): the kernels' limits,
#: which the ops read, and the tables kept on a `cu_seqlens` tensor, which the packing checks use
EXPORTED_ANYWAY = ("lazoo.kernels.limits", "lazoo.kernels._tensor_cache")

NO_TRITON_REASON = ("lazoo's Triton kernels are not part of this exported model folder "
                    "(install lazoo to use them)")


def _missing(module: str) -> str:
    """The statement that replaces an import of a module that is not exported."""
    message = f"{module} is not part of this exported model folder (install lazoo to use it)"
    return f"raise ImportError({message!r})"


#: how every exported file begins: the export overwrites a file of its names only when it starts so
EXPORT_HEADER = "# Exported by lazoo from "
_HEADER = (EXPORT_HEADER + "{source} for `trust_remote_code` loading: a flat copy with rewritten\n"
           "# imports (see lazoo.models.export). Edit the lazoo sources, not this file.\n")

#: appended to the exported `lazoo.ops.backend`: no Triton path in the exported copy
_NO_TRITON_PATCH = '''

# ---- added by lazoo's export: this folder has the PyTorch forms only (no Triton kernels) ----
_EXPORT_NO_TRITON = {reason!r}
_resolve_backend_with_kernels = resolve_backend


def resolve_backend(op, backend, device, triton_unsupported=NO_KERNEL, *args, **kwargs):
    """The lazoo `resolve_backend`, with the Triton kernels always reported as unavailable."""
    return _resolve_backend_with_kernels(op, backend, device, triton_unsupported or _EXPORT_NO_TRITON,
                                         *args, **kwargs)
'''

# transformers' own patterns (transformers.dynamic_module_utils.get_relative_imports)
_RELATIVE_IMPORT_PATTERNS = (re.compile(r"^\s*import\s+\.(\S+)\s*$", re.MULTILINE),
                             re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE))


# ----------------------------------------------------------------------------- module resolution
#: modules outside lazoo that declare a mechanism a saved model uses (a user's or a test's own mixer):
#: module name -> source file, set by `exported_sources` for the duration of one export
_extensions: dict[str, Path] = {}
#: the package whose exported copy imports the extension modules (they register their mechanisms on import)
_EXTENDED_PACKAGE = "lazoo.layers.mixers"


def _module_file(module: str) -> Path | None:
    """The source file of lazoo module `module` (a package's `__init__.py`) or of an extension module, or None
    if there is none."""
    if module in _extensions:
        return _extensions[module]
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = PACKAGE_ROOT.joinpath(*parts[1:])
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


def _is_package(module: str) -> bool:
    f = _module_file(module)
    return f is not None and f.name == "__init__.py"


def flat_name(module: str) -> str:
    """The exported file name (without `.py`) of lazoo module `module` (or of an extension module)."""
    if module in ENTRY_MODULES:
        return ENTRY_MODULES[module]
    if module in _extensions:
        return f"{PACKAGE}_extension_" + module.replace(".", "_")
    return module.replace(".", "_")


def _is_skipped(module: str) -> bool:
    if module in EXPORTED_ANYWAY:
        return False
    return any(module == p or module.startswith(p + ".") for p in SKIPPED_PACKAGES)


def _absolute(module: str, node: ast.ImportFrom) -> str | None:
    """The absolute module an `ImportFrom` node refers to, or None if it is not a lazoo import."""
    if node.level == 0:
        name = node.module or ""
        return name if name == PACKAGE or name.startswith(PACKAGE + ".") else None
    if module in _extensions:
        raise ValueError(f"{module}: the module declaring a mechanism outside lazoo must import lazoo absolutely "
                         f"(`from lazoo... import ...`) to be exported; it has a relative import (line {node.lineno})")
    package = module if _is_package(module) else module.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 > len(parts) - 1:
        raise ValueError(f"{module}: relative import beyond the lazoo package (level {node.level})")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


# ----------------------------------------------------------------------------- rewriting
def _rewrite_import(module: str, node: ast.stmt, needed: set[str]) -> list[str] | None:
    """Replacement lines (no indentation) for a lazoo import statement, or None to keep it."""
    if isinstance(node, ast.Import):
        if any(a.name == PACKAGE or a.name.startswith(PACKAGE + ".") for a in node.names):
            raise ValueError(f"{module}: `import {', '.join(a.name for a in node.names)}` cannot be exported; "
                             "use a relative `from ... import ...`")
        return None
    if not isinstance(node, ast.ImportFrom):
        return None
    target = _absolute(module, node)
    if target is None:
        return None
    if _is_skipped(target):
        return [_missing(target)]
    if _module_file(target) is None:
        raise ValueError(f"{module}: cannot export the import of {target!r} (no such lazoo module)")
    lines, attrs = [], []
    for alias in node.names:
        if alias.name == "*":
            raise ValueError(f"{module}: `from {target} import *` cannot be exported")
        sub = f"{target}.{alias.name}"
        if _module_file(sub) is not None:  # a submodule: bind the module object
            if _is_skipped(sub):
                lines.append(_missing(sub))
                continue
            needed.add(sub)
            flat = flat_name(sub)
            # the first line is the form transformers scans for (so it copies the file), the second binds it
            lines.append(f"from .{flat} import __name__ as _{flat}_name  # noqa: F401")
            lines.append(f"from . import {flat} as {alias.asname or alias.name}")
        else:
            attrs.append(alias.name if alias.asname is None else f"{alias.name} as {alias.asname}")
    if attrs:
        needed.add(target)
        lines.insert(0, f"from .{flat_name(target)} import {', '.join(attrs)}")
    return lines


def _extension_imports(needed: set[str]) -> str:
    """The lines that import the extension modules (added at the end of the exported mixers package)."""
    lines = ["\n\n# ---- added by lazoo's export: the modules that declare this model's other mechanisms ----\n"]
    for module in sorted(_extensions):
        needed.add(module)
        flat = flat_name(module)
        lines.append(f"from .{flat} import __name__ as _{flat}_name  # noqa: F401\n")
    return "".join(lines)


def rewrite_module(module: str) -> tuple[str, set[str]]:
    """The exported text of lazoo module `module` and the lazoo modules it needs."""
    path = _module_file(module)
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    needed: set[str] = set()
    edits = []  # (first line index, last line index, replacement text)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        new = _rewrite_import(module, node, needed)
        if new is None:
            continue
        first, last = node.lineno - 1, node.end_lineno - 1
        indent = lines[first][: node.col_offset]
        rest = lines[last].rstrip("\r\n")[node.end_col_offset:].strip()
        if indent.strip() or (rest and not rest.startswith("#")):
            raise ValueError(f"{module}:{node.lineno}: put lazoo imports on lines of their own to export them")
        edits.append((first, last, "".join(f"{indent}{line}\n" for line in new)))
    for first, last, text in sorted(edits, reverse=True):
        lines[first: last + 1] = [text]
    text = _HEADER.format(source=module) + "".join(lines)
    if module == _EXTENDED_PACKAGE and _extensions:
        text += _extension_imports(needed)
    if module == "lazoo.ops.backend":
        if not re.search(r"^def resolve_backend\(", text, re.MULTILINE) or "NO_KERNEL" not in text:
            raise ValueError("lazoo.ops.backend has no resolve_backend/NO_KERNEL: update lazoo.models.export")
        text += _NO_TRITON_PATCH.format(reason=NO_TRITON_REASON)
    return text, needed


def _extension_modules(mechanism_names) -> dict[str, Path]:
    """`{module: source file}` of the modules outside lazoo that declare mechanisms among `mechanism_names`."""
    import inspect
    import sys

    from ..registry import get

    found = {}
    for name in dict.fromkeys(mechanism_names or ()):
        if name is None:  # a layer without a token mixer
            continue
        module = get(name).mixer.__module__
        if module == PACKAGE or module.startswith(PACKAGE + "."):
            continue
        source = getattr(sys.modules.get(module), "__file__", None)
        if module == "__main__" or source is None or not source.endswith(".py"):
            raise ValueError(f"cannot export the code of mechanism {name!r}: its mixer is defined in {module!r}, "
                             "which has no source file; declare it in a module (a .py file) and import it")
        found[module] = Path(inspect.getsourcefile(sys.modules[module]))
    return found


def exported_sources(mechanism_names=(), entries=tuple(LANGUAGE_ENTRIES)) -> dict[str, str]:
    """`{file name: text}` of the flat modules that the classes of the entry modules `entries` (default: a language
    model's) need (the closure of their imports), with the modules outside lazoo that declare any of
    `mechanism_names` (a saved language model's `layer_types`)."""
    global _extensions
    _extensions = _extension_modules(mechanism_names)
    try:
        return _exported_sources(entries)
    finally:
        _extensions = {}


def _exported_sources(entries) -> dict[str, str]:
    unknown = [m for m in entries if m not in ENTRY_MODULES]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not an entry module of the export ({', '.join(ENTRY_MODULES)})")
    files, todo, seen = {}, list(entries), set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        text, needed = rewrite_module(module)
        files[f"{flat_name(module)}.py"] = text
        todo.extend(needed)
    # every line transformers reads as a relative import must name an exported file
    for name, text in files.items():
        for pattern in _RELATIVE_IMPORT_PATTERNS:
            for found in pattern.findall(text):
                if f"{found}.py" not in files:
                    raise ValueError(f"exported {name} has a line transformers reads as an import of "
                                     f"{found!r}, which is not exported")
    return files


# ----------------------------------------------------------------------------- the auto_map
#: the exported config module of lazoo's config classes -> that of their model classes
MODELING_MODULES = {"configuration_lazoo": "modeling_lazoo", "configuration_mechanisms": "modeling_mechanisms"}


def _class_prefix(model_type: str) -> str | None:
    """The class-name prefix of a lazoo model type (`LazooVLA` for `lazoo_vla`, `Lazoo` for `lazoo_hybrid`), or
    None for a model type that is not lazoo's."""
    from ..registry import mechanisms

    if model_type == f"{PACKAGE}_hybrid":
        return "Lazoo"
    found = [m for m in mechanisms().values() if m.model_type == model_type]
    return found[0].class_prefix if found else None


def _is_lazoos(cls: type, model_type: str, suffix: str) -> bool:
    """Whether `cls` is the lazoo class `<prefix><suffix>` of `model_type`, in one of the exported modules."""
    prefix = _class_prefix(model_type)
    return prefix is not None and cls.__name__ == prefix + suffix and cls.__module__ in ENTRY_MODULES


#: a YOLO-LAT folder's Auto classes beside AutoConfig: Auto class -> class of modeling_yolo_lat (a detector's or a
#: classifier's folder loads its backbone through AutoBackbone too: the weights of all three are under `encoder.`)
VISION_AUTO_CLASSES = {"AutoBackbone": "YoloLatBackbone", "AutoModel": "YoloLatBackbone",
                       "AutoModelForObjectDetection": "YoloLatForObjectDetection",
                       "AutoModelForImageClassification": "YoloLatForImageClassification"}


def _is_entry_class(cls: type, name: str, entries: dict[str, str]) -> bool:
    """Whether `cls` is the class `name` of one of `entries` (not a user's subclass of it)."""
    return cls.__name__ == name and cls.__module__ in entries


def auto_map_for(obj) -> dict[str, str] | None:
    """The `auto_map` of a lazoo config or image processor: a language model's AutoConfig, AutoModel and
    AutoModelForCausalLM classes; a YOLO-LAT model's AutoConfig and `VISION_AUTO_CLASSES`; a YOLO-LAT image
    processor's AutoImageProcessor. None for an object of another class, e.g. a user's subclass: it is saved
    without the export."""
    cls = obj.__class__
    if _is_entry_class(cls, "YoloLatImageProcessor", VISION_PROCESSOR_ENTRIES):
        return {"AutoImageProcessor": f"{ENTRY_MODULES[cls.__module__]}.{cls.__name__}"}
    if _is_entry_class(cls, "YoloLatConfig", VISION_MODEL_ENTRIES):
        modeling = VISION_MODEL_ENTRIES["lazoo.vision.modeling_yolo_lat"]
        return {"AutoConfig": f"{ENTRY_MODULES[cls.__module__]}.{cls.__name__}",
                **{auto: f"{modeling}.{name}" for auto, name in VISION_AUTO_CLASSES.items()}}
    if not _is_lazoos(cls, getattr(obj, "model_type", None), "Config"):
        return None
    prefix, module = cls.__name__.removesuffix("Config"), ENTRY_MODULES[cls.__module__]
    modeling = MODELING_MODULES[module]
    return {
        "AutoConfig": f"{module}.{cls.__name__}",
        "AutoModel": f"{modeling}.{prefix}Model",
        "AutoModelForCausalLM": f"{modeling}.{prefix}ForCausalLM",
    }


#: lazoo's task heads beyond the causal LM: class-name suffix -> the Auto class that loads it. A model of one of
#: these classes adds its own entry to `auto_map` when it is saved (a causal LM's `auto_map` keeps the three
#: entries of `auto_map_for`).
HEAD_AUTO_CLASSES = {"ForSequenceClassification": "AutoModelForSequenceClassification"}


def head_auto_map(model) -> dict[str, str]:
    """The `auto_map` entry of a lazoo task-head model (e.g. `{"AutoModelForSequenceClassification":
    "modeling_mechanisms.LazooVLAForSequenceClassification"}`), or {} for any other model (a user's subclass
    included: its class is not in the exported code)."""
    cls = model.__class__
    for suffix, auto_class in HEAD_AUTO_CLASSES.items():
        if _is_lazoos(cls, model.config.model_type, suffix):
            return {auto_class: f"{ENTRY_MODULES[cls.__module__]}.{cls.__name__}"}
    return {}


def is_exported_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a file lazoo's export wrote (it opens with `EXPORT_HEADER`)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(EXPORT_HEADER)) == EXPORT_HEADER.encode()
    except OSError:
        return False


def foreign_code_files(folder: str | os.PathLike, names=None) -> list[Path]:
    """The files in `folder` that the export would overwrite but did not write (a user's own
    `modeling_lazoo.py`, say). `names`: the exported file names (default: `exported_sources()`'s, a language
    model's without extension modules)."""
    folder = Path(folder)
    names = sorted(exported_sources()) if names is None else names
    return [folder / n for n in names if (folder / n).exists() and not is_exported_file(folder / n)]


def entries_for(obj) -> tuple[str, ...] | None:
    """The entry modules whose code a saved lazoo config (a model's) or image processor needs, or None for an
    object the export does not handle (see `auto_map_for`)."""
    if auto_map_for(obj) is None:
        return None
    module = obj.__class__.__module__
    return next(tuple(entries) for entries in (LANGUAGE_ENTRIES, VISION_MODEL_ENTRIES, VISION_PROCESSOR_ENTRIES)
                if module in entries)


def export_for_save(obj, save_directory: str | os.PathLike) -> None:
    """Before lazoo config or image processor `obj` is saved into `save_directory`: set its `auto_map` (merged into
    one it has, as transformers' `register_for_auto_class` keeps it on the object) and write the code the folder
    needs (`export_remote_code`). Nothing for an object of another class (a user's subclass is saved as is)."""
    auto_map = auto_map_for(obj)
    if auto_map is None:
        return
    obj.auto_map = {**(getattr(obj, "auto_map", None) or {}), **auto_map}
    export_remote_code(save_directory, mechanism_names=getattr(obj, "layer_types", None) or (),
                       entries=entries_for(obj))


def export_remote_code(folder: str | os.PathLike, config=None, mechanism_names=None, entries=None) -> list[Path]:
    """Write the flat code modules into `folder`; given a config, also merge its `auto_map` into an existing
    `folder/config.json` (for a folder saved without it). Returns the files written.

    `mechanism_names` (default: the config's `layer_types`): the mechanisms the saved model uses; those declared
    outside lazoo have their modules exported too. `entries`: the entry modules (default: the config's, else a
    language model's, `LANGUAGE_ENTRIES`).

    Raises FileExistsError, before writing anything, if `folder` holds a file of an exported name that the
    export did not write (no `EXPORT_HEADER`): the user's file is never overwritten."""
    folder = Path(folder)
    if mechanism_names is None and config is not None:
        mechanism_names = getattr(config, "layer_types", None) or ()
    if entries is None:
        entries = (entries_for(config) if config is not None else None) or tuple(LANGUAGE_ENTRIES)
    sources = exported_sources(mechanism_names, entries=tuple(entries))
    foreign = foreign_code_files(folder, sources)
    if foreign:
        raise FileExistsError(
            f"{foreign[0]} is not code lazoo exported (it does not start with {EXPORT_HEADER!r}), and saving a "
            f"lazoo model writes a file of that name for trust_remote_code loading; move it away or save to "
            f"another folder (files in the way: {', '.join(p.name for p in foreign)})")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in sorted(sources.items()):
        path = folder / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    config_file = folder / "config.json"
    if config is not None and config_file.is_file() and auto_map_for(config) is not None:
        data = json.loads(config_file.read_text(encoding="utf-8"))
        auto_map = {k: v for k, v in (data.get("auto_map") or {}).items()}
        auto_map.update(auto_map_for(config))
        data["auto_map"] = auto_map
        config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return written


# ----------------------------------------------------------------------------- loading a saved folder
class UnknownModelTypeError(ValueError):
    """A saved folder's config.json names a model type that transformers does not know."""


def known_model_type(folder: str | os.PathLike) -> str:
    """The `model_type` in `folder/config.json`, after checking transformers knows it (lazoo's types are
    registered on import). An unknown type is refused here: the `auto_map` lazoo's export writes would
    otherwise make transformers offer to run the folder's code. Raises UnknownModelTypeError naming it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(folder) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnknownModelTypeError(f"cannot read {path} as JSON ({err})") from err
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return model_type
    ours = ", ".join(t for t in CONFIG_MAPPING.keys() if t.startswith(f"{PACKAGE}_"))
    raise UnknownModelTypeError(f"{path}: model_type {model_type!r} is not a model type lazoo or transformers knows "
                     f"(lazoo's: {ours}); the folder was not saved by this version of lazoo")
