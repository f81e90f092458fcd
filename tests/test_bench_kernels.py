"""scripts/bench_kernels.py's bookkeeping on the CPU (its timings need a CUDA GPU): the rates and the roofline of a
row, and the Triton cache folder it keeps across runs."""

import os

import pytest

from conftest import load_script

bench = load_script("bench_kernels")

CEILINGS = {"matmul_TFLOPs": 800.0, "copy_GBps": 3000.0}


def test_rates_and_roofline_of_a_row():
    row = {"fwd_ms": 1.0, "fwd_bwd_ms": 4.0}
    bench.add_rates(row, flops=(2e11, 6e11), io_bytes_f=2e9, io_bytes_fb=6e9)
    assert row["fwd_TFLOPs"] == pytest.approx(200.0) and row["fwd_bwd_TFLOPs"] == pytest.approx(200.0)
    assert row["fwd_GBps"] == pytest.approx(2000.0) and row["fwd_bwd_GBps"] == pytest.approx(1500.0)
    bench.roofline(row, CEILINGS)
    # compute: 200 / 800 = 25 % of the ceiling; memory: 1500 / 3000 = 50 %: the memory bound takes longer
    assert row["bound"] == "memory" and row["roofline_frac"] == pytest.approx(0.5)
    compute_bound = {"fwd_bwd_TFLOPs": 600.0, "fwd_bwd_GBps": 300.0}
    bench.roofline(compute_bound, CEILINGS)
    assert compute_bound["bound"] == "compute" and compute_bound["roofline_frac"] == pytest.approx(0.75)


def test_rows_without_rates_get_no_roofline():
    failed = {"fwd_ms": None, "fwd_bwd_ms": None}
    bench.add_rates(failed, (1.0, 1.0), 1.0, 1.0)
    bench.roofline(failed, CEILINGS)
    assert "bound" not in failed and "fwd_TFLOPs" not in failed
    sdpa = {"fwd_bwd_TFLOPs": 300.0}  # FLOPs, no I/O floor
    bench.roofline(sdpa, CEILINGS)
    assert "roofline_frac" not in sdpa


def test_triton_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    folder = tmp_path / "triton" / "cache"
    info = bench.use_triton_cache(folder)
    assert folder.is_dir() and info == {"dir": str(folder.resolve()), "files_at_start": 0}
    assert os.environ["TRITON_CACHE_DIR"] == str(folder.resolve()) and os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    (folder / "a").mkdir()
    (folder / "a" / "kernel.json").write_text("{}")
    (folder / "user_file.txt").write_text("kept")
    assert bench.use_triton_cache(folder)["files_at_start"] == 2
    assert (folder / "user_file.txt").read_text() == "kept"  # nothing in the folder is touched


def test_variants_set_module_settings_and_restore_them():
    from lazoo.kernels import normalized

    label, settings = bench.parse_variant("bv:lazoo.kernels.normalized.FWD_BV=128,"
                                          "lazoo.kernels.normalized.DQKV_BV=32")
    assert label == "bv" and [(m, a, v) for m, a, v in settings] == [
        (normalized, "FWD_BV", 128), (normalized, "DQKV_BV", 32)]
    before = (normalized.FWD_BV, normalized.DQKV_BV)
    with pytest.raises(RuntimeError):
        with bench.variant_settings(settings):
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
        bench.parse_variant(text)
