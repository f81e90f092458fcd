"""A lazoo model of Qwen3.5-0.8B's text shape (bf16, random weights, converted from transformers' class): the
prefill of 8192 tokens and a training step at 4096 tokens with the Gated DeltaNet layer's host-side shortcuts switched
off one at a time (the Triton RMSNorm, the gates kernel, the cached chunk table, the g read-back skipped, the q/k L2
norms inside the delta rule's node), interleaved over three rounds in one process; each variant 2 warm-ups, the
median of 5, and for the prefill one call timed without waiting for the GPU (the host's share). Prints the JSON after
each round.

    PYTHONPATH=src python experiments/prefill_variants.py [--no-train]
"""
import argparse
import json
import statistics
import tempfile
import time
import types
from pathlib import Path

import torch

from lazoo import ops
from lazoo.bench import qwen as Q
from lazoo.kernels import delta as kd
from lazoo.layers import norms
from lazoo.layers.mixers import delta as md

parser = argparse.ArgumentParser()
parser.add_argument("--no-train", action="store_true")
parser.add_argument("--rounds", type=int, default=3)
cli = parser.parse_args()
args = types.SimpleNamespace(seed=0, device="cuda", dtype="bfloat16", layers=None, hidden_size=None, vocab_size=None,
                             implementations="lazoo", repeats=5, train_batch=1, train_length=4096)
with tempfile.TemporaryDirectory() as f:
    model = Q.build_models(args, Path(f))["lazoo"]
ids = torch.randint(0, model.config.vocab_size, (1, 8192), device="cuda")
train_ids = torch.randint(0, model.config.vocab_size, (1, 4096), device="cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
orig = dict(norm=norms.fused_norm_runs, gates=md.gates_kernel_runs, seqs=kd.seqs_for, op=ops.gated_delta_rule,
            chunk=kd.chunk_delta_rule)


def checked_op(*a, **k):  # the layer's call with the g <= 0 read-back back in
    return orig["op"](*a, **{**k, "check_g": True})


def l2_outside(q, k, *a, use_qk_l2norm=False, **kw):  # the q/k L2 norms as their own autograd nodes, as before
    if use_qk_l2norm:
        q, k = kd.l2norm(q), kd.l2norm(k)
    return orig["chunk"](q, k, *a, **kw)


def setv(norm=True, gates=True, seqs=True, skip_g_check=True, l2_inside=True):
    norms.fused_norm_runs = orig["norm"] if norm else (lambda *a, **k: False)
    md.gates_kernel_runs = orig["gates"] if gates else (lambda *a, **k: False)
    kd.seqs_for = orig["seqs"] if seqs else (lambda B, T, cu, C, dev: kd._Seqs(B, T, cu, C, dev))
    md.ops.gated_delta_rule = orig["op"] if skip_g_check else checked_op
    kd.chunk_delta_rule = orig["chunk"] if l2_inside else l2_outside


def median_ms(fn, n=5):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return round(1000 * statistics.median(ts), 1)


def prefill():
    with torch.no_grad():
        model.model(ids, use_cache=True)


def train_step():
    model.train()
    model(train_ids, labels=train_ids, use_cache=False).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()


variants = {"all": {}, "g_check": dict(skip_g_check=False), "l2_outside": dict(l2_inside=False),
            "no_norm": dict(norm=False), "no_gates": dict(gates=False), "no_seqs": dict(seqs=False),
            "none": dict(norm=False, gates=False, seqs=False, skip_g_check=False, l2_inside=False)}
res = {k: {"prefill_ms": [], "prefill_host_ms": [], "train_ms": []} for k in variants}
for _ in range(cli.rounds):
    for name, kw in variants.items():
        setv(**kw)
        res[name]["prefill_ms"].append(median_ms(prefill))
        t = time.perf_counter()
        prefill()
        res[name]["prefill_host_ms"].append(round(1000 * (time.perf_counter() - t), 1))
        torch.cuda.synchronize()
        if not cli.no_train:
            res[name]["train_ms"].append(median_ms(train_step))
    print(json.dumps(res), flush=True)
