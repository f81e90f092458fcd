"""The ops package: its names come from the op modules' ``__all__``, every op runs with autocast off, every op with a
``backend`` reads ``LAZOO_BACKEND``, and the Triton kernel variants (VLA's scan, OVQ's assignments) are op arguments
and mixer options."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
from conftest import tiny_model
from test_package_imports import op_module_names
from test_pad_isolation import OPS, _call

from lazoo import ops, registry
from lazoo.ops.dtypes import without_autocast

#: the names lazoo.ops exported when it listed them by hand: all must stay
EXPORTED_BEFORE = {
    "BACKENDS", "ELA_KERNELS", "FEATURE_MAPS", "chunk_gated_linear", "chunk_gla", "chunk_generalized_delta",
    "delta_product", "delta_rule", "ela", "gated_delta_rule", "gated_linear_attention", "gla", "linear_attention",
    "local_linear_attention", "ovq_attention", "ovq_dict_size", "rls", "softmax_attention", "titans", "ttt_linear",
    "ttt_mlp", "vla", "vq_attention",
}
#: the ops that run with autocast off (``dtypes.without_autocast`` on their definitions)
AUTOCAST_OFF = {
    "delta_product", "delta_rule", "ela", "gated_delta_rule", "gated_linear_attention", "gla", "kda",
    "linear_attention", "local_linear_attention", "mamba2", "ovq_attention", "rls", "softmax_attention", "titans",
    "ttt_linear", "ttt_mlp", "vla", "vq_attention",
}
#: the ops with a backend that follow the caller's autocast (ops.bidirectional's docstring says why)
FOLLOWS_AUTOCAST = {"bidirectional_linear_attention"}
#: the rows of test_pad_isolation's table that call the same op
OP_OF_ROW = {"softmax_window": "softmax_attention", "ela_exp": "ela", "ela_sum_sq": "ela", "ela_bidirectional": "ela"}


def op_modules():
    return [sys.modules[f"lazoo.ops.{name}"] for name in op_module_names()]


def test_package_names_are_the_union_of_the_modules_all():
    exported = {"BACKENDS"}
    for module in op_modules():
        for name in module.__all__:
            assert getattr(ops, name) is getattr(module, name), f"lazoo.ops.{name} is not {module.__name__}.{name}"
        assert not exported & set(module.__all__), f"{module.__name__} exports a name another module exports"
        exported |= set(module.__all__)
    assert set(ops.__all__) == exported
    assert EXPORTED_BEFORE <= exported
    assert ops.BACKENDS == registry.BACKENDS  # two copies: neither module may import the other


def test_the_ops_and_only_they_switch_autocast_off():
    wrapper_code = without_autocast(len).__code__  # every function without_autocast returns runs this code
    wrapped = {name for name in ops.__all__ if getattr(getattr(ops, name), "__code__", None) is wrapper_code}
    assert wrapped == AUTOCAST_OFF
    assert {OP_OF_ROW.get(row, row) for row in OPS} == AUTOCAST_OFF | FOLLOWS_AUTOCAST  # the table covers them all


@pytest.mark.parametrize("row", [row for row in OPS if OP_OF_ROW.get(row, row) not in FOLLOWS_AUTOCAST])
def test_ops_give_the_same_result_under_autocast(row):
    x = OPS[row][0](torch.Generator().manual_seed(5))
    o, _ = _call(row, x, 5, backend="chunk", output_final_state=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_autocast, _ = _call(row, x, 5, backend="chunk", output_final_state=False)
    assert o_autocast.dtype == o.dtype == torch.float32
    assert torch.equal(o_autocast, o)


def test_autocast_would_change_an_unwrapped_op():
    # what the previous test guards against: the same op without its decorator computes in bf16 under autocast
    x = OPS["linear_attention"][0](torch.Generator().manual_seed(5))
    plain = ops.linear_attention.__wrapped__
    o, _ = plain(x["q"], x["k"], x["v"], backend="chunk")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_autocast, _ = plain(x["q"], x["k"], x["v"], backend="chunk")
    assert not torch.equal(o_autocast.float(), o)


@pytest.mark.parametrize("row", list(OPS))
def test_lazoo_backend_reaches_every_op(row, monkeypatch):
    op = OP_OF_ROW.get(row, row)
    assert "backend" in inspect.signature(getattr(ops, op)).parameters
    x = OPS[row][0](torch.Generator().manual_seed(6))
    monkeypatch.setenv("LAZOO_BACKEND", "bogus")
    with pytest.raises(ValueError, match=rf"^{op}: unknown backend 'bogus' \(from the LAZOO_BACKEND environment"):
        _call(row, x, 6, output_final_state=False)


def test_every_op_with_a_backend_is_covered():
    with_backend = {name for name in ops.__all__
                    if callable(getattr(ops, name)) and "backend" in inspect.signature(getattr(ops, name)).parameters}
    assert with_backend == {OP_OF_ROW.get(row, row) for row in OPS}


# ----------------------------------------------------------------------------- Triton kernel variants
VARIANTS = [("vla", "triton_scan", "token", ("chunk",), ("chunk ", "Token", None, 1)),
            ("ovq_attention", "triton_assign", True, (False,), ("yes", 1, 0, None))]


@pytest.mark.parametrize("op,arg,default,others,bad", VARIANTS)
def test_triton_variants_are_checked_arguments(op, arg, default, others, bad):
    assert inspect.signature(getattr(ops, op)).parameters[arg].default == default
    x = OPS[op][0](torch.Generator().manual_seed(7))
    for value in bad:  # refused on every backend, naming the argument and the values it takes
        with pytest.raises(ValueError, match=rf"^{op}: {arg} must be one of .*got {value!r}"):
            _call(op, x, 7, backend="chunk", output_final_state=False, **{arg: value})


@pytest.mark.parametrize("op,arg,default,others,bad", VARIANTS)
@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_triton_variants_leave_the_other_backends_alone(op, arg, default, others, bad, backend):
    x = OPS[op][0](torch.Generator().manual_seed(8))
    o, s = _call(op, x, 8, backend=backend, output_final_state=True)
    for value in others:
        o_v, s_v = _call(op, x, 8, backend=backend, output_final_state=True, **{arg: value})
        assert torch.equal(o_v, o)
        assert all(torch.equal(s_v[n], s[n]) for n in s)


@pytest.mark.parametrize("mechanism,op,option,value,default", [("vla", "vla", "triton_scan", "chunk", "token"),
                                                               ("ovq", "ovq_attention", "triton_assign", False, True)])
def test_mixer_option_reaches_the_op(mechanism, op, option, value, default, monkeypatch):
    seen = []
    real = getattr(ops, op)

    def spy(*args, **kwargs):
        seen.append(kwargs[option])
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, op, spy)  # the mixers call ops.<op>
    ids = torch.arange(1, 10)[None]
    for config_value in (value, None):  # set as a typed config field, then left at its default
        overrides = {} if config_value is None else {option: config_value}
        with torch.no_grad():
            tiny_model(mechanism, **overrides)(input_ids=ids)
    n_layers = len(seen) // 2
    assert n_layers and seen == [value] * n_layers + [default] * n_layers
