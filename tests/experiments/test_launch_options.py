"""experiments/launch_options.py: an option set for one kernel is put back after its timing, even when the timing
fails; the candidates name kernels of the op's option table; without a CUDA GPU the script says so."""

from __future__ import annotations

import pytest
import torch
from conftest import load_experiment

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def lo():
    return load_experiment("launch_options")


def test_options_put_the_default_back(lo):
    table = {"h": {"num_warps": 4, "num_stages": 3}}
    default = table["h"]
    with pytest.raises(RuntimeError), lo.options(table, "h", {"num_warps": 8, "num_stages": 2}):
        assert table["h"] == {"num_warps": 8, "num_stages": 2}
        raise RuntimeError("a launch that does not fit")
    assert table["h"] is default


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_candidates_name_real_kernels(lo, name):
    table, _, _, shapes, cands, prefill_only = lo.op_spec(name)
    assert set(cands) <= set(table) and prefill_only <= set(cands)
    assert all(set(cfg) <= {"num_warps", "num_stages", "BK", "BV"} for configs in cands.values() for cfg in configs)
    assert all("BK" not in cfg for k, configs in cands.items() if k != "dqkw" for cfg in configs)
    takes_bv = {"gdn": {"h", "dhu", "o", "dv_local"},  # delta.CONFIGS' "BV" (sequential kernels, _table_bv)
                "kda": {"fwd_wu", "fwd_h", "fwd_o", "bwd_du_local", "bwd_dhu", "bwd_inter", "bwd_wy"}}[name]  # _with_bv
    assert all("BV" not in cfg for k, configs in cands.items() if k not in takes_bv for cfg in configs)
    assert all(len(s) == 4 for s in shapes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_it_says_so(lo):
    with pytest.raises(SystemExit, match="CUDA GPU"):
        lo.main(["check"])


def test_sweep_names_unknown_kernels(lo):
    with pytest.raises(SystemExit, match="--kernels: nope not among"):
        lo.sweep("gdn", 1, ["dqkw", "nope"])
