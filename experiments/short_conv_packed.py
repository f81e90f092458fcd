"""The short convolution on packed sequences: the kernel's packed form (``lazoo.layers.short_conv.PACKED_KERNEL``)
against the masked PyTorch form it would replace, and against the batched kernel on the same tokens, on a CUDA GPU.

    PYTHONPATH=src python experiments/short_conv_packed.py [--channels 2048] [--models gated_delta_net] > out.jsonl

First the layer alone (bf16, kernel size 4, SiLU): forward and forward + backward wall medians
(``triton.testing.do_bench``) and the GPU kernels' time, two rounds, on 16k tokens packed as 32 documents of 512,
as 4 of 4096 and as one 12k document and 8 of 512 (with, for the uniform batches, the batched kernel on the same
tokens as ``[documents, length]``), and each packed form's largest difference from the PyTorch form in the output
and both gradients. Then, for each of ``--models`` (``lazoo.presets`` names; the benchmarks' ~125M shape), a training
step's forward + backward under bf16 autocast on the 32 x 512 packed tokens with each form, and on the same tokens
as a batch of 32 x 512, in turns, two rounds.
"""
from __future__ import annotations

import argparse
import json

import torch

from lazoo.bench.report import gpu_environment
from lazoo.bench.timing import call_ms, kernel_ms, median_ms
from lazoo.bench.variants import variant_settings
from lazoo.layers import short_conv as short_conv_layer

BATCHES = {"32x512": [512] * 32, "4x4096": [4096] * 4, "12288+8x512": [12288] + [512] * 8}
FORMS = {"pytorch packed": False, "kernel packed": True}


def packed_form(kernel: bool):
    return variant_settings([(short_conv_layer, "PACKED_KERNEL", kernel)])


def layer_rows(channels: int, lens: list, r: int):
    """One JSON row a form: ms and differences from the PyTorch form."""
    torch.manual_seed(0)
    conv = short_conv_layer.ShortConvolution(channels, 4).cuda().to(torch.bfloat16)
    T = sum(lens)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(1, T, channels, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    name = "+".join(map(str, lens)) if len(set(lens)) > 1 else f"{len(lens)}x{lens[0]}"
    forms = dict(FORMS)
    if len(set(lens)) == 1:
        forms["kernel batched"] = None
    results = {}
    for form, kernel in forms.items():
        if kernel is None:  # the same tokens as [documents, length]: no packing at all
            def run(x=x):
                return conv(x.view(len(lens), lens[0], channels))[0].reshape(1, T, channels)
        else:
            def run(x=x):
                return conv(x, cu_seqlens=cu)[0]
        with packed_form(bool(kernel)):
            y = run()
            grads = torch.autograd.grad(y, (x, conv.weight), dy)
            results[form] = (y.float(), *(g.float() for g in grads))
            fwd = call_ms(run, rep=100)
            both = call_ms(run, backward=True, leaves=[x, conv.weight], rep=100)
            gpu = sum(kernel_ms(lambda: run().backward(dy), warmup=3).values())
        base = results["pytorch packed"]
        diff = [round((a - b).abs().max().item(), 6) for a, b in zip(results[form], base)]
        yield dict(round=r, batch=name, channels=channels, form=form, fwd_ms=round(fwd, 4), fwd_bwd_ms=round(both, 4),
                   gpu_fwd_bwd_ms=round(gpu, 4), max_diff_y_dx_dw=diff)
    x.grad = conv.weight.grad = None


def model_step_ms(name: str, documents: int = 32, length: int = 512) -> dict:
    """Median ms of a training step's forward + backward: packed with each form, and as a batch."""
    from lazoo.bench.models import MODEL_SIZES, lazoo_model, packed_training_step

    step = packed_training_step(lazoo_model(name, MODEL_SIZES).cuda(), documents, length)
    out = {}
    for r in range(2):
        for form, kernel in FORMS.items():
            with packed_form(kernel):
                out[f"{form} {r}"] = round(median_ms(lambda: step(False), warmup=3, rep=300), 3)
        out[f"batch of {documents} x {length} {r}"] = round(median_ms(lambda: step(True), warmup=3, rep=300), 3)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--channels", type=int, default=2048)
    p.add_argument("--models", default="gated_delta_net")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(f"short_conv_packed.py times kernels on a CUDA GPU; torch {torch.__version__} sees none")
    print(json.dumps(gpu_environment()), flush=True)
    for r in range(2):
        for lens in BATCHES.values():
            for row in layer_rows(args.channels, lens, r):
                print(json.dumps(row), flush=True)
    for name in filter(None, args.models.split(",")):
        print(json.dumps(dict(model=name, tokens="32 x 512", fwd_bwd_ms=model_step_ms(name))), flush=True)


if __name__ == "__main__":
    main()
