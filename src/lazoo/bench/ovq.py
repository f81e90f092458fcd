"""Benchmark OVQ attention (Triton) against causal SDPA on a CUDA GPU, and OVQ's state size vs length.

For T in --lengths (default 1k, 4k, 16k, 64k), B = --batch, H = 8, d = 128, bf16, N = 2048, L = 128:
  * forward and forward+backward median ms (triton.testing.do_bench) of
      - ``ovq_attention(backend="triton")``: the whole op (assignments of every chunk, the running-mean
        dictionaries, the chunk-attention kernel); with --pytorch-assign also the op with the assignments as a
        PyTorch loop (``triton_assign=False``) and how far its output is from the default's,
      - the chunk-attention kernel alone (``lazoo.kernels.ovq.attention.ovq_chunk_attention``) with the dictionary
        versions given (the part that is flash attention over ≤ N + L keys per query): O(T + N) table rows,
        every slot moving to a new row every N / L chunks, as one key a chunk per slot would,
      - ``scaled_dot_product_attention(is_causal=True)``;
  * bytes of OVQ's state after T tokens (dictionaries, counts, partial chunk: constant for fixed N) and
    of a bf16 KV cache of T tokens;
  * one more token after T (no autograd): OVQ from its state (the decode kernel, and the PyTorch chunk form),
    SDPA over the KV cache.
A case that does not fit in memory is recorded as "oom" and skipped. Prints a table, writes JSON (--out).

    python -m lazoo.bench.ovq --out docs/results/ovq_bench.json
"""

from __future__ import annotations

import math
import traceback

import torch
import torch.nn.functional as F

from lazoo_cli.bench import bench_parser

from .inputs import causal_sdpa, unit_qkv
from .report import error_text, gpu_environment, write_json
from .timing import call_ms, require_cuda

H, D, N, L = 8, 128, 2048, 128
#: do_bench's warm-up and repetitions, in ms (the op at 64k tokens takes a while)
WARMUP, REP = 3, 50


def inputs(B, T, dtype, device, seed=0):
    """Unit-norm q, k and standard normal v, ``[B, T, H, D]``."""
    x = unit_qkv(B, T, H, D, dtype, device, torch.Generator(device=device).manual_seed(seed))
    return x["q"], x["k"], x["v"]


def state_bytes(state) -> int:
    return sum(x.numel() * x.element_size() for x in state.values())


def timed(fn, backward, leaves):
    """Median ms of fn() (and of fn() + backward when asked), or "oom"."""
    try:
        return round(float(call_ms(fn, backward, leaves, warmup=WARMUP, rep=REP)), 4)
    except torch.OutOfMemoryError:
        return "oom"
    finally:
        torch.cuda.empty_cache()


def decode_ms(q, k, v, state, scale):
    """Median ms of one more token after T: OVQ from its state (the decode kernel, and the PyTorch chunk form it
    replaced), and SDPA over a KV cache of the T tokens."""
    from lazoo.ops import ovq_attention

    q1, k1, v1 = q[:, -1:].detach(), k[:, -1:].detach(), v[:, -1:].detach()
    kv = (k.detach().transpose(1, 2), v.detach().transpose(1, 2))

    def ovq(backend):
        return lambda: ovq_attention(q1, k1, v1, scale=scale, chunk_size=L, max_dict_size=N, initial_state=state,
                                     output_final_state=True, backend=backend)

    def sdpa():
        return F.scaled_dot_product_attention(q1.transpose(1, 2), *kv)

    out = {}
    for name, fn in (("ovq_decode_ms", ovq("triton")), ("ovq_decode_chunk_form_ms", ovq("chunk")),
                     ("sdpa_decode_ms", sdpa)):
        out[name] = round(float(call_ms(fn, warmup=WARMUP, rep=REP)), 4)
        print(f"  T={q.shape[1]} {name}: {out[name]}", flush=True)
    return out


def kernel_dictionaries(B, T, dtype, device):
    """Inputs of the chunk-attention kernel alone, shaped as the op builds them: version tables (dict_k unit-norm,
    dict_v random), every chunk's counts (the dictionary grown as ``ovq_dict_size``, one more key a slot every W / L
    chunks) and the tables' bases. Returns (dict_k, dict_v, counts ``[G, B, H, W]``, base ``[B, H, W]``)."""
    G = T // L
    W = min(N, max(1, (T - L) * N // (T - L + N)))  # the widest dictionary a chunk reads
    gen = torch.Generator(device=device).manual_seed(1)
    per = T // W + 2  # table rows per slot
    dk = F.normalize(torch.randn(B, H, W * per, D, device=device, generator=gen), dim=-1).to(dtype)
    dv = torch.randn(B, H, W * per, D, device=device, generator=gen).to(dtype)
    sizes = torch.tensor([min(W, c * L * N // (c * L + N)) for c in range(G)], device=device)
    version = 1 + torch.arange(G, device=device) * L // W  # [G]
    counts = ((torch.arange(W, device=device) < sizes[:, None]) * version[:, None])[:, None, None].expand(
        G, B, H, W).contiguous()
    base = (torch.arange(W, device=device) * per).expand(B, H, W).contiguous()
    return dk, dv, counts, base


def bench_length(B, T, dtype, device, pytorch_assign=False):
    from lazoo.kernels.ovq.attention import ovq_chunk_attention
    from lazoo.ops import ovq_attention

    row = {"T": T, "B": B}
    q, k, v = inputs(B, T, dtype, device)
    scale = math.sqrt(D)
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def ovq():
        return ovq_attention(q, k, v, scale=scale, chunk_size=L, max_dict_size=N, backend="triton")[0]

    def sdpa():
        return causal_sdpa(q, k, v)

    with torch.no_grad():
        try:
            _, st = ovq_attention(q, k, v, scale=scale, chunk_size=L, max_dict_size=N, output_final_state=True,
                                  backend="triton")
            row["ovq_state_bytes"] = state_bytes(st)
            row["ovq_dict_size"] = int((st["counts"] > 0).sum(-1).max())
            row.update(decode_ms(q, k, v, st, scale))
            del st
        except torch.OutOfMemoryError:
            row["ovq_state_bytes"] = "oom"
        torch.cuda.empty_cache()
    row["kv_cache_bytes"] = 2 * B * T * H * D * torch.empty((), dtype=dtype).element_size()
    try:
        dk, dv, counts, base = kernel_dictionaries(B, T, dtype, device)
        kernel_leaves = leaves + [dk.requires_grad_(), dv.requires_grad_()]

        def kernel():
            return ovq_chunk_attention(q * scale, k, v, dk, dv, counts, base, L)
    except torch.OutOfMemoryError:
        kernel, kernel_leaves = None, leaves
    cases = [("ovq", ovq, leaves), ("ovq_kernel", kernel, kernel_leaves), ("sdpa", sdpa, leaves)]
    if pytorch_assign:  # the op again with the assignments as a PyTorch loop, and how far its output moves
        def ovq_pytorch_assign():
            return ovq_attention(q, k, v, scale=scale, chunk_size=L, max_dict_size=N, backend="triton",
                                 triton_assign=False)[0]

        try:  # a kernel that does not build here (resources) must not lose the row's other timings
            with torch.no_grad():
                a, b = ovq().float(), ovq_pytorch_assign().float()
            row["pytorch_assign_max_abs_diff"] = float((a - b).abs().max())
            row["pytorch_assign_rel_diff"] = float((a - b).norm() / a.norm())
            cases.insert(1, ("ovq_pytorch_assign", ovq_pytorch_assign, leaves))
        except Exception as err:  # noqa: BLE001  (recorded in the row)
            row["pytorch_assign_error"] = error_text(err)
            print(f"  T={T} PyTorch assign failed: {row['pytorch_assign_error']}", flush=True)
    for name, fn, lv in cases:
        for mode, backward in (("fwd", False), ("fwdbwd", True)):
            row[f"{name}_{mode}_ms"] = "oom" if fn is None else timed(fn, backward, lv)
            print(f"  T={T} {name} {mode}: {row[f'{name}_{mode}_ms']}", flush=True)
    return row


def main(argv=None):
    args = bench_parser("ovq").parse_args(argv)
    require_cuda("ovq")
    device, dtype = "cuda", torch.bfloat16
    meta = {**gpu_environment(), "H": H, "d": D, "N": N, "chunk_size": L, "dtype": "bfloat16",
            "timing": "triton.testing.do_bench median, ms", "pytorch_assign": args.pytorch_assign}
    rows = []
    for T in args.lengths:
        try:
            rows.append(bench_length(args.batch, T, dtype, device, args.pytorch_assign))
        except Exception:  # one length failing must not lose the others
            traceback.print_exc()
            rows.append({"T": T, "B": args.batch, "error": traceback.format_exc(limit=2)})
        torch.cuda.empty_cache()
    cols = ["T", "ovq_fwd_ms", "ovq_fwdbwd_ms", *(["ovq_pytorch_assign_fwd_ms", "ovq_pytorch_assign_fwdbwd_ms",
                                                   "pytorch_assign_rel_diff"] if args.pytorch_assign else []),
            "ovq_kernel_fwd_ms", "ovq_kernel_fwdbwd_ms", "sdpa_fwd_ms",
            "sdpa_fwdbwd_ms", "ovq_decode_ms", "ovq_decode_chunk_form_ms", "sdpa_decode_ms", "ovq_state_bytes",
            "kv_cache_bytes"]
    print("\n" + " | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "-")) for c in cols))
    if args.out:
        write_json(args.out, {"meta": meta, "rows": rows})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
