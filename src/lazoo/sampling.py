"""Text from a causal LM: a prompt and its continuation, sampled or greedy (`lazoo generate` and the demo)."""

from __future__ import annotations

import torch
from transformers import set_seed

__all__ = ["sample_text"]


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, seed: int, greedy: bool = False,
                temperature: float = 0.8, top_k: int | None = 40, static: bool | None = None) -> str:
    """`prompt` and its continuation (sampled with temperature/top-k, or greedy), decoded. `static`: True, the
    static cache (on CUDA, compiled decode steps replayed as CUDA graphs); False, the dynamic cache; None, the
    model's default (lazoo's: static on CUDA, dynamic elsewhere). The same tokens in each."""
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    if inputs["input_ids"].shape[1] == 0:  # an empty prompt starts from the bos token
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        inputs = {"input_ids": torch.tensor([[bos]], device=model.device),
                  "attention_mask": torch.ones(1, 1, dtype=torch.long, device=model.device)}
    set_seed(seed)
    options = {"do_sample": False} if greedy else {"do_sample": True, "top_k": top_k, "temperature": temperature}
    if static is not None:
        options["cache_implementation"] = "static" if static else "dynamic"
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **options)
    return tokenizer.decode(out[0], skip_special_tokens=True)
