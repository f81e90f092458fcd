"""The short convolution's backward on the GPU: the one-kernel backward (``lazoo.kernels.short_conv``) against the
two kernels it replaced (``kernels_before.py``: the file as it was at 04be032), bf16, K = 4: kernel time from the
profiler with the L2 cache flushed between calls (the dw partial sum included), the relative difference of dx and
dw between the two, and the host time of a call.

    PYTHONPATH=src python experiments/short_conv_backward/timing.py
"""
import os
import sys
import time
from types import SimpleNamespace

import torch
import triton
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
import kernels_before as sc_orig  # noqa: E402

from lazoo.kernels import short_conv as ksc  # noqa: E402

dev = "cuda"
flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)


def ktimes(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type != DeviceType.CUDA:
            continue
        if "FillFunctor" in e.key:
            continue
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        out[e.key[:40]] = t / reps
    return out

def orig_bwd(x, w, dy, silu):
    B, T, C = x.shape
    K = w.shape[1]
    BT, BC, warps = 16, min(128, triton.next_power_of_2(C)), 4
    grid = (triton.cdiv(T, BT), triton.cdiv(C, BC), B)
    dpre = torch.empty(B, T, C, dtype=torch.float32, device=dev)
    dw_part = torch.empty(B, grid[0], C, K, dtype=torch.float32, device=dev)
    sc_orig._bwd_dpre_kernel[grid](x, w, dy, dpre, dw_part, T, C, K=K, SILU=silu, BT=BT, BC=BC, num_warps=warps)
    dx = torch.empty_like(x)
    sc_orig._bwd_dx_kernel[grid](dpre, w, dx, T, C, K=K, BT=BT, BC=BC, num_warps=warps)
    return dx, dw_part.sum((0, 1))


def new_bwd(x, w, dy, silu):
    return ksc._ShortConv.backward(SimpleNamespace(saved_tensors=(x, w), silu=silu), dy)[:2]

def with_L(L):
    def f(x, w, dy, silu):
        B, T, C = x.shape
        K = w.shape[1]
        _, R, BC, warps = ksc._bwd_blocks(B, T, C)
        grid = (triton.cdiv(T, L), triton.cdiv(C, BC), B)
        dx = torch.empty_like(x)
        dw_part = torch.empty(B, grid[0], C, K, dtype=torch.float32, device=dev)
        ksc._bwd_kernel[grid](x, w, dy, dx, dw_part, T, C, T * C, C, L, K=K, SILU=silu, R=R, BC=BC, num_warps=warps)
        return dx, dw_part.sum((0, 1))
    return f

def host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6

print(torch.__version__, triton.__version__, flush=True)
print(f"{'shape':22s} {'act':5s} {'L':>4s} {'orig us':>8s} {'new us':>8s} {'floor':>6s}  err dx / dw vs orig",
      flush=True)
for (B, T, C), silu, extra in (((1, 512, 768), True, (4, 8, 16)), ((1, 2048, 768), True, (4, 8, 16)),
                               ((1, 4096, 2048), True, ()), ((1, 4096, 2048), False, ()), ((8, 2048, 2048), True, ()),
                               ((1, 32768, 2048), True, ()), ((4, 4096, 2048), True, ())):
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(B, T, C, device=dev, generator=g).to(torch.bfloat16)
    dy = torch.randn(B, T, C, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(C, 4, device=dev, generator=g) / 2).contiguous()
    rdx, rdw = orig_bwd(x, w, dy, silu)
    dx, dw = new_bwd(x, w, dy, silu)
    ex = ((dx.float() - rdx.float()).norm() / rdx.float().norm()).item()
    ew = ((dw - rdw).norm() / rdw.norm()).item()
    to = sum(ktimes(lambda: orig_bwd(x, w, dy, silu)).values())
    tn = ktimes(lambda: new_bwd(x, w, dy, silu))
    L = ksc._bwd_blocks(B, T, C)[0]
    floor = 3 * x.numel() * 2 / 4.3e12 * 1e6
    det = " ".join(f"{k.split('(')[0][:12]}={v:.1f}" for k, v in tn.items())
    print(f"{str((B, T, C)):22s} {'silu' if silu else 'none':5s} {L:4d} {to:8.1f} {sum(tn.values()):8.1f} "
          f"{floor:6.1f}  "
          f"{ex:.1e} / {ew:.1e}  [{det}]", flush=True)
    for L2 in extra:
        print(f"     L={L2}: {sum(ktimes(lambda: with_L(L2)(x, w, dy, silu)).values()):.1f} us", flush=True)
x = torch.randn(1, 4096, 2048, device=dev, dtype=torch.bfloat16)
w = torch.randn(2048, 4, device=dev)
print(f"host us a call (no sync): orig {host_us(lambda: orig_bwd(x, w, x, True)):.0f}, "
      f"new {host_us(lambda: new_bwd(x, w, x, True)):.0f}", flush=True)
