"""What a Gated DeltaNet language model's layer keeps for the backward, on the CPU: one layer of the ~350M model of
`lazoo bench gdn_training` (hidden 1024, 8 heads of 128, SwiGLU 4096) under bf16 autocast, the Triton kernels in the
interpreter (the GPU's autograd path), every tensor autograd saves counted once by its storage, parameters and their
bf16 casts left out. Prints the bytes a token (one layer, with the embedding and the final norm) and the largest
tensors.
Usage: PYTHONPATH=src python experiments/activation_census.py [--tokens 256]"""
import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("LAZOO_BACKEND", "triton")

import torch  # noqa: E402

from lazoo.models.configuration_mechanisms import LazooGatedDeltaNetConfig  # noqa: E402
from lazoo.models.modeling_mechanisms import LazooGatedDeltaNetForCausalLM  # noqa: E402


def census(tokens: int) -> dict:
    torch.manual_seed(0)
    cfg = LazooGatedDeltaNetConfig(vocab_size=1000, hidden_size=1024, num_hidden_layers=1, num_attention_heads=8,
                                   intermediate_size=4096, tie_word_embeddings=True, use_cache=False,
                                   mixer_kwargs={"gated_delta_net": {"head_k_dim": 128}})
    model = LazooGatedDeltaNetForCausalLM(cfg).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        weight_cast = t.dim() == 2 and t.shape[0] != tokens  # autocast's bf16 copy of a weight, once a step
        if storage.data_ptr() not in params and not weight_cast:
            kept.setdefault(storage.data_ptr(), (tuple(t.shape), str(t.dtype).removeprefix("torch."), storage.nbytes()))
        return t

    ids = torch.randint(0, cfg.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model.model(input_ids=ids)
    return {"bytes_a_token": sum(n for *_, n in kept.values()) / tokens,
            "largest": sorted(kept.values(), key=lambda r: -r[2])[:12]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    result = census(ap.parse_args().tokens)
    print(f"kept for the backward: {result['bytes_a_token'] / 1000:.1f} kB a token")
    for shape, dtype, nbytes in result["largest"]:
        print(f"  {str(shape):24} {dtype:9} {nbytes / 2**20:7.2f} MiB")


if __name__ == "__main__":
    main()
