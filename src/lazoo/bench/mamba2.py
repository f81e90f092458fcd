"""Mamba-2 at Bamba's shapes: lazoo's op against fla and transformers, and a Bamba-shaped model against transformers.

Two parts (``--parts``), every row a JSON line in ``--out`` as it is measured, then a markdown table (printed, and
written beside ``--out`` with the suffix ``.md``).

``op``: ``lazoo.ops.mamba2`` (its Triton kernels on CUDA, its chunked PyTorch form elsewhere) at the Mamba-2 shapes
of Bamba-9B's published configuration (128 heads of 64 channels, state size 128, one group of B and C), in the
run's dtype (bf16), at T = 1k, 8k and 32k with B·T = 32k tokens: forward and forward + backward (x, dt, A, B, C and
D get gradients), the median of ``triton.testing.do_bench`` on CUDA (of ``--repeats`` wall-clock runs elsewhere),
against two anchors on the same inputs:

* ``fla``: fla's ``chunk_simple_gla`` with the inputs mapped as ``ops.mamba2`` maps them (q = C and k = B, repeated
  to the heads since fla's kernel takes q and k with v's heads, where lazoo's read each group in place; v = dt·x,
  g = dt·A in float32, scale 1; D·x added outside), the mapping inside the timed call;
* ``transformers``: ``mamba2_chunk_scan`` of transformers' Mamba-2 module, the chunked SSD its ``Mamba2Mixer`` and
  ``BambaMixer`` run when mamba-ssm is not installed (with it installed, mamba-ssm's kernel: the ``env`` row says
  which), on the same inputs (dt already positive: no bias, no softplus) and the same chunk length
  (``--chunk-size``, lazoo's 64; Bamba-9B's 256 takes four times the memory in this form). Op against op rather
  than mixer against mixer: the projections, the convolution and the norm around the SSD are the same matrix
  products in both and would only dilute the difference. transformers 5.17's form materialises float32 products
  of [tokens, chunk, H, N] and [chunks², H, P, N] elements (newer releases contract them with einsum), so it runs
  on the first sequences of the batch, ``--hf-tokens`` tokens (at least one sequence), and is compared per token;
  where even one sequence does not fit, its row records the out-of-memory error.

Every op row has its ms, the anchor's ms per token over lazoo's (``lazoo_speedup_*``, on the anchors' rows: above 1
when lazoo is faster), and the relative error max|y − y64| / max|y64| of its output against a float64 reference (the
SSD's quadratic form, written here) on the first ``--ref-length`` tokens of the first sequence of the same inputs.

``model``: a ~370M model of Bamba's shape with random weights: hidden 1024, 24 layers, attention at layers 9 and 18
as in Bamba-9B (9, 18, 27 of 32), 8 query and 2 key/value heads of 128 with half of each rotated, Mamba-2 layers of
32 heads of 64 (Bamba's head size, expand 2) with state 128 and one group, SwiGLU 2048, vocabulary 32000, untied.
transformers' ``BambaForCausalLM`` is built from its config, saved and converted with ``lazoo.convert``, so both
compute the same function; then ``lazoo.bench.qwen``'s rows: the agreement of their logits, prefill at 8k (ms), one
AdamW step at 4k tokens (tokens/s), and greedy ``generate`` ms per new token at batch 1, each on its default path
(lazoo's on CUDA: the static cache and the compiled decode step; transformers': its eager path), and lazoo's eager
path beside it.

    python -m lazoo.bench.mamba2 --out bench_mamba2.jsonl
    python -m lazoo.bench.mamba2 --quick --out bench_mamba2_quick.jsonl

CPU smoke test (every row but fla's): ``--device cpu --dtype float32 --lengths 16,32 --tokens 64 --heads 4
--head-dim 8 --state-size 8 --chunk-size 8 --ref-length 16 --hf-tokens 32 --layers 2 --attention-every 1
--hidden-size 32 --intermediate-size 48 --vocab-size 64 --prefill 16 --train-length 16 --prompt 4 --new-tokens 3
--repeats 1``.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from lazoo_cli.bench import bench_parser

from .qwen import converted_pair, measure_models, timed
from .report import JsonRows, command_line, error_text, fmt, installed_versions, triton_version
from .timing import OutOfTime, time_budget, time_fwd_bwd

#: the op's inputs, all of which get gradients
INPUTS = ("x", "dt", "A", "B", "C", "D")
#: transformers' chunk length in Bamba-9B's configuration (the model part keeps it)
BAMBA_CHUNK = 256


# ----------------------------------------------------------------------------- the op's inputs and reference
def op_inputs(batch: int, T: int, args) -> dict:
    """The op's inputs at one length, the same for every implementation (drawn from ``--seed`` and T): x, B, C
    standard normal in the run's dtype; dt = softplus(N(0, 0.25) + a head's bias), the bias set so that
    softplus(bias) is log-uniform in [0.001, 0.1] as Mamba-2 initialises it; A uniform in [−16, −1]; D normal."""
    gen = torch.Generator(device=args.device).manual_seed(args.seed + T)
    dtype, H, N, G = getattr(torch, args.dtype), args.heads, args.state_size, args.groups

    def normal(*shape):
        return torch.randn(*shape, device=args.device, generator=gen)

    def uniform(*shape):
        return torch.rand(*shape, device=args.device, generator=gen)

    step = torch.exp(math.log(1e-3) + uniform(H) * math.log(100.0))
    dt_bias = step + torch.log(-torch.expm1(-step))  # softplus⁻¹
    return {"x": normal(batch, T, H, args.head_dim).to(dtype), "dt": F.softplus(0.5 * normal(batch, T, H) + dt_bias),
            "A": -(1 + 15 * uniform(H)), "B": normal(batch, T, G, N).to(dtype), "C": normal(batch, T, G, N).to(dtype),
            "D": normal(H)}


def ssd_quadratic(x, dt, A, B, C, D):
    """The SSD as its quadratic (attention-like) form, in float64: y_t = Σ_{s ≤ t} exp(g_t − g_s) (C_t · B_s)
    dt_s x_s + D x_t, with g the running sum of dt · A; B and C repeated from their groups to the heads."""
    x, dt, A, B, C, D = (t.double() for t in (x, dt, A, B, C, D))
    T, heads = x.shape[1], x.shape[2]
    B, C = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
    g = torch.cumsum(dt * A, dim=1).transpose(1, 2)  # [b, H, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, -math.inf).exp()  # [b, H, t, s]
    weights = torch.einsum("bthn,bshn->bhts", C, B) * decay
    return torch.einsum("bhts,bshp->bthp", weights, dt[..., None] * x) + D[:, None] * x


def max_relative_error(y, reference) -> float:
    """max |y − reference| / max |reference|, in float64."""
    y, reference = y.double(), reference.double()
    return ((y - reference).abs().max() / reference.abs().max().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------- the implementations
def backend_name(args) -> str:
    """lazoo's backend: its Triton kernels on CUDA, its chunked PyTorch form elsewhere."""
    return "triton" if str(args.device).startswith("cuda") else "chunk"


def lazoo_op(args):
    from lazoo import ops

    return lambda i: ops.mamba2(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], chunk_size=args.chunk_size,
                                backend=backend_name(args))[0]


def fla_op(chunk_simple_gla):
    """fla's ``chunk_simple_gla`` on the inputs mapped as ``lazoo.ops.mamba2`` maps them, D·x added after."""
    def run(i):
        x = i["x"]
        heads, groups = x.shape[2], i["B"].shape[2]
        q, k = (t.repeat_interleave(heads // groups, dim=2) for t in (i["C"], i["B"]))
        v = (i["dt"][..., None] * x.float()).to(x.dtype)
        y = chunk_simple_gla(q, k, v, i["dt"] * i["A"], scale=1.0)[0]
        return (y.float() + i["D"][:, None] * x.float()).to(x.dtype)

    return run


def transformers_op(args):
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    return lambda i: mamba2_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], args.chunk_size, D=i["D"])


def load_fla_simple_gla(device):
    """(fla's ``chunk_simple_gla``, fla's version), or (None, why it cannot run here)."""
    if not str(device).startswith("cuda"):
        return None, "fla's kernels need a CUDA device"
    from .kernel_ops import load_fla

    fla, version = load_fla()
    return (fla.chunk_simple_gla, version) if fla is not None else (None, version)


# ----------------------------------------------------------------------------- timing one row
def wall_fwd_bwd(fn, inputs: dict, device, repeats: int) -> tuple:
    """(forward ms, forward + backward ms, error or None) by wall clock, for devices without Triton's timer."""
    try:
        with torch.no_grad():
            fwd = 1000 * timed(lambda: fn(inputs), device, repeats)
        leaves = {n: t.detach().requires_grad_() for n, t in inputs.items()}
        both = 1000 * timed(lambda: fn(leaves).float().square().sum().backward(), device, repeats)
        return fwd, both, None
    except Exception as err:  # noqa: BLE001 - recorded in the row
        return None, None, error_text(err)


def fwd_bwd_ms(fn, inputs: dict, args) -> tuple:
    if str(args.device).startswith("cuda"):
        return time_fwd_bwd(fn, inputs, INPUTS)
    return wall_fwd_bwd(fn, inputs, args.device, args.repeats)


def reference_error(fn, inputs: dict, reference) -> dict:
    """The output's error against the float64 reference on the inputs' slice it was computed from."""
    try:
        with torch.no_grad():
            return {"rel_err_f64": max_relative_error(fn(inputs), reference)}
    except Exception as err:  # noqa: BLE001 - recorded in the row
        return {"rel_err_f64": None, "rel_err_error": error_text(err)}


def op_row(impl: str, fn, inputs: dict, check: tuple, args, note: str | None = None) -> dict:
    """One op row: ``fn`` timed on ``inputs`` and checked on ``check`` = (the reference's inputs, the reference)."""
    batch, T = inputs["x"].shape[:2]
    fwd, both, err = fwd_bwd_ms(fn, inputs, args)
    row = {"part": "op", "impl": impl, "T": T, "B": batch, "tokens": batch * T, "fwd_ms": fwd, "fwd_bwd_ms": both,
           "error": err, **reference_error(fn, *check), "ref_tokens": check[0]["x"].shape[1]}
    if note:
        row["note"] = note
    if str(args.device).startswith("cuda"):
        torch.cuda.empty_cache()  # an anchor that ran out of memory leaves nothing behind
    return row


def add_speedups(row: dict, lazoo_row: dict) -> dict:
    """The anchor's ms per token over lazoo's, forward and forward + backward (above 1: lazoo is faster)."""
    for key in ("fwd", "fwd_bwd"):
        ms, ours = row[f"{key}_ms"], lazoo_row[f"{key}_ms"]
        if ms and ours:
            row[f"lazoo_speedup_{key}"] = (ms / row["tokens"]) / (ours / lazoo_row["tokens"])
    return row


# ----------------------------------------------------------------------------- the op part
def op_rows(args, record) -> None:
    """lazoo's and transformers' rows at every length, then fla's under ``--fla-budget`` (its autotuning)."""
    anchors = args.anchors.split(",") if args.anchors else []
    ours, checks = {}, {}
    for T in map(int, args.lengths.split(",")):
        inputs = op_inputs(max(1, args.tokens // T), T, args)
        check = {n: t[:1, :args.ref_length] if t.dim() > 1 else t for n, t in inputs.items()}
        checks[T] = (check, ssd_quadratic(**check))
        ours[T] = op_row("lazoo", lazoo_op(args), inputs, checks[T], args, note=f"ops.mamba2, {backend_name(args)}")
        record(ours[T])
        if "transformers" in anchors:
            batch = inputs["x"].shape[0]
            rows = min(batch, max(1, args.hf_tokens // T))
            sliced = {n: t[:rows] if t.dim() > 1 else t for n, t in inputs.items()}
            row = op_row("transformers", transformers_op(args), sliced, checks[T], args,
                         note=f"mamba2_chunk_scan on {rows} of the {batch} sequences")
            record(add_speedups(row, ours[T]))
        del inputs
    if "fla" in anchors:
        fla_rows(args, record, ours, checks)


def fla_rows(args, record, ours: dict, checks: dict) -> None:
    chunk_simple_gla, version = load_fla_simple_gla(args.device)
    if chunk_simple_gla is None:
        record({"part": "op", "impl": "fla", "skipped": version})
        return
    try:
        with time_budget(args.fla_budget):
            for T in ours:
                inputs = op_inputs(ours[T]["B"], T, args)
                record(add_speedups(op_row("fla", fla_op(chunk_simple_gla), inputs, checks[T], args,
                                           note=f"chunk_simple_gla, fla {version}"), ours[T]))
                del inputs
    except OutOfTime:
        record({"part": "op", "impl": "fla", "skipped": f"stopped after the {args.fla_budget:.0f} s budget"})


# ----------------------------------------------------------------------------- the model part
def bamba_config(args):
    """transformers' BambaConfig of the run (module docstring): Bamba-9B's head sizes at hidden 1024."""
    from transformers import BambaConfig

    h, n = args.hidden_size, args.layers
    heads = max(1, h // 128)
    return BambaConfig(
        vocab_size=args.vocab_size, hidden_size=h, intermediate_size=args.intermediate_size, num_hidden_layers=n,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        attn_layer_indices=list(range(args.attention_every, n, args.attention_every)),
        mamba_n_heads=2 * h // args.head_dim, mamba_d_head=args.head_dim, mamba_d_state=args.state_size,
        mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=BAMBA_CHUNK, tie_word_embeddings=False)


def build_models(args, folder: Path) -> dict:
    from transformers import BambaForCausalLM

    torch.manual_seed(args.seed)
    with torch.device(args.device):
        reference = BambaForCausalLM(bamba_config(args)).to(getattr(torch, args.dtype))
    return converted_pair(reference, args, folder)


def model_rows(args, record) -> None:
    def record_model_row(row):
        record({"part": "model", **row})

    with tempfile.TemporaryDirectory() as folder:
        models = build_models(args, Path(folder))
    model = next(iter(models.values()))
    record_model_row({"row": "config", "parameters": sum(p.numel() for p in model.parameters()),
                      "layers": args.layers, "hidden_size": args.hidden_size})
    measure_models(models, args, record_model_row)


# ----------------------------------------------------------------------------- the table
def op_table(rows: list[dict]) -> list[str]:
    lines = ["| T | implementation | B | fwd ms | fwd+bwd ms | lazoo speedup fwd | lazoo speedup fwd+bwd | "
             "rel. error vs float64 | note |", "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| | {r['impl']} | | | | | | | {r['skipped']} |")
            continue
        note = "; ".join(filter(None, [r.get("error"), r.get("rel_err_error"), r.get("note")]))
        lines.append(f"| {r['T']} | {r['impl']} | {r['B']} | {fmt(r['fwd_ms'], '.3f')} | "
                     f"{fmt(r['fwd_bwd_ms'], '.3f')} | {fmt(r.get('lazoo_speedup_fwd'), '.2f')} | "
                     f"{fmt(r.get('lazoo_speedup_fwd_bwd'), '.2f')} | {fmt(r['rel_err_f64'], '.1e')} | {note} |")
    return lines


#: the model rows' measure, and whether more is better
MODEL_MEASURES = {"prefill": ("ms", False), "train": ("tokens_per_s", True), "generate": ("ms_per_token", False),
                  "generate-eager": ("ms_per_token", False)}
IMPLEMENTATIONS = ("transformers", "lazoo")


def model_table(rows: list[dict]) -> list[str]:
    lines = ["| row | size | measure | transformers | lazoo | lazoo speedup |", "|---|---:|---|---:|---:|---:|"]
    cells = {(r["implementation"], r["row"], r["size"]): r for r in rows if "implementation" in r}
    for kind, size in dict.fromkeys((kind, size) for _, kind, size in cells):
        key, more_is_better = MODEL_MEASURES[kind]
        found = [cells.get((impl, kind, size), {}) for impl in IMPLEMENTATIONS]
        values = [cell.get(key) for cell in found]
        speedup = None
        if all(values):
            speedup = values[1] / values[0] if more_is_better else values[0] / values[1]
        shown = [fmt(v, ".1f") if v is not None else cell.get("error", "-") for v, cell in zip(values, found)]
        lines.append(f"| {kind} | {size} | {key} | {shown[0]} | {shown[1]} | {fmt(speedup, '.2f')} |")
    return lines


def other_rows(rows: list[dict]) -> list[str]:
    """The rows outside the tables (the model's size, the agreement, a part that failed), one line each."""
    return [", ".join(f"{k}: {v}" for k, v in r.items()) for r in rows
            if "part" in r and "impl" not in r and "implementation" not in r]


def markdown(rows: list[dict]) -> str:
    op = [r for r in rows if r.get("part") == "op" and "impl" in r]
    model = [r for r in rows if r.get("part") == "model" and "implementation" in r]
    parts = []
    if op:
        parts += ["## The op", "", *op_table(op), ""]
    if model:
        parts += ["## The model", "", *model_table(model), ""]
    return "\n".join(parts + [f"- {line}" for line in other_rows(rows)]) + "\n"


# ----------------------------------------------------------------------------- the run
def environment(args) -> dict:
    import transformers

    cuda = str(args.device).startswith("cuda")
    found = installed_versions("flash-linear-attention", "mamba-ssm", "causal-conv1d")
    return {"gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
            "triton": triton_version(), "transformers": transformers.__version__, "dtype": args.dtype,
            "fla": found["flash-linear-attention"], "mamba_ssm": found["mamba-ssm"],
            "causal_conv1d": found["causal-conv1d"],
            "op_shape": {"H": args.heads, "P": args.head_dim, "N": args.state_size, "G": args.groups,
                         "tokens": args.tokens, "chunk": args.chunk_size},
            "command": command_line("mamba2")}


def apply_quick(args) -> None:
    if args.quick:
        args.lengths, args.repeats, args.new_tokens = "8192", 1, 16


def run(args) -> list[dict]:
    apply_quick(args)
    parts = args.parts.split(",")
    with JsonRows(args.out) as rows:
        rows.record({"env": environment(args)})
        for name, measure in (("op", op_rows), ("model", model_rows)):
            if name in parts:
                try:
                    measure(args, rows.record)
                except Exception as err:  # noqa: BLE001 - one part failing keeps the other's rows
                    rows.record({"part": name, "error": error_text(err)})
    table = markdown(rows)
    Path(args.out).with_suffix(".md").write_text(table)
    print(table)
    return rows


def main(argv=None) -> None:
    run(bench_parser("mamba2", prog="python -m lazoo.bench.mamba2").parse_args(argv))


if __name__ == "__main__":
    main()
