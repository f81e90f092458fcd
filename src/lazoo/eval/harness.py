"""Run lm-evaluation-harness on saved lazoo models: ``lazoo eval`` (see :func:`main`).

Each model folder (``save_pretrained`` of the model and of its tokenizer) is loaded through
``AutoModelForCausalLM``/``AutoTokenizer`` (lazoo registers its model types on import), wrapped in lm-eval's
``HFLM`` as a ready model instance (``backend="causal"``), and evaluated with ``simple_evaluate`` on
lazoo's local tasks (:mod:`lazoo.eval.local_tasks`), whose data is written to a temporary folder first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from .local_tasks import TASKS, prepare_tasks

#: files that mark a saved tokenizer (any one is enough for AutoTokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

#: columns of the summary table: (task, metric) in this order, where present
TABLE_METRICS = {
    "lazoo_kjv_ppl": ["word_perplexity", "byte_perplexity", "bits_per_byte"],
    "lazoo_kjv_next_verse": ["acc", "acc_norm"],
    "lazoo_mqar": ["exact_match"],
}


def _require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "lazoo.eval needs lm-evaluation-harness: pip install 'lazoo[eval]' (or pip install lm-eval)"
        ) from err


def check_model_folder(folder: str | os.PathLike) -> Path:
    """The folder as a Path, after checking it holds a saved model of a known model type and its tokenizer
    (FileNotFoundError or ValueError naming the problem if not)."""
    from ..models.export import known_model_type

    path = Path(folder).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(folder)!r} has no config.json: save the model there with "
                                "model.save_pretrained(folder)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model folder {str(folder)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
            "save the tokenizer the model was trained with next to it (tokenizer.save_pretrained(folder))")
    known_model_type(path)  # an unknown type would make transformers offer to run the folder's code
    return path


def load_model(folder: str | os.PathLike, device: str = "cpu"):
    """``(model, tokenizer)`` from a saved folder, the model in eval mode on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import lazoo  # noqa: F401  (registers the lazoo model types on the Auto classes)

    path = check_model_folder(folder)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False)
    model = model.to(device).eval()
    return model, tokenizer


def make_lm(model, tokenizer, batch_size: int = 1, max_length: int | None = None):
    """lm-eval's ``HFLM`` around a model *instance* (causal backend).

    HFLM takes a transformers-5 model instance as it is (checked with lm-eval 0.4.13 and transformers
    5.23); it reads the device from the model, so move the model first. Two settings are made here rather
    than left to HFLM's defaults: a tokenizer without a pad token gets its eos as pad (HFLM pads
    batches), and ``max_length`` defaults to HFLM's own rule (the config's ``max_position_embeddings``,
    which is very large for lazoo models: rolling perplexity then scores each document in one window).
    """
    _require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = {"max_length": max_length} if max_length else {}
    return HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size, **kwargs)


def task_manager(include_path: str | os.PathLike):
    """A TaskManager that knows only the local tasks in ``include_path`` (indexing lm-eval's thousands of
    built-in YAMLs takes seconds and none of them runs offline)."""
    _require_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(include_path), include_defaults=False)


def evaluate(lm, tasks: list[str], include_path: str | os.PathLike, limit: int | float | None = None,
             bootstrap_iters: int = 0, log_samples: bool = False, **kwargs) -> dict:
    """``lm_eval.simple_evaluate`` of ``lm`` (an LM, e.g. from :func:`make_lm`) on local tasks.

    ``include_path`` is a folder from :func:`prepare_tasks`; other keyword arguments go to
    ``simple_evaluate``. Returns lm-eval's results dict (with per-document ``samples`` if ``log_samples``).
    """
    _require_lm_eval()
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=task_manager(include_path),
                           bootstrap_iters=bootstrap_iters, log_samples=log_samples, **kwargs)


def metrics_of(results: dict) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` from lm-eval's results, filter names dropped, stderr kept as ``<m>_stderr``."""
    out: dict[str, dict[str, float]] = {}
    for task, values in results["results"].items():
        row = {}
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue  # "alias" and the like
            metric = key.split(",", 1)[0]
            row[metric] = float(value)
        out[task] = row
    return out


def format_table(per_model: dict[str, dict[str, dict[str, float]]], tasks: list[str]) -> str:
    """A markdown table: one row per model, one column per (task, metric)."""
    columns = []
    for task in tasks:
        seen = {m for metrics in per_model.values() for m in metrics.get(task, {}) if not m.endswith("_stderr")}
        wanted = [m for m in TABLE_METRICS.get(task, []) if m in seen]
        columns += [(task, m) for m in wanted + sorted(seen - set(wanted))]
    header = ["model"] + [f"{task.removeprefix('lazoo_')} {metric}" for task, metric in columns]
    rows = []
    for name, metrics in per_model.items():
        cells = [name]
        for task, metric in columns:
            value = metrics.get(task, {}).get(metric)
            cells.append("—" if value is None else f"{value:.4g}")
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in [header] + rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`lazoo eval`'s options (lazoo_cli.parser, which `lazoo eval --help` reads without importing lm-eval or
    torch), checked by :func:`check_args`; a bad one exits through argparse (status 2)."""
    from lazoo_cli.parser import command_parser

    parser = command_parser("eval")
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as err:
        parser.error(str(err))
    return args


def check_args(args: argparse.Namespace) -> None:
    """The option values argparse cannot check (ValueError naming the first that is wrong); `--tasks` becomes a
    list and a `--limit` of 1 or more a whole number of documents."""
    if isinstance(args.tasks, str):
        args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown or not args.tasks:
        raise ValueError(f"unknown task(s) {', '.join(unknown) or '(none given)'}; the local tasks are "
                         f"{', '.join(TASKS)}")
    if args.limit is not None:
        if not (math.isfinite(args.limit) and args.limit > 0):
            raise ValueError(f"--limit must be a positive finite number, got {args.limit}")
        if args.limit >= 1:
            args.limit = int(args.limit)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
    if args.max_length is not None and args.max_length < 1:
        raise ValueError(f"--max-length must be positive, got {args.max_length}")
    if args.bootstrap_iters < 0:
        raise ValueError(f"--bootstrap-iters must be >= 0, got {args.bootstrap_iters}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be a positive number, got {args.threads}")


def _is_eval_output(path: Path) -> bool:
    """Whether `path` is a metrics file `lazoo eval --output` wrote."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and {"tasks", "metrics", "runs", "versions"} <= data.keys()


def _is_task_yaml(path: Path) -> bool:
    try:
        return "Rendered by lazoo.eval.prepare_tasks" in path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False


def _files_in_the_way(args) -> list[Path]:
    """The files this run would overwrite that lazoo eval did not write (none with --overwrite)."""
    if args.overwrite:
        return []
    found = []
    if args.output and Path(args.output).exists() and not _is_eval_output(Path(args.output)):
        found.append(Path(args.output))
    if args.task_dir:
        for name in args.tasks:
            yaml_file, data_file = (Path(args.task_dir) / f for f in TASKS[name])
            ours = _is_task_yaml(yaml_file)  # the data file is written together with its YAML
            found += [f for f in (yaml_file, data_file) if f.exists() and not ours]
    return found


def _check_inputs(args) -> None:
    """Every model folder and output file checked before any evaluation (clear errors naming them)."""
    for folder in args.models:
        check_model_folder(folder)  # fail before spending time on the first model
    in_the_way = _files_in_the_way(args)
    if in_the_way:
        raise FileExistsError(f"{in_the_way[0]} exists and was not written by lazoo eval; it is kept: move it away, "
                              "choose another path, or pass --overwrite to replace it")


def main(argv: list[str] | None = None) -> int:
    """``lazoo eval MODEL [MODEL ...] [--tasks ...] [--limit N] [--batch-size B] [--device D] [--output F]``.

    Returns 0 on success; bad arguments exit through argparse (status 2); a missing folder or tokenizer
    (FileNotFoundError), an unknown model type (UnknownModelTypeError) or an output file in the way
    (FileExistsError) raises a clear error naming it before anything has run (`lazoo eval` prints it as one line).
    """
    return run(parse_args(sys.argv[1:] if argv is None else list(argv)))


def run(args: argparse.Namespace) -> int:
    """`lazoo eval` on parsed, checked arguments (:func:`parse_args`): every input checked first, then each model
    evaluated with --threads CPU threads (default: OMP_NUM_THREADS where set, else all cores), bars off with
    --no-progress; prints the table, writes --output."""
    from ..runtime import progress_bars, set_cpu_threads

    _check_inputs(args)
    _require_lm_eval()
    set_cpu_threads(args.threads)
    with progress_bars(not args.no_progress):
        return _evaluate_models(args)


def _evaluate_models(args: argparse.Namespace) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = _unique_names(args.models)

    with tempfile.TemporaryDirectory(prefix="lazoo-eval-") as tmp:
        include_path = prepare_tasks(args.task_dir or tmp, args.tasks)
        per_model, raw = {}, {}
        for name, folder in zip(names, args.models):
            start = time.time()
            model, tokenizer = load_model(folder, device)
            lm = make_lm(model, tokenizer, batch_size=args.batch_size, max_length=args.max_length)
            results = evaluate(lm, args.tasks, include_path, limit=args.limit, bootstrap_iters=args.bootstrap_iters)
            per_model[name] = metrics_of(results)
            raw[name] = {"folder": str(Path(folder).resolve()), "seconds": round(time.time() - start, 2),
                         "n-samples": results.get("n-samples"), "configs": results.get("configs")}
            print(f"[lazoo eval] {name}: {raw[name]['seconds']:.1f} s", file=sys.stderr)
            del lm, model

    print(format_table(per_model, args.tasks))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"tasks": args.tasks, "limit": args.limit, "device": device, "metrics": per_model,
                   "runs": raw, "versions": _versions()}
        out.write_text(json.dumps(payload, indent=2, default=str, allow_nan=True) + "\n", encoding="utf-8")
        print(f"[lazoo eval] wrote {out}", file=sys.stderr)
    return 0


def _unique_names(folders: list[str]) -> list[str]:
    """Row names: the folders as given, made unique if the same folder is given twice."""
    names, seen = [], {}
    for folder in folders:
        name = str(folder).rstrip("/") or str(folder)
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return names


def _versions() -> dict[str, str]:
    from ..bench.report import installed_versions

    return {name: v for name, v in installed_versions("lazoo", "lm_eval", "transformers", "torch").items() if v}

