"""Triton OVQ attention (lazoo.kernels.ovq.attention): the chunk-attention kernel against a float64 softmax written
out here (dictionaries with empty slots, a ragged last chunk, the log-count bias; gradients of q, k, v and
both dictionaries), and ``ovq_attention(backend="triton")`` against the float64 recurrent form (outputs,
every part of the final state, gradients of q, k, v, β and the initial dictionaries and partial chunk).

CPU: the ``interp_*`` tests run in a fresh process with TRITON_INTERPRET=1 (see test_kernels_delta.py).
GPU (``-m gpu``): T = 1024, d = 128, bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_close, forward_and_grads, left_pad_mask, rel_err, state_parts
from torch.utils._pytree import tree_structure

from lazoo.ops import ovq_attention

pytest.importorskip("triton")
from lazoo.kernels._utils import interpreter_ready  # noqa: E402

INTERP = interpreter_ready()
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 from the start")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F64 = torch.float64


# ----------------------------------------------------------------------------- the chunk kernel
def chunk_attention_reference(q, k, v, Dk, Dv, counts, L, length):
    """Per chunk: softmax over [dictionary (bias log counts, empty slots excluded); the chunk's keys
    (causal, positions < length)], written with dense float64 matrices."""
    B, T, H, _ = q.shape
    outs = []
    for g in range(T // L):
        Q, K, V = (x[:, g * L:(g + 1) * L].transpose(1, 2) for x in (q, k, v))  # [B, H, L, d]
        bias = torch.where(counts[g] > 0, counts[g].clamp_min(1).to(q.dtype).log(),
                           torch.full((), -math.inf, dtype=q.dtype, device=q.device))
        pos = g * L + torch.arange(L, device=q.device)
        allowed = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()[None, None] \
            & (pos[None, :] < length[:, None])[:, None, None, :]
        logits = torch.cat([Q @ Dk[g].transpose(-1, -2) + bias[:, :, None, :],
                            (Q @ K.transpose(-1, -2)).masked_fill(~allowed, -math.inf)], -1)
        p = torch.softmax(logits, -1)
        W = Dk.shape[3]
        outs.append((p[..., :W] @ Dv[g] + p[..., W:] @ V).transpose(1, 2))
    return torch.cat(outs, 1)


def chunk_inputs(B, G, L, H, W, R, dk, dv, seed=0, device="cpu"):
    """Random version tables [B, H, R, d] and, per chunk, each slot's count (small, so chunks and slots share
    rows: a row's gradient sums several readers) and the base its rows start from."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, G * L, H, dk, generator=gen, dtype=F64), dim=-1) * 3.0
    k = F.normalize(torch.randn(B, G * L, H, dk, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, G * L, H, dv, generator=gen, dtype=F64)
    Dk = F.normalize(torch.randn(B, H, R, dk, generator=gen, dtype=F64), dim=-1) * 0.8
    Dv = torch.randn(B, H, R, dv, generator=gen, dtype=F64)
    counts = torch.randint(1, 6, (G, B, H, W), generator=gen)
    size = torch.randint(1, W + 1, (G, B, H), generator=gen)
    size[0] = 0  # the first chunk has an empty dictionary
    counts = counts * (torch.arange(W) < size[..., None])  # active prefix, empty slots after it
    counts[-1, 0, 0, 1] = 0  # and one empty slot inside a prefix: masked by its count
    base = torch.randint(0, R - 5, (B, H, W), generator=gen)
    return [x.to(device) for x in (q, k, v, Dk, Dv, counts, base)]


def per_chunk(table, counts, base):
    """The dictionary each chunk reads from a version table: [G, B, H, W, d]."""
    rows = base[None] + counts  # [G, B, H, W]
    G = counts.shape[0]
    return table[None].expand(G, -1, -1, -1, -1).gather(3, rows[..., None].expand(-1, -1, -1, -1, table.shape[-1]))


def check_chunk_kernel(B, G, L, H, W, R, dk, dv, length, dtype, rtol, grad_rtol, device="cpu"):
    from lazoo.kernels.ovq.attention import ovq_chunk_attention

    q, k, v, Dk, Dv, counts, base = chunk_inputs(B, G, L, H, W, R, dk, dv, device=device)
    length = torch.tensor(length, device=device)
    names = ("q", "k", "v", "Dk", "Dv")
    ref = {n: x.clone().requires_grad_() for n, x in zip(names, (q, k, v, Dk, Dv))}
    tst = {n: x.to(dtype).requires_grad_() for n, x in zip(names, (q, k, v, Dk, Dv))}
    ro = chunk_attention_reference(ref["q"], ref["k"], ref["v"], per_chunk(ref["Dk"], counts, base),
                                   per_chunk(ref["Dv"], counts, base), counts, L, length)
    to = ovq_chunk_attention(*tst.values(), counts, base, L, length=length)
    w = torch.randn(ro.shape, generator=torch.Generator().manual_seed(9), dtype=F64).to(device)
    rg = torch.autograd.grad((ro * w).sum(), list(ref.values()))
    tg = torch.autograd.grad((to.double() * w).sum(), list(tst.values()))
    errs = {"o": rel_err(to, ro)} | {f"d{n}": rel_err(a, b) for n, a, b in zip(names, tg, rg)}
    print("ovq chunk kernel rel errors: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    assert to.dtype == dtype
    assert_close(to.double(), ro, rtol, "output")
    for n, a, b in zip(names, tg, rg):
        assert_close(a.double(), b, grad_rtol, f"grad {n}")
    # rows no chunk reads get no gradient; some rows are read by several (chunk, slot) pairs
    read = torch.zeros(B, H, R, dtype=torch.long, device=device)
    rows = (base[None] + counts).masked_fill(counts == 0, 0)
    read.scatter_add_(2, rows.permute(1, 2, 0, 3).reshape(B, H, -1), (counts > 0).long().permute(1, 2, 0, 3)
                      .reshape(B, H, -1))
    assert int(read.max()) > 1
    assert tg[3][read == 0].abs().max() == 0


@needs_interp
def test_interp_chunk_kernel_matches_float64():
    # 3 chunks of 20 (not a tile multiple), 37 slots (3 key blocks) in tables of 50 rows, a ragged end for
    # sample 1
    check_chunk_kernel(2, 3, 20, 2, 37, 50, 24, 20, [60, 47], torch.float32, 1e-5, 1e-5)


# ----------------------------------------------------------------------------- the op
def op_inputs(B, T, H, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, dk, generator=gen, dtype=F64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen, dtype=F64)
    beta = torch.linspace(2.0, 4.0, H, dtype=F64)
    return dict(q=q, k=k, v=v, beta=beta)


def check_op(x, L, N, mask, rtol, grad_rtol, state=None, dtype=torch.float32, device="cpu", **op_kwargs):
    """The op on ``backend="triton"`` (with ``op_kwargs``) against the float64 recurrent form."""
    state_leaves = ("Dk", "Dv", "k", "v") if state is not None else ()

    def run(leaves, backend):
        st = None
        if state is not None:
            st = {n: leaves[n] if n in state_leaves else state[n].to(device) for n in state}
        return ovq_attention(leaves["q"], leaves["k_"], leaves["v_"], scale=leaves["beta"], chunk_size=L,
                             max_dict_size=N, initial_state=st, output_final_state=True,
                             mask=None if mask is None else mask.to(device), backend=backend, **op_kwargs)

    def leaves(dt, dev, sdt):
        out = {"q": x["q"], "k_": x["k"], "v_": x["v"], "beta": x["beta"]}
        out = {n: t.to(dev, dt) for n, t in out.items()}
        out |= {n: state[n].to(dev, sdt) for n in state_leaves}
        return {n: t.clone().requires_grad_() for n, t in out.items()}

    ref = leaves(F64, "cpu", F64)
    ro, rs, rg = forward_and_grads(lambda: run(ref, "recurrent"), ref)
    sdt = torch.float32 if dtype != F64 else F64
    tst = leaves(dtype, device, sdt)
    to, ts, tg = forward_and_grads(lambda: run(tst, "triton"), tst)
    errs = {"o": rel_err(to, ro)} | {n: rel_err(a.double(), b.double())
                                     for (n, a), (_, b) in zip(state_parts(ts), state_parts(rs))}
    errs |= {f"d{n}": rel_err(tg[n], rg[n]) for n in tst}
    print("ovq triton rel errors: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    assert to.dtype == dtype
    assert_close(to.cpu().double(), ro, rtol, "output")
    for (name, a), (_, b) in zip(state_parts(ts), state_parts(rs)):
        if a.is_floating_point():
            assert_close(a.cpu().double(), b, rtol, name)
        else:
            assert torch.equal(a.cpu(), b), name
    for n in tst:
        assert tg[n] is not None, f"no gradient reaches {n}"
        assert_close(tg[n].cpu().double(), rg[n], grad_rtol, f"grad {n}")


@needs_interp
def test_interp_op_matches_recurrent_with_padding_and_a_carried_state():
    # a state with a dictionary and different partial chunks per sample (t = 21, 13, 6), then 45 tokens
    # with left padding and a hole, and a bigger dictionary budget than the state was built with
    x0 = op_inputs(3, 21, 2, 16, 12, seed=1)
    with torch.no_grad():
        _, state = ovq_attention(x0["q"], x0["k"], x0["v"], scale=x0["beta"], chunk_size=8, max_dict_size=9,
                                 mask=left_pad_mask([21, 13, 6], 21), output_final_state=True, backend="chunk")
    mask = left_pad_mask([45, 30, 17], 45, holes=[(0, 21)])
    check_op(op_inputs(3, 45, 2, 16, 12), 8, 12, mask, 1e-5, 1e-5, state=state)


@needs_interp
def test_interp_op_decoding_one_token_uses_the_state():
    x = op_inputs(2, 19, 1, 16, 16, seed=3)
    with torch.no_grad():
        whole, s_whole = ovq_attention(x["q"], x["k"], x["v"], chunk_size=8, max_dict_size=10,
                                       output_final_state=True, backend="recurrent")
        xf = {n: t.float() for n, t in x.items()}
        o, st = ovq_attention(xf["q"][:, :17], xf["k"][:, :17], xf["v"][:, :17], chunk_size=8, max_dict_size=10,
                              output_final_state=True, backend="triton")
        outs, structures = [o], [tree_structure(st)]
        for t in (17, 18):
            o, st = ovq_attention(xf["q"][:, t:t + 1], xf["k"][:, t:t + 1], xf["v"][:, t:t + 1], chunk_size=8,
                                  max_dict_size=10, initial_state=st, output_final_state=True, backend="triton")
            outs.append(o)
            structures.append(tree_structure(st))
    # a static cache copies each new state into the last one's buffers: the keys and their order must not change
    assert all(s == tree_structure(s_whole) for s in structures), [str(s) for s in structures]
    assert_close(torch.cat(outs, 1).double(), whole, 1e-5, "decoded output")
    assert_close(st["Dk"].double(), s_whole["Dk"], 1e-5, "decoded Dk")
    assert torch.equal(st["counts"], s_whole["counts"])


@needs_interp
def test_interp_decode_kernel_across_chunk_ends_with_padding():
    # two samples (one left-padded by 5), a prompt, then one token at a time through two chunk ends (L = 8):
    # every decoded output and the final state equal the float64 recurrent pass over the whole sequence
    x = op_inputs(2, 30, 2, 16, 12, seed=5)
    mask = left_pad_mask([30, 25], 30)
    kw = dict(scale=x["beta"], chunk_size=8, max_dict_size=10, output_final_state=True)
    with torch.no_grad():
        whole, s_whole = ovq_attention(x["q"], x["k"], x["v"], mask=mask, backend="recurrent", **kw)
        xf = {n: t.float() for n, t in x.items()}
        kwf = dict(kw, scale=xf["beta"])
        o, st = ovq_attention(xf["q"][:, :11], xf["k"][:, :11], xf["v"][:, :11], mask=mask[:, :11],
                              backend="triton", **kwf)
        outs = [o]
        for t in range(11, 30):
            o, st = ovq_attention(xf["q"][:, t:t + 1], xf["k"][:, t:t + 1], xf["v"][:, t:t + 1],
                                  mask=mask[:, t:t + 1], initial_state=st, backend="triton", **kwf)
            outs.append(o)
    assert_close(torch.cat(outs, 1).double(), whole, 1e-5, "decoded output")
    for name in ("Dk", "Dv", "k", "v"):
        assert_close(st[name].double(), s_whole[name], 1e-5, f"decoded {name}")
    assert torch.equal(st["counts"], s_whole["counts"]) and torch.equal(st["t"], s_whole["t"])


@needs_interp
def test_interp_decoding_after_the_ops_state_reads_nothing_back(monkeypatch):
    """A state this op returned carries its token counts on the host: one-token steps (no mask) after it take
    _ovq_decode_step, which reads nothing back between chunk ends, through two chunk ends and a sample that starts
    mid-chunk, equal to the float64 recurrent pass over the whole sequence; the counts stay the device's."""
    import lazoo.ops.ovq as ovq_mod

    steps = []
    real_step = ovq_mod._ovq_decode_step
    monkeypatch.setattr(ovq_mod, "_ovq_decode_step", lambda *a: steps.append(1) or real_step(*a))
    monkeypatch.setattr(ovq_mod, "_ovq_recurrent", lambda *a, **k: pytest.fail("the per-token form ran"))
    x = op_inputs(2, 26, 2, 16, 12, seed=8)
    kw = dict(scale=x["beta"], chunk_size=8, max_dict_size=10, output_final_state=True)
    with torch.no_grad():
        whole, s_whole = ovq_attention(x["q"], x["k"], x["v"], backend="chunk", **kw)
        xf = {n: t.float() for n, t in x.items()}
        kwf = dict(kw, scale=xf["beta"])
        o, st = ovq_attention(xf["q"][:, :5], xf["k"][:, :5], xf["v"][:, :5], backend="triton", **kwf)
        outs = [o]
        for t in range(5, 26):  # chunk ends after tokens 8, 16 and 24
            assert torch.equal(ovq_mod._returned_host_t(st), st["t"].cpu())
            o, st = ovq_attention(xf["q"][:, t:t + 1], xf["k"][:, t:t + 1], xf["v"][:, t:t + 1], initial_state=st,
                                  backend="triton", **kwf)
            outs.append(o)
    assert len(steps) == 21
    assert_close(torch.cat(outs, 1).double(), whole, 1e-5, "decoded output")
    for name in ("Dk", "Dv", "k", "v"):
        assert_close(st[name].double(), s_whole[name], 1e-5, f"decoded {name}")
    assert torch.equal(st["counts"], s_whole["counts"]) and torch.equal(st["t"], s_whole["t"])
    assert torch.equal(ovq_mod._returned_host_t(st), st["t"])


@pytest.mark.parametrize("T, L, N", [(45, 8, 12), (64, 8, 5), (130, 16, 40), (7, 8, 9), (300, 4, 1000)])
def test_an_empty_dictionary_holds_ovq_dict_size_slots_after_whole_chunks(T, L, N):
    """The Triton path's training case takes the dictionary's width from the host as ovq_dict_size(c·L) after c
    whole chunks from an empty dictionary: the size the chunk form reaches, growing (45, 130, 300), at its budget
    (64) and before any complete chunk (7)."""
    from lazoo.ops.ovq import ovq_dict_size

    x = op_inputs(2, T, 2, 8, 8, seed=T)
    with torch.no_grad():
        _, st = ovq_attention(x["q"], x["k"], x["v"], chunk_size=L, max_dict_size=N, output_final_state=True,
                              backend="chunk")
    sizes = (st["counts"] > 0).sum(-1)
    assert (sizes == ovq_dict_size(T // L * L, N)).all()


@needs_interp
@pytest.mark.parametrize("T", [45, 48])
def test_interp_op_without_state_or_mask_reads_nothing_back(monkeypatch, T):
    """Training's case (no state, no mask) on the Triton path: the packed length and the dictionary's width come
    from the host, so no tensor is read back, and the op equals the float64 recurrent form at a length that is or
    is not a chunk multiple, with the dictionary filling its budget and then merging; with a mask of ones (which
    reads back) the output is the same to the bit."""
    x = op_inputs(2, T, 2, 16, 12, seed=11)
    check_op(x, 8, 12, None, 1e-5, 1e-5)
    xf = {n: t.float().requires_grad_() for n, t in x.items()}
    kw = dict(chunk_size=8, max_dict_size=12, backend="triton")
    with torch.no_grad():
        masked = ovq_attention(xf["q"], xf["k"], xf["v"], scale=xf["beta"], mask=torch.ones(2, T, dtype=torch.bool),
                               **kw)[0]
    read = []
    for name in ("__int__", "__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, real=real, name=name: read.append(name) or real(t, *a))
    unmasked = ovq_attention(xf["q"], xf["k"], xf["v"], scale=xf["beta"], **kw)[0]
    unmasked.sum().backward()
    monkeypatch.undo()
    assert read == [], read
    assert torch.equal(unmasked.detach(), masked)
    assert all(xf[n].grad is not None for n in xf)


def test_a_state_edited_outside_the_op_is_checked_again():
    """Only a state as the op returned it skips the value checks: with a part replaced it is checked, and refused
    when a centroid holds NaN; a cache's batch edit (new tensors in every part) drops the mark."""
    import lazoo.ops.ovq as ovq_mod
    from lazoo.models.cache import _map_batch

    x = op_inputs(2, 6, 1, 8, 8)
    _, st = ovq_attention(x["q"], x["k"], x["v"], chunk_size=4, max_dict_size=4, output_final_state=True,
                          backend="chunk")
    assert torch.equal(ovq_mod._returned_host_t(st), torch.tensor([6, 6]))
    edited = dict(st, Dk=st["Dk"].clone())
    edited["Dk"][0, 0, 0, 0] = float("nan")
    assert ovq_mod._returned_host_t(edited) is None
    with pytest.raises(ValueError, match="NaN or inf"):
        ovq_attention(x["q"][:, :1], x["k"][:, :1], x["v"][:, :1], chunk_size=4, max_dict_size=4,
                      initial_state=edited, backend="chunk")
    assert ovq_mod._returned_host_t(_map_batch(st, lambda t: t.index_select(0, torch.tensor([1, 0])))) is None


def test_decoding_one_token_runs_the_decode_kernel(monkeypatch):
    """backend="triton", one token, no autograd: the per-token form with the attention in the decode kernel."""
    import lazoo.ops.ovq as ovq_mod

    seen = []
    monkeypatch.setattr(ovq_mod, "_attend_token_triton",
                        lambda *a: seen.append(1) or ovq_mod._attend_token(*a))
    monkeypatch.setattr(ovq_mod, "resolve_backend", lambda *a, **k: "triton")
    x = op_inputs(1, 1, 1, 8, 8)
    ovq_attention(x["q"].float(), x["k"].float(), x["v"].float(), chunk_size=4, backend="triton")
    assert seen == [1]


def test_gpu_launches_keep_the_tiles_that_build_right():
    """On an H100 (Triton 3.6) the dk, dv kernels gave wrong gradients with 32 query rows a tile (relative 2e-3 to
    0.17; the interpreter is exact there): their launches keep BM >= 64, and every launch's tiles fit the chunk."""
    from lazoo.kernels.ovq import attention as ovq

    assert set(ovq.LAUNCH) == {"fwd", "dq", "dkv_chunk", "dkv_dict"}
    for name, cfg in ovq.LAUNCH.items():
        assert {"BM", "BN", "num_warps", "num_stages"} <= set(cfg), name
        assert cfg["BM"] in (16, 32, 64, 128) and cfg["BN"] in (16, 32, 64, 128), name
    assert ovq.LAUNCH["dkv_chunk"]["BM"] >= 64 and ovq.LAUNCH["dkv_dict"]["BM"] >= 64


def test_triton_backend_errors_are_clear():
    x = op_inputs(1, 5, 1, 8, 8)
    with pytest.raises(NotImplementedError, match="float64"):
        ovq_attention(x["q"], x["k"], x["v"], chunk_size=4, backend="triton")
    big = torch.randn(1, 5, 1, 160)
    with pytest.raises(NotImplementedError, match="head dims up to 128"):
        ovq_attention(big, big, big, chunk_size=4, backend="triton")


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
def test_gpu_chunk_kernel_bf16_T1024_d128():
    check_chunk_kernel(2, 8, 128, 4, 700, 1500, 128, 128, [1024, 1000], torch.bfloat16, 2e-2, 5e-2, device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_op_bf16_T1024_d128():
    # the float64 reference is the chunk form (same definition as the recurrent one, tested against it);
    # bf16 inputs: logits carry ~1e-2 absolute error (β ≈ 11), assignments may flip on near ties
    x = op_inputs(2, 1024, 4, 128, 128, seed=4)
    x = {n: t.to(torch.bfloat16).to(F64) for n, t in x.items()}
    x["beta"] = torch.full((4,), math.sqrt(128.0), dtype=F64)

    def run(dt, backend):
        leaves = {n: t.to("cuda", dt).requires_grad_() for n, t in x.items()}
        o, s = ovq_attention(leaves["q"], leaves["k"], leaves["v"], scale=leaves["beta"], chunk_size=128,
                             max_dict_size=2048, output_final_state=True, backend=backend)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to("cuda")
        grads = torch.autograd.grad((o.double() * w).sum(), [leaves[n] for n in ("q", "k", "v")])
        return o, s, grads

    ro, rs, rg = run(F64, "chunk")
    to, ts, tg = run(torch.bfloat16, "triton")
    assert torch.equal(ts["counts"].sum(-1), rs["counts"].sum(-1))
    assert_close(to.double(), ro, 3e-2, "output")
    assert_close(ts["Dk"].double(), rs["Dk"], 2e-2, "Dk")
    for n, a, b in zip("qkv", tg, rg):
        assert_close(a.double(), b, 6e-2, f"grad {n}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_decoding_steps_do_not_synchronise():
    """One-token steps after the op's own state wait for nothing on the GPU between chunk ends (CUDA's sync debug
    mode raises on any synchronising call), and match the chunk form through a chunk end."""
    import lazoo.ops.ovq as ovq_mod

    x = op_inputs(2, 300, 4, 128, 64, seed=7)
    x = {n: t.to("cuda", torch.bfloat16) for n, t in x.items()}
    kw = dict(scale=x["beta"], chunk_size=128, max_dict_size=512, output_final_state=True)
    with torch.no_grad():
        _, st = ovq_attention(x["q"][:, :250], x["k"][:, :250], x["v"][:, :250], backend="triton", **kw)
        st_ref = st  # the chunk form beside it
        for t in range(250, 300):  # a chunk ends at token 256
            step = [x[n][:, t:t + 1] for n in ("q", "k", "v")]
            ends = int(ovq_mod._returned_host_t(st)[0]) % 128 == 127
            if not ends:
                torch.cuda.set_sync_debug_mode("error")
            try:
                o, st = ovq_attention(*step, initial_state=st, backend="triton", **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            o_ref, st_ref = ovq_attention(*step, initial_state=dict(st_ref), backend="chunk", **kw)
            assert_close(o.double(), o_ref.double(), 1e-2, f"token {t}")
    assert torch.equal(st["counts"], st_ref["counts"])
    assert_close(st["Dk"].double(), st_ref["Dk"].double(), 1e-5, "Dk")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1000, 1024])
def test_gpu_training_step_does_not_synchronise(T):
    """Training's case (no state, no mask) waits for nothing on the GPU in the forward or the backward: CUDA's sync
    debug mode raises on any synchronising call. A warm-up step first builds and captures what is cached."""
    x = op_inputs(2, T, 4, 64, 64, seed=8)
    # bf16 activations and a per-head fp32 scale that learns, as a model's layer passes them
    leaves = {n: t.to("cuda", torch.float32 if n == "beta" else torch.bfloat16).requires_grad_() for n, t in x.items()}
    kw = dict(chunk_size=128, max_dict_size=512, backend="triton")
    for warm in (True, False):
        if not warm:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            o = ovq_attention(leaves["q"], leaves["k"], leaves["v"], scale=leaves["beta"], **kw)[0]
            grads = torch.autograd.grad(o.float().square().sum(), list(leaves.values()))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(o).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_kernel_matches_the_chunk_form():
    # a 1000-token prompt (d = 128, N = 2048, L = 128), then 40 tokens one at a time through a chunk end: the decode
    # kernel against the PyTorch chunk form on the same states (fp32 state, bf16 inputs)
    x = op_inputs(2, 1040, 4, 128, 128, seed=6)
    x = {n: t.to("cuda", torch.bfloat16) for n, t in x.items()}
    kw = dict(scale=x["beta"], chunk_size=128, max_dict_size=2048, output_final_state=True)
    with torch.no_grad():
        _, st = ovq_attention(x["q"][:, :1000], x["k"][:, :1000], x["v"][:, :1000], backend="triton", **kw)
        st_ref = dict(st)
        for t in range(1000, 1040):
            step = [x[n][:, t:t + 1] for n in ("q", "k", "v")]
            o, st = ovq_attention(*step, initial_state=st, backend="triton", **kw)
            o_ref, st_ref = ovq_attention(*step, initial_state=st_ref, backend="chunk", **kw)
            assert_close(o.double(), o_ref.double(), 1e-2, f"token {t}")
    assert torch.equal(st["counts"], st_ref["counts"])
    assert_close(st["Dk"].double(), st_ref["Dk"].double(), 1e-5, "Dk")
