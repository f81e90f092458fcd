"""A lazoo model of Qwen3.5-0.8B's text shape (bf16, random weights, converted from transformers' class): the
prefill of 8192 tokens with the host-side shortcuts switched off one at a time (the Triton RMSNorm, the gates
kernel, the cached chunk table), interleaved over three rounds in one process; each variant 2 warm-ups, the median
of 5, then one call timed without waiting for the GPU (the host's share). Prints the JSON after each round.

    PYTHONPATH=src python experiments/prefill_variants.py
"""
import json
import statistics
import tempfile
import time
import types
from pathlib import Path

import torch

from lazoo.bench import qwen as Q
from lazoo.kernels import delta as kd
from lazoo.layers import norms
from lazoo.layers.mixers import delta as md

args = types.SimpleNamespace(seed=0, device="cuda", dtype="bfloat16", layers=None, hidden_size=None, vocab_size=None,
                             implementations="lazoo", repeats=5, train_batch=1, train_length=4096)
with tempfile.TemporaryDirectory() as f:
    model = Q.build_models(args, Path(f))["lazoo"]
ids = torch.randint(0, model.config.vocab_size, (1, 8192), device="cuda")
orig = dict(norm=norms.fused_norm_runs, gates=md.gates_kernel_runs, seqs=kd.seqs_for)
def setv(norm=True, gates=True, seqs=True):
    norms.fused_norm_runs = orig["norm"] if norm else (lambda *a, **k: False)
    md.gates_kernel_runs = orig["gates"] if gates else (lambda *a, **k: False)
    kd.seqs_for = orig["seqs"] if seqs else (lambda B, T, cu, C, dev: kd._Seqs(B, T, cu, C, dev))
variants = {"all": {}, "no_norm": dict(norm=False), "no_gates": dict(gates=False), "no_seqs": dict(seqs=False),
            "none": dict(norm=False, gates=False, seqs=False)}
res = {k: [] for k in variants}
with torch.no_grad():
    for _ in range(3):
        for name, kw in variants.items():
            setv(**kw)
            for _ in range(2):
                model.model(ids, use_cache=True)
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                model.model(ids, use_cache=True)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t)
            res[name].append(round(1000 * statistics.median(ts), 1))
            # host-only time: launches without waiting
            t = time.perf_counter()
            model.model(ids, use_cache=True)
            th = time.perf_counter() - t
            torch.cuda.synchronize()
            res[name].append(("host", round(1000 * th, 1)))
        print(json.dumps(res), flush=True)
