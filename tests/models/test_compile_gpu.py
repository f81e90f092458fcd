"""torch.compile on a CUDA device, over the Triton kernels: generate's compiled decode steps (static cache, CUDA graphs)
give the eager tokens, a compiled training step gives the eager loss and gradients, and the recurrent mechanisms trace
with no graph break. Run with `pytest -m gpu`."""

import copy
import statistics

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

import lazoo
import lazoo.presets
from lazoo.models import graph_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODELS = [*lazoo.list_mechanisms(), "hybrid", "sw-gdn"]
#: the mechanisms whose state is a fixed-size recurrence (not a KV cache)
RECURRENT = [n for n in lazoo.list_mechanisms() if n not in ("softmax", "sliding_window", "local_linear")]
VOCAB = 211


def make_model(name, dtype=torch.float32):
    kw = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
              sliding_window=16, pad_token_id=0)
    if name == "hybrid":
        cfg = AutoConfig.for_model("lazoo_hybrid", layer_types=["sliding_window", "vla"], **kw)
    elif name in lazoo.presets.HYBRIDS:
        cfg = lazoo.presets.build_config(name, **kw)
    else:
        cfg = AutoConfig.for_model(f"lazoo_{name}", **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).cuda()
    with torch.no_grad():  # no weight left at an init value (unit norms, identity maps)
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.to(dtype)


def left_padded():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 24), generator=gen).cuda()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :11] = 0
    return ids, mask


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


@pytest.mark.parametrize("name", MODELS)
def test_compiled_generate_equals_eager(name):
    model = make_model(name).eval()
    ids, mask = left_padded()
    with torch.no_grad():  # 40 tokens: the first, an eager round of 16 steps, then captured ones
        for kwargs in (dict(do_sample=False), dict(do_sample=True, top_k=50)):
            torch.manual_seed(5)
            eager = model.generate(ids, attention_mask=mask, max_new_tokens=40, cache_implementation="dynamic",
                                   **kwargs)
            torch.manual_seed(5)
            compiled = model.generate(ids, attention_mask=mask, max_new_tokens=40, cache_implementation="static",
                                      decode_steps_per_graph=0, **kwargs)  # transformers' loop, compiled
            assert torch.equal(eager, compiled), kwargs
            torch.manual_seed(5)
            rounds = model.generate(ids, attention_mask=mask, max_new_tokens=40, **kwargs)  # the default
            assert torch.equal(eager, rounds), kwargs
            assert isinstance(graph_decode.LOOPS[model].graph, torch.cuda.CUDAGraph), kwargs
            torch.manual_seed(5)
            default = model.generate(ids, attention_mask=mask, max_new_tokens=40, return_dict_in_generate=True,
                                     **kwargs)  # a returned cache: transformers' loop on the static cache, compiled
            assert torch.equal(eager, default.sequences), kwargs
            cache = getattr(default, "cache", None) or default.past_key_values  # its name from transformers 5.24
            assert cache.static, kwargs
    assert getattr(model, "_compiled_call", None) is not None, "generate did not compile its decode steps"
    assert not counters["graph_break"], dict(counters["graph_break"])


def loss_and_grads(model, forward, ids, bf16):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        loss = forward(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def relative_errors(grads, reference):
    assert grads.keys() == reference.keys()
    return {n: ((grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in reference.items()}


def float64_reference(model, ids):
    """The loss and gradients of a float64 copy (the ops' PyTorch forms: the Triton kernels take no float64)."""
    reference = copy.deepcopy(model).double()
    return loss_and_grads(reference, reference, ids, bf16=False)


@pytest.mark.parametrize("name", RECURRENT + ["sw-gdn"])
def test_compiled_training_step_equals_eager(name):
    """Compiled and eager are both held to a float64 copy of the model: the compiled step must be as close to it as
    the eager step is, gradient by gradient. (Compiled and eager need not run the same kernels: OVQ's compiled
    form is its chunk form, closer to float64 in float32 than its Triton form's TF32 products.)"""
    model = make_model(name).train()
    compiled = torch.compile(model)
    ids = torch.randint(1, VOCAB, (2, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    ref_loss, ref_grads = float64_reference(model, ids)
    # float32: every gradient within twice the eager one's distance from float64, or 1e-4
    loss, grads = loss_and_grads(model, model, ids, bf16=False)
    compiled_loss, compiled_grads = loss_and_grads(model, compiled, ids, bf16=False)
    assert abs(compiled_loss - ref_loss) <= 1e-5 * abs(ref_loss)
    eager_errors, compiled_errors = relative_errors(grads, ref_grads), relative_errors(compiled_grads, ref_grads)
    worse = {n: (e, eager_errors[n]) for n, e in compiled_errors.items() if e > 2 * eager_errors[n] + 1e-4}
    assert not worse, worse
    # bf16 autocast: the compiler rounds where it fuses, and a discrete choice (vq's nearest code) can flip, so
    # single gradients move by 10-20 %; the loss and the median gradient stay as close to float64 as eager's
    loss, grads = loss_and_grads(model, model, ids, bf16=True)
    compiled_loss, compiled_grads = loss_and_grads(model, compiled, ids, bf16=True)
    assert abs(compiled_loss - ref_loss) <= 2 * abs(loss - ref_loss) + 2e-3 * abs(ref_loss)
    median = lambda errors: statistics.median(errors.values())  # noqa: E731
    eager_median = median(relative_errors(grads, ref_grads))
    compiled_median = median(relative_errors(compiled_grads, ref_grads))
    assert compiled_median <= 2 * eager_median + 0.02, (compiled_median, eager_median)
    assert not counters["graph_break"], dict(counters["graph_break"])


def break_reasons(fn, *args):
    explanation = dynamo.explain(fn)(*args)
    return [str(r.reason).splitlines()[0] for r in explanation.break_reasons]


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_mechanisms_trace_without_graph_breaks(name):
    model = make_model(name, torch.bfloat16)
    ids, mask = left_padded()
    assert break_reasons(lambda i, m: model(input_ids=i, attention_mask=m, labels=i).loss, ids, mask) == []
    model.eval()
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        step = torch.ones_like(ids[:, :1])
        positions = mask.sum(1, keepdim=True)
        assert break_reasons(lambda i: model(input_ids=i, attention_mask=step, position_ids=positions, cache=cache,
                                             use_cache=True).logits, ids[:, :1].contiguous()) == []
