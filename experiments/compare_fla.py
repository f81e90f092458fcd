"""fla 0.6.0's models beside the lazoo models converted from their checkpoints, on a CUDA GPU.

For each case: build fla's model with its own random init (seeded), save it with `save_pretrained`, convert the
folder with `lazoo.convert.from_fla`, load both on the GPU and run them on the same token ids:
- logits in bf16 and in fp32 (where fla's kernels accept fp32) of both models, each one's relative error against
  a float64 reference (the converted model in float64 on the PyTorch forms, which the CPU tests hold equal to a
  float64 transcription of fla's equations), and the difference between the two models;
- greedy generation of `--new-tokens` tokens in fp32 (bf16 where fla refuses fp32): fla by full recomputation
  (no cache), lazoo and the float64 reference with `generate` and the cache; the identical prefixes.

fla's attention layers call flash-attn, which the device lacks: a stand-in with the same signature computes the
attention with torch's SDPA (causal, window), so attention layers compare lazoo's attention with SDPA's. One JSON
line per case goes to `--out`, and a table to stdout. Run from the repository root:

    PYTHONPATH=src python experiments/compare_fla.py --fla-site /path/to/fla-site --out results.jsonl
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

#: small configs (fla's field names) of each supported model type and two hybrid patterns
SMALL = {
    "gated_deltanet": dict(model_type="gated_deltanet", hidden_size=512, num_heads=4, head_dim=96, expand_v=2,
                           num_hidden_layers=4),
    "gated_deltanet+attn": dict(model_type="gated_deltanet", hidden_size=512, num_heads=4, head_dim=96, expand_v=2,
                                num_v_heads=8, num_hidden_layers=4,
                                attn={"layers": [1, 3], "num_heads": 8, "num_kv_heads": 2}),
    "delta_net": dict(model_type="delta_net", hidden_size=512, num_heads=4, num_hidden_layers=4),
    "gla": dict(model_type="gla", hidden_size=512, num_heads=4, num_hidden_layers=4),
    "gla+swa": dict(model_type="gla", hidden_size=512, num_heads=4, num_hidden_layers=4, use_short_conv=True,
                    attn={"layers": [0, 2], "num_heads": 8, "window_size": 64}),
    "transformer": dict(model_type="transformer", hidden_size=512, num_heads=8, num_kv_heads=2, qk_norm=True,
                        num_hidden_layers=4),
}
#: fla's default configs (its 1.3B-class layouts: hidden 2048, 21-24 layers)
PUBLISHED = {"gated_deltanet": dict(model_type="gated_deltanet"), "gla": dict(model_type="gla"),
             "delta_net": dict(model_type="delta_net"), "transformer": dict(model_type="transformer")}


def sdpa_flash_attn(fla_site: str) -> None:
    """A `flash_attn` module computing what fla's Attention asks of it with torch SDPA."""

    def attend(q, k, v, window):
        # q [B, Tq, H, D], k/v [B, Tk, Hkv, D]; queries aligned to the last keys, as flash-attn does
        groups = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        Tq, Tk = q.shape[1], k.shape[1]
        i = torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)
        j = torch.arange(Tk, device=q.device)[None, :]
        visible = (j <= i) if window is None else (j <= i) & (j > i - window)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=visible)
        return o.transpose(1, 2)

    def window_of(window_size):
        return None if window_size[0] < 0 else window_size[0] + 1

    def flash_attn_func(q, k, v, causal=True, window_size=(-1, -1), **_):
        return attend(q, k, v, window_of(window_size))

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                               causal=True, window_size=(-1, -1), **_):
        out = torch.empty_like(q)
        bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for qs, qe, ks, ke in zip(bq, bq[1:], bk, bk[1:]):
            out[qs:qe] = attend(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], window_of(window_size))[0]
        return out

    stub = types.ModuleType("flash_attn")
    stub.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    stub.flash_attn_func, stub.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    import transformers.activations  # noqa: F401  (transformers probes flash_attn at import: before the stub)

    sys.modules["flash_attn"] = stub
    sys.path.insert(0, fla_site)


def first_working_config() -> None:
    """Make Triton's autotuner keep the first config that runs instead of timing them all.

    The comparison needs fla's numbers, not its fastest configuration; timing every config of every kernel at
    published sizes takes minutes on a fresh machine. Configs that fail to compile (out of shared memory) are
    still skipped, as Triton does.
    """
    from triton.runtime.autotuner import Autotuner

    original_run, original_bench = Autotuner.run, Autotuner._bench

    def run(self, *args, **kwargs):
        self._first_found = False
        return original_run(self, *args, **kwargs)

    def bench(self, *args, **kwargs):
        if getattr(self, "_first_found", False):
            return [float("inf")] * 3
        timings = original_bench(self, *args, **kwargs)
        self._first_found = all(t != float("inf") for t in timings)
        return timings

    Autotuner.run, Autotuner._bench = run, bench


def fla_classes():
    import fla.models as m

    return {"transformer": (m.TransformerConfig, m.TransformerForCausalLM), "gla": (m.GLAConfig, m.GLAForCausalLM),
            "delta_net": (m.DeltaNetConfig, m.DeltaNetForCausalLM),
            "gated_deltanet": (m.GatedDeltaNetConfig, m.GatedDeltaNetForCausalLM)}


@torch.no_grad()
def greedy_recompute(model, ids, steps: int) -> torch.Tensor:
    for _ in range(steps):
        nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def relative(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.no_grad()
def compare(name: str, fields: dict, args, classes, root: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from lazoo.convert import from_fla

    config_cls, model_cls = classes[fields["model_type"]]
    torch.manual_seed(0)
    fla_config = config_cls(**{k: v for k, v in fields.items() if k != "model_type"})
    with torch.device("cuda"):  # published sizes: initialise on the GPU, not on the host
        fla_model = model_cls(fla_config).to(torch.bfloat16).eval()
    folder = root / name.replace("+", "_")
    fla_model.save_pretrained(folder / "fla")
    started = time.perf_counter()
    from_fla(folder / "fla", folder / "lazoo")
    convert_s = time.perf_counter() - started
    ours = AutoModelForCausalLM.from_pretrained(folder / "lazoo", dtype=torch.bfloat16).to("cuda").eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, fla_config.vocab_size, (args.batch, args.tokens), generator=gen).cuda()
    logits = {"fla_bf16": fla_model(ids).logits.float(), "lazoo_bf16": ours(ids).logits.float()}
    # the reference: the converted model in float64 (PyTorch forms; equal to fla's equations on the CPU tests)
    reference = AutoModelForCausalLM.from_pretrained(folder / "lazoo", dtype=torch.float64).to("cuda").eval()
    logits["float64"] = reference(ids).logits
    row = {"case": name, "layers": fla_config.num_hidden_layers, "hidden": fla_config.hidden_size,
           "parameters_M": round(sum(p.numel() for p in ours.parameters()) / 1e6, 1), "convert_s": round(convert_s, 1)}
    dtype = torch.float32
    try:  # fla's chunked delta rule refuses fp32: then its generation stays in bf16
        fla_model.float()
        logits["fla_fp32"] = fla_model(ids).logits.float()
        logits["lazoo_fp32"] = ours.float()(ids).logits.float()
    except (AssertionError, RuntimeError, NotImplementedError) as err:
        row["fp32"] = f"fla refused fp32: {err}"[:200]
        fla_model.to(torch.bfloat16)
        logits["lazoo_fp32"] = ours.float()(ids).logits.float()
        ours.to(torch.bfloat16)
        dtype = torch.bfloat16
    for key, value in logits.items():  # each model's error against the float64 reference
        if key != "float64":
            row[f"{key}_err"] = relative(value, logits["float64"])
    row["bf16_rel_diff"] = relative(logits["lazoo_bf16"], logits["fla_bf16"])
    row["bf16_max_abs_diff"] = float((logits["lazoo_bf16"] - logits["fla_bf16"]).abs().max())
    if "fla_fp32" in logits:
        row["fp32_rel_diff"] = relative(logits["lazoo_fp32"], logits["fla_fp32"])
    prompt = ids[:1, : args.prompt]
    steps = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    tokens = {"fla": greedy_recompute(fla_model, prompt, args.new_tokens)[0, args.prompt:],
              "lazoo": ours.generate(prompt, **steps)[0, args.prompt:],
              "float64": reference.generate(prompt, **steps)[0, args.prompt:]}

    def same_prefix(a, b):
        return int((tokens[a] == tokens[b]).cumprod(0).sum())

    row.update(greedy_dtype=str(dtype).removeprefix("torch."), greedy_steps=args.new_tokens,
               greedy_same_prefix=same_prefix("lazoo", "fla"), greedy_fla_vs_float64=same_prefix("fla", "float64"),
               greedy_lazoo_vs_float64=same_prefix("lazoo", "float64"))
    del fla_model, ours, reference
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fla-site", required=True, help="a folder holding fla 0.6.0 (pip install --target)")
    parser.add_argument("--sizes", default="small,published")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default="compare_fla.jsonl")
    parser.add_argument("--autotune", choices=("full", "first"), default="full",
                        help="'first': keep the first Triton config that runs (same numbers, no timing sweep)")
    parser.add_argument("--ieee", action="store_true",
                        help="fp32 dots in IEEE precision in every Triton kernel (TRITON_F32_DEFAULT=ieee) and no "
                             "TF32 in torch, to separate TF32 rounding from the models' differences")
    args = parser.parse_args(argv)
    if args.ieee:
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    sdpa_flash_attn(args.fla_site)
    if args.autotune == "first":
        first_working_config()
    classes = fla_classes()
    import fla
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "fla": getattr(fla, "__version__", "?"), "autotune": args.autotune, "ieee": args.ieee}
    print(json.dumps(env), flush=True)
    wanted = None if args.cases is None else set(args.cases.split(","))
    with open(args.out, "w") as out, tempfile.TemporaryDirectory() as tmp:
        out.write(json.dumps(env) + "\n")
        for size, table in (("small", SMALL), ("published", PUBLISHED)):
            if size not in args.sizes.split(","):
                continue
            for name, fields in table.items():
                if wanted is not None and name not in wanted:
                    continue
                try:
                    row = {"size": size, **compare(f"{size}-{name}", fields, args, classes, Path(tmp))}
                except Exception as err:  # noqa: BLE001 - record the failure, go on with the other cases
                    row = {"size": size, "case": name, "error": f"{type(err).__name__}: {err}"[:400]}
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
