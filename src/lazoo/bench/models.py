"""The models of the training and generation benchmarks: one ~125M shape (``MODEL_SIZES``, tied input and output
embeddings) for a lazoo layout, transformers' Llama with SDPA attention, and fla's models (fields filtered to what
fla's config classes take)."""

from __future__ import annotations

import inspect

from lazoo_cli.bench import MODEL_SIZES

__all__ = ["MODEL_SIZES", "TINY_SIZES", "TIE", "lazoo_model", "llama_model", "packed_training_step", "config_fields",
           "count_params"]

#: tiny sizes for the CPU smoke tests
TINY_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=256)
#: lazoo's default; Llama and fla are set to tie too, so the 32k x 768 embedding counts once in each
TIE = True


def lazoo_model(name, sizes):
    """A lazoo causal LM of any layout ``lazoo.presets.build_config`` takes (mechanism, hybrid preset, config .json;
    a preset's layer pattern repeats over the layers)."""
    from transformers import AutoModelForCausalLM

    from lazoo.presets import build_config

    return AutoModelForCausalLM.from_config(build_config(name, **sizes, tie_word_embeddings=TIE))


def packed_training_step(model, documents: int = 32, length: int = 512, device="cuda"):
    """``step(batched=False)``: one forward + backward of ``model`` under bf16 autocast on ``documents`` random
    documents of ``length`` tokens, packed in one row with ``position_ids`` restarting at each (as transformers'
    ``DataCollatorWithFlattening`` makes them), or with ``batched`` as a ``[documents, length]`` batch; gradients
    cleared after each step."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (1, documents * length), device=device)
    position_ids = torch.arange(length, device=device).repeat(documents)[None]

    def step(batched: bool = False):
        inputs = (dict(input_ids=ids.view(documents, length)) if batched
                  else dict(input_ids=ids, position_ids=position_ids))
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            model(**inputs, labels=inputs["input_ids"]).loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def llama_model(sizes, max_len, **fields):
    """transformers' ``LlamaForCausalLM`` of ``sizes`` (as many key-value heads as heads) with SDPA attention;
    ``fields``: more config fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=sizes["vocab_size"], hidden_size=sizes["hidden_size"],
                         intermediate_size=sizes["intermediate_size"], num_hidden_layers=sizes["num_hidden_layers"],
                         num_attention_heads=sizes["num_attention_heads"],
                         num_key_value_heads=sizes["num_attention_heads"],
                         max_position_embeddings=max(max_len, 2048), tie_word_embeddings=TIE, **fields)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def config_fields(config_cls, wanted: dict, always=()) -> dict:
    """The fields of ``wanted`` that ``config_cls.__init__`` names, and those of ``always`` (fla's configs keep
    unknown keywords as stray attributes: pass only what the class reads)."""
    accepted = set(inspect.signature(config_cls.__init__).parameters)
    return {k: v for k, v in wanted.items() if k in accepted or k in always}


def count_params(model):
    """(all parameters, all but the input and output embeddings); a tied weight counts once."""
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    embedding = emb.numel() + (out.weight.numel() if out is not None and out.weight is not emb else 0)
    return total, total - embedding
