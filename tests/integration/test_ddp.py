"""Data-parallel training through `accelerate launch` (2 CPU processes, gloo): `lazoo train`'s code
(`lazoo.cli.run_training`, what scripts/train_lm.py runs) keeps both ranks' weights identical while they
read different data; and scripts/train_lm.py is the `lazoo train` command line.

`accelerate launch --cpu --num_processes 2` starts ONE process (accelerate 1.15: multi-CPU means MPI); on a
machine without CUDA, `--multi_gpu --num_processes 2` starts 2 processes through torchrun and they use gloo."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--vocab-size", "300", "--sliding-window", "8"]

#: run by every rank: `lazoo train` with a callback that writes the rank's parameters' checksum at the end
ENTRY = textwrap.dedent('''
    import hashlib, json, os, sys
    import torch
    from transformers import TrainerCallback
    from lazoo import cli

    class Dump(TrainerCallback):
        first_batch = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            def record(module, a, kw):
                if Dump.first_batch is None:
                    Dump.first_batch = kw["input_ids"].tolist()
            model.register_forward_pre_hook(record, with_kwargs=True)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            h = hashlib.sha256()
            for name, p in sorted(model.state_dict().items()):
                h.update(name.encode()); h.update(p.detach().float().contiguous().numpy().tobytes())
            out = {"rank": args.process_index, "world_size": args.world_size, "step": state.global_step,
                   "sha256": h.hexdigest(), "sum": float(sum(p.double().sum() for p in model.parameters())),
                   "first_batch": Dump.first_batch}
            with open(os.path.join(os.environ["DUMP_DIR"], f"rank{args.process_index}.json"), "w") as f:
                json.dump(out, f)

    args = cli.build_parser().parse_args(["train", *sys.argv[1:]])
    cli.run_training(args, callbacks=[Dump()])
''')


@pytest.fixture(scope="module")
def text(tmp_path_factory, chapters):
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text("\n\n".join(c[:600] for c in chapters[:80]), encoding="utf-8")
    return path


def _env(tmp_path):
    # HF_HOME: no user accelerate config
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf_home"), DUMP_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def test_ddp_ranks_keep_identical_weights(text, tmp_path):
    entry = tmp_path / "entry.py"
    entry.write_text(ENTRY)
    out = tmp_path / "model"
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(port), str(entry),
           "--config", "sw-vla", "--output", str(out), "--text", str(text), "--steps", "4", "--seq-len", "32",
           "--batch-size", "4", "--grad-accum", "2", "--packing", "--eval-blocks", "4", "--lr", "5e-3",
           "--logging-steps", "1", "--threads", "1", "--no-progress", *TINY]
    run = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["step"] for r in ranks] == [4, 4]
    assert ranks[0]["first_batch"] != ranks[1]["first_batch"], "both ranks read the same data"
    assert ranks[0]["sha256"] == ranks[1]["sha256"], ranks
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()  # saved once, by rank 0


def test_train_lm_script_is_lazoo_train(monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["train_lm.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "scripts" / "train_lm.py"), run_name="__main__")
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--config", "--bf16", "--packing", "--grad-accum", "--save-steps", "--resume",
                   "--gradient-checkpointing"):
        assert option in out


@pytest.mark.parametrize("name", ["hybrid", "delta_product"])
def test_fsdp_auto_wrap_policy_wraps_each_decoder_layer(name):
    """accelerate's TRANSFORMER_BASED_WRAP reads `_no_split_modules`: one FSDP unit per decoder layer (mixer,
    MLP and norms together); only the tied embeddings / lm_head and the final norm stay in the root unit."""
    from accelerate import FullyShardedDataParallelPlugin
    from conftest import tiny_model

    model = tiny_model(name)
    assert set(model._no_split_modules) == {"LazooDecoderLayer"}
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    plugin.set_auto_wrap_policy(model)
    wrapped = [n for n, m in model.named_modules()
               if plugin.auto_wrap_policy(module=m, recurse=False, nonwrapped_numel=0)]
    assert wrapped == [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    root = {n for n, _ in model.named_parameters() if not n.startswith("model.layers.")}
    assert root <= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}, root
