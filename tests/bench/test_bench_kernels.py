"""lazoo.bench.kernels' bookkeeping on the CPU (its timings need a CUDA GPU): the rates and the roofline of a
row, the kernel targets, the Triton cache folder it keeps across runs and the variants' module settings."""

import os

import pytest

from lazoo.bench import kernels, roofline, variants

CEILINGS = {"matmul_TFLOPs": 800.0, "copy_GBps": 3000.0}


def test_rates_and_roofline_of_a_row():
    row = {"fwd_ms": 1.0, "fwd_bwd_ms": 4.0}
    roofline.add_rates(row, flops=(2e11, 6e11), io_bytes_f=2e9, io_bytes_fb=6e9)
    assert row["fwd_TFLOPs"] == pytest.approx(200.0) and row["fwd_bwd_TFLOPs"] == pytest.approx(200.0)
    assert row["fwd_GBps"] == pytest.approx(2000.0) and row["fwd_bwd_GBps"] == pytest.approx(1500.0)
    roofline.roofline(row, CEILINGS)
    # compute: 200 / 800 = 25 % of the ceiling; memory: 1500 / 3000 = 50 %: the memory bound takes longer
    assert row["bound"] == "memory" and row["roofline_frac"] == pytest.approx(0.5)
    compute_bound = {"fwd_bwd_TFLOPs": 600.0, "fwd_bwd_GBps": 300.0}
    roofline.roofline(compute_bound, CEILINGS)
    assert compute_bound["bound"] == "compute" and compute_bound["roofline_frac"] == pytest.approx(0.75)


def test_rows_without_rates_get_no_roofline():
    failed = {"fwd_ms": None, "fwd_bwd_ms": None}
    roofline.add_rates(failed, (1.0, 1.0), 1.0, 1.0)
    roofline.roofline(failed, CEILINGS)
    assert "bound" not in failed and "fwd_TFLOPs" not in failed
    sdpa = {"fwd_bwd_TFLOPs": 300.0}  # FLOPs, no I/O floor
    roofline.roofline(sdpa, CEILINGS)
    assert "roofline_frac" not in sdpa


def test_targets_are_marked_against_what_the_run_has():
    def row(op, impl, T, f, b, frac=None):
        r = {"op": op, "impl": impl, "T": T, "D": 128, "fwd_ms": f, "fwd_bwd_ms": b}
        if frac is not None:
            r["roofline_frac"] = frac
        return r

    rows = [row("linear_attention", "lazoo", 32768, 0.6, 1.8, 0.28), row("linear_attention", "fla", 32768, 0.5, 2.34),
            row("gla", "lazoo", 1024, 2.6, 8.0), row("gla", "fla", 1024, 1.6, 6.8),
            row("gated_delta_rule", "lazoo", 1024, 1.8, 4.4), row("gated_delta_rule", "fla", 1024, 1.0, None),
            row("ela_sum_sq_euclid", "lazoo", 32768, 1.0, 2.6),
            row("ela_hadamard_exp_bidirectional", "lazoo", 32768, 1, 2), row("delta_rule", "lazoo", 8192, 1.4, 4.0)]
    roofline.mark_targets(rows)
    marks = {(r["op"], r["T"]): r.get("targets") for r in rows if r["impl"] == "lazoo"}
    assert marks[("linear_attention", 32768)] == ["fla/ours fwd+bwd 1.30 >= 1.25: met",
                                                  "roofline 28 % >= 50 %: NOT met"]
    assert marks[("gla", 1024)] == ["fla/ours fwd+bwd 0.85 >= 1.1: NOT met"]
    assert marks[("gated_delta_rule", 1024)] == ["fla/ours fwd 0.56 >= 1.1: NOT met"]  # fla's backward refused
    assert marks[("ela_sum_sq_euclid", 32768)] == ["x linear 1.44 <= 1.5: met"]
    assert marks[("ela_hadamard_exp_bidirectional", 32768)] is None  # no target for the non-causal form
    assert marks[("delta_rule", 8192)] is None  # no fla row in the run: nothing to compare with


def test_triton_cache_folder(tmp_path, kernel_cache_env):
    folder = tmp_path / "triton" / "cache"
    info = kernels.use_triton_cache(folder)
    assert folder.is_dir() and info == {"dir": str(folder.resolve()), "files_at_start": 0}
    assert os.environ["TRITON_CACHE_DIR"] == str(folder.resolve()) and os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    (folder / "a").mkdir()
    (folder / "a" / "kernel.json").write_text("{}")
    (folder / "user_file.txt").write_text("kept")
    assert kernels.use_triton_cache(folder)["files_at_start"] == 2
    assert (folder / "user_file.txt").read_text() == "kept"  # nothing in the folder is touched


def test_variants_set_module_settings_and_restore_them():
    from lazoo.kernels import normalized

    label, settings = variants.parse_variant("bv:lazoo.kernels.normalized.FWD_BV=128,"
                                          "lazoo.kernels.normalized.DQKV_BV=32")
    assert label == "bv" and [(m, a, v) for m, a, v in settings] == [
        (normalized, "FWD_BV", 128), (normalized, "DQKV_BV", 32)]
    before = (normalized.FWD_BV, normalized.DQKV_BV)
    with pytest.raises(RuntimeError):
        with variants.variant_settings(settings):
            assert (normalized.FWD_BV, normalized.DQKV_BV) == (128, 32)
            raise RuntimeError
    assert (normalized.FWD_BV, normalized.DQKV_BV) == before


@pytest.mark.parametrize("text,problem", [
    ("lazoo.kernels.normalized.FWD_BV=128", "expected LABEL:"),
    ("t:lazoo.kernels.normalized.FWD_B=128", "has no setting 'FWD_B'"),
    ("t:FWD_BV=128", "is not module.ATTR=value"),
    ("t:lazoo.kernels.normalized.FWD_BV=yes", "is not a Python literal"),
])
def test_a_bad_variant_names_its_problem(text, problem):
    with pytest.raises(ValueError, match=problem):
        variants.parse_variant(text)
