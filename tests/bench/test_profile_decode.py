"""lazoo.bench.profile_decode on the CPU with tiny models: its bare greedy loop makes generate's tokens, and main()
reports every field."""

import json

import pytest
import torch

from lazoo.bench import generate, profile_decode

TINY = ["--device", "cpu", "--dtype", "float32", "--hidden-size", "32", "--layers", "2", "--heads", "2",
        "--intermediate-size", "64", "--vocab-size", "101"]


@pytest.mark.parametrize("name", ["gated_delta_net", "sw-gdn"])
def test_the_bare_loop_makes_generates_tokens(name, single_thread):
    args = profile_decode.parse_args([*TINY, "--model", name, "--prompt", "12", "--steps", "6"])
    model = generate.build_model(name, args)
    ids = generate.prompt_ids(2, 12, args.vocab_size, seed=3)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                                  do_sample=False, pad_token_id=0)[:, 12:]
    stepper = profile_decode.GreedyStepper(model, ids, 40, model)
    made = [stepper.token] + [stepper() for _ in range(5)]
    assert torch.equal(torch.cat(made, 1), expected)


def test_main_reports_every_field(tmp_path, single_thread):
    out = tmp_path / "profile.jsonl"
    result = profile_decode.main([*TINY, "--prompt", "10", "--steps", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["generate_ms"] > 0 and result["loop_synced_ms"] > 0 and result["loop_queued_ms"] > 0
    assert result["gpu_kernels_eager"]["kernel_ms_per_step"] is None  # no CUDA kernels on the CPU


def test_only_lazoo_models(capsys):
    with pytest.raises(SystemExit):
        profile_decode.parse_args([*TINY, "--model", "llama"])
    assert "lazoo mechanism or hybrid preset" in capsys.readouterr().err
