"""Decoding several tokens per host step: the decode steps captured once as one CUDA graph, then replayed.

transformers' decoding loop does a step's host work (preparing the inputs, the logits processors, the stopping
check, growing `input_ids`) in Python for every token. A compiled step leaves little GPU time (about 0.5 ms at
batch 1 for a ~145M Gated DeltaNet on an H200), so that host work, not the GPU, sets the time per token. Here, for
greedy decoding and sampling into a static lazoo cache that `generate` made and drops, the loop is lazoo's own:
every `steps` decode steps (the model's forward on the last token, the sampling warpers, argmax or a draw from the
softmax, the end-of-sequence bookkeeping, the next input written in place) are captured once as a CUDA graph and
replayed, and the host looks at the result once per replay. A step keeps no Python number that changes: the static
cache counts positions on the device, the attention mask of a generated token is a one, position ids and cache
positions (where they are passed) advance by one on the device.

The order of the work is transformers' own (its `_sample`) for the prompt and the first token, which it computes
with its own loop (its compile switched off: these steps run eagerly); then the first `steps` decode steps run
eagerly (they also warm the kernels up), and the rest as graph replays. The tokens are the same as transformers'
loop gives (sampled ones from the same random state, drawn in the same order): `tests/models/test_graph_decode.py`
compares them on the CPU, where the same steps run uncaptured. The last round may run past the length asked for;
its extra draws advance the random state further than transformers' loop would.

On CUDA it is `generate`'s default, 16 steps a round (`DEFAULT_STEPS_ON_CUDA`); `model.generation_config.
decode_steps_per_graph` (or `generate(..., decode_steps_per_graph=N)`) sets the steps, and 0 keeps transformers' loop
(the opt-out; the CPU's default, where the rounds would run uncaptured). Beam search, logits processors other than
temperature, top-k, top-p and min-p, other stopping criteria, streamers, returned scores or caches, and dynamic caches
keep transformers' loop, and say once why (a warning where the user set the field, an info line under the default).
"""

from __future__ import annotations

import copy
import logging
import weakref

import torch

from .cache import LazooCache
from .compat import CACHE_FIELD

logger = logging.getLogger(__name__)

#: the generation config's field: decode steps per captured graph (0 or None: transformers' loop)
STEPS_FIELD = "decode_steps_per_graph"
_REFUSALS_LOGGED: set[tuple[str, bool]] = set()  # (reason, asked) already said
#: each model's last loop (kept beside the model, not on it: a module holding a CUDA graph could not be copied)
LOOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


#: decode steps a round when the generation config leaves the field unset (None), on CUDA; elsewhere the rounds
#: would run uncaptured, no faster than transformers' loop, so the CPU's default is 0
DEFAULT_STEPS_ON_CUDA = 16


def default_steps(device: torch.device | None) -> int:
    return DEFAULT_STEPS_ON_CUDA if device is not None and device.type == "cuda" else 0


def requested_steps(generation_config, device: torch.device | None = None) -> int:
    """The decode steps a round for a model on `device`: the generation config's value, or where it is unset the
    default (`default_steps`: 16 on CUDA, 0 elsewhere). 0 keeps transformers' loop (the opt-out)."""
    steps = getattr(generation_config, STEPS_FIELD, None)
    if steps is None:
        return default_steps(device)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"generation_config.{STEPS_FIELD} must be a whole number of decode steps >= 0, got {steps!r}")
    return steps


def asked_for(generation_config) -> bool:
    """Whether the user set the field (then a refusal is worth a warning), or the rounds are the default (then a
    case they do not compute takes transformers' loop, as it would without them, and says so at info level)."""
    return getattr(generation_config, STEPS_FIELD, None) is not None


def refusal(generation_config, logits_processor, stopping_criteria, streamer, synced_gpus, cache) -> str | None:
    """Why this `generate` keeps transformers' loop (None: lazoo's graph loop computes it exactly)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    if (generation_config.num_beams or 1) > 1:
        return "beam search keeps a host step per token"
    if getattr(generation_config, "is_assistant", False) or synced_gpus or streamer is not None:
        return "assisted decoding, synced GPUs and streamers need a host step per token"
    if generation_config.return_dict_in_generate:
        return "return_dict_in_generate asks for what the graph loop does not keep (scores, the cache)"
    others = [type(p).__name__ for p in logits_processor or () if not isinstance(p, _capturable_processors())]
    if others:
        return (f"logits processors other than temperature, top-k, top-p and min-p ({', '.join(others)}) read the "
                "growing sequence or the host between steps")
    others = [type(c).__name__ for c in stopping_criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]
    if others:
        return f"stopping criteria other than the length and end-of-sequence ones ({', '.join(others)})"
    if not isinstance(cache, LazooCache) or not cache.static or getattr(cache, "_is_user_defined", False):
        return "it needs the static lazoo cache that generate makes (cache_implementation='static' or the CUDA default)"
    return None


def _capturable_processors() -> tuple:
    """transformers' logits processors that are device work on the scores alone (the sampling warpers)."""
    from transformers.generation import logits_process as lp

    return tuple(getattr(lp, name) for name in ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
                                                "MinPLogitsWarper") if hasattr(lp, name))


def say_once(reason: str, instead: str = "decoding with transformers' loop", asked: bool = True) -> None:
    """Why the rounds do not run (or run uncaptured), once per reason: a warning where the user asked for them,
    an info line where they are the CUDA default."""
    if (reason, asked) not in _REFUSALS_LOGGED:
        _REFUSALS_LOGGED.add((reason, asked))
        if asked:
            logger.warning("%s is set, but %s; %s.", STEPS_FIELD, reason, instead)
        else:
            logger.info("generate's default rounds of captured decode steps (%s) do not apply: %s; %s.", STEPS_FIELD,
                        reason, instead)


def capture_failed(model) -> bool:
    """Whether capturing this model's rounds failed (its kept loop is uncaptured on CUDA): under the default its later
    `generate` calls take transformers' loop over the compiled step, faster than eager rounds."""
    loop = LOOPS.get(model)
    return loop is not None and isinstance(loop.graph, str)


def _stop_after_first_token(prompt_length: int):
    """A stopping criterion that ends transformers' loop once it has produced the prompt's first token."""
    from transformers.generation.stopping_criteria import StoppingCriteria

    class StopAfterFirstToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = input_ids.shape[1] > prompt_length
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return StopAfterFirstToken()


def _draw(probs: torch.Tensor) -> torch.Tensor:
    """One draw a row from ``probs`` [B, V]: `torch.multinomial(probs, 1)`'s own arithmetic (argmax of probs / q, q
    exponential), so the same random state gives the same tokens, with its check that the probabilities are finite
    and not negative made on the device (a host read would stop a capture)."""
    torch._assert_async((probs.max() < float("inf")) & (probs.min() >= 0),
                        "probability tensor contains either `inf`, `nan` or element < 0")
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)


def _addresses(*objects) -> tuple:
    """The data pointers of every tensor in ``objects`` (nested dicts, lists and tuples): what a captured graph
    reads and writes, which must still be where it was for a replay."""
    found = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            found.append((x.data_ptr(), tuple(x.shape), x.dtype))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    for obj in objects:
        walk(obj)
    return tuple(found)


def _fingerprint(model, cache: LazooCache, inputs: dict, eos) -> tuple:
    """What a captured round depends on: the weights', the cache's and the inputs' addresses and shapes, and the
    end tokens' shape. Equal fingerprints: the same graph replays correctly."""
    weights = _addresses(list(model.parameters()), list(model.buffers()))
    state = _addresses(cache.states, cache.lobe_states, cache._seen, cache.real_tokens)
    shapes = tuple((n, tuple(v.shape), v.dtype) for n, v in inputs.items() if isinstance(v, torch.Tensor))
    return weights, state, shapes, None if eos is None else tuple(eos.shape), id(cache)


class GraphLoop:
    """lazoo's decoding loop after the first token: static input buffers, the end-of-sequence flags, a ring of the
    `steps` tokens a round produces, and the captured graph (CUDA) or None (the CPU: uncaptured). A model keeps its
    last loop, and a later `generate` whose fingerprint is the same refills its buffers and replays its graph."""

    def __init__(self, model, inputs: dict, unfinished: torch.Tensor, pad, eos, steps: int, fingerprint,
                 processors=None, sample: bool = False):
        self.model = weakref.proxy(model)  # LOOPS keeps a loop while its model lives
        self.steps, self.fingerprint = steps, fingerprint
        self.processors, self.sample = processors, sample
        # the graph: False before the first round (which runs eagerly), None once warmed up (capture next), then the
        # CUDA graph or "uncaptured"; always False on the CPU
        self.inputs = inputs
        self.unfinished = unfinished.clone()  # [B] long, 1 for a row still generating
        self.pad = pad.clone() if pad is not None else torch.zeros((), dtype=torch.long, device=unfinished.device)
        self.eos = None if eos is None else eos.clone()
        B = unfinished.shape[0]
        self.ring = torch.empty(B, steps, dtype=torch.long, device=unfinished.device)
        self.alive = torch.empty(steps, dtype=torch.bool, device=unfinished.device)  # any row left after step i
        self.graph = None
        self.asked = True  # whether the user asked for the rounds (`asked_for`): how a failed capture is reported
        self.rounds = 0  # rounds run, over every generate that used this loop

    def refill(self, inputs: dict, unfinished, pad, eos) -> None:
        """This `generate`'s values into the buffers the graph reads (same fingerprint)."""
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor):
                self.inputs[name].copy_(value)
        self.unfinished.copy_(unfinished)
        if pad is not None:
            self.pad.copy_(pad)
        if eos is not None:
            self.eos.copy_(eos)

    def body(self) -> None:
        """`steps` decode steps, device work only (capturable)."""
        tok = self.inputs["input_ids"]
        counters = [self.inputs[n] for n in ("position_ids", "cache_position") if self.inputs.get(n) is not None]
        for i in range(self.steps):
            scores = self.model(**self.inputs, return_dict=True).logits[:, -1].float()
            if self.processors:
                scores = self.processors(tok, scores)  # the warpers read the scores only
            if self.sample:
                nxt = _draw(torch.softmax(scores, dim=-1))
            else:
                nxt = scores.argmax(-1)
            if self.eos is not None:  # transformers: finished rows take the pad token; an end token finishes a row
                nxt = torch.where(self.unfinished.bool(), nxt, self.pad)
                self.unfinished.mul_((~torch.isin(nxt, self.eos)).long())
            self.ring[:, i].copy_(nxt)
            self.alive[i].copy_(self.unfinished.any())
            tok.copy_(nxt[:, None])
            for counter in counters:
                counter.add_(1)

    def _capture(self):
        """The rounds' CUDA graph, or "uncaptured" where capturing fails (the rounds then run eagerly, saying why
        once; a capture runs no kernel, so the cache is as it was)."""
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.body()
        except Exception as err:  # noqa: BLE001 - any op that cannot be captured: run the steps eagerly
            # a warning either way: eager rounds are slower than the compiled step; under the default, later
            # generate calls of this model take transformers' loop over it (`capture_failed`)
            instead = "its rounds run eagerly" + ("" if self.asked else "; later calls decode with transformers' loop")
            say_once(f"capturing its decode steps failed ({type(err).__name__}: {str(err)[:200]})", instead)
            return "uncaptured"
        return graph

    def run(self) -> tuple[torch.Tensor, list[bool]]:
        """One round of `steps` steps: on CUDA the graph's replay (the first round of a new loop runs eagerly, which
        warms the kernels up; the second captures the graph), elsewhere eagerly. Returns (the tokens [B, steps],
        whether any row was left after each step)."""
        self.rounds += 1
        if self.graph is None and self.ring.device.type == "cuda":
            self.graph = self._capture()
        if isinstance(self.graph, torch.cuda.CUDAGraph):
            self.graph.replay()
        else:
            self.body()
            if self.graph is False and self.ring.device.type == "cuda":
                self.graph = None  # warmed up: capture at the next round
        return self.ring.clone(), self.alive.tolist()  # one read back a round


def decode_inputs(model, input_ids, attention_mask, model_kwargs) -> dict | str:
    """The inputs of a decode step as static buffers (the last token, a one for its mask, position ids where the
    model takes them), or why the graph loop cannot feed them (an input that changes in a way it does not know)."""
    kwargs = {k: v for k, v in model_kwargs.items() if k != "attention_mask"}
    template = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, attention_mask=attention_mask,
                                                   **kwargs)
    inputs = {}
    for name, value in template.items():
        if name == "input_ids":
            value = input_ids[:, -1:].clone(memory_format=torch.contiguous_format)
        elif name == "attention_mask" and value is not None:
            value = torch.ones(input_ids.shape[0], 1, dtype=value.dtype, device=value.device)
        elif name == "position_ids" and value is not None:  # advanced by one a step
            # the last token's position from the whole mask (real tokens counted from 0, transformers' rule), not
            # the template's: transformers (5.17 and 5.24) slices it from generate's own position ids, which
            # `_sample` advanced in its copy of the model kwargs only (one token behind here)
            if attention_mask is not None:
                value = (attention_mask.long().cumsum(-1) - 1)[:, -1:].to(value.dtype)
            else:
                value = torch.full_like(value[..., -1:], input_ids.shape[1] - 1)
            value = value.clone(memory_format=torch.contiguous_format)
        elif name == "cache_position" and value is not None:  # the last token's slot, pads included
            value = torch.full_like(value[..., -1:], input_ids.shape[1] - 1)
        elif isinstance(value, torch.Tensor):
            return f"the decode step takes {name!r}, which the graph loop does not advance"
        inputs[name] = value
    return inputs


def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
           model_kwargs, sample) -> torch.Tensor:
    """lazoo's decoding loop (module docstring): transformers' `_sample` (`sample`, with these arguments) for the
    prompt and its first token, then `steps` decode steps per graph replay. Returns the sequences, as `_sample`
    does."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, StoppingCriteriaList

    steps, asked = requested_steps(generation_config, model.device), asked_for(generation_config)
    prompt_length = input_ids.shape[1]
    first_only = StoppingCriteriaList([*stopping_criteria, _stop_after_first_token(prompt_length)])
    eager_config = copy.copy(generation_config)  # the first token runs eagerly, uncompiled
    eager_config.disable_compile = True
    mask = model_kwargs.get("attention_mask")
    input_ids = sample(input_ids, logits_processor, first_only, eager_config, synced_gpus, streamer, **model_kwargs)
    max_length = stopping_criteria.max_length
    eos = generation_config._eos_token_tensor if any(isinstance(c, EosTokenCriteria) for c in stopping_criteria) \
        else None
    generated = input_ids[:, prompt_length:]
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    if eos is not None:
        unfinished = (~torch.isin(generated, eos).any(1)).long()
    if input_ids.shape[1] >= max_length or not bool(unfinished.any()):
        return input_ids
    if mask is not None:  # the prompt's mask and ones for the tokens generated
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], generated.shape[1])], dim=1)
    inputs = decode_inputs(model, input_ids, mask, model_kwargs)
    if isinstance(inputs, str):
        say_once(inputs, asked=asked)
        return sample(input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
                      **{**model_kwargs, "attention_mask": mask})
    pad = generation_config._pad_token_tensor
    loop = LOOPS.get(model)
    fingerprint = _fingerprint(model, model_kwargs[CACHE_FIELD], inputs, eos)
    processors, sample_tokens = logits_processor or None, bool(generation_config.do_sample)
    settings = tuple((type(p).__name__, sorted((k, repr(v)) for k, v in vars(p).items())) for p in processors or ())
    fingerprint = (*fingerprint, sample_tokens, settings)  # the warpers' values are captured as constants
    if loop is not None and loop.steps == steps and loop.fingerprint == fingerprint:
        loop.refill(inputs, unfinished, pad, eos)
    else:
        loop = GraphLoop(model, inputs, unfinished, pad, eos, steps, fingerprint, processors, sample_tokens)
        loop.graph = False  # a new loop's first round runs eagerly
        LOOPS[model] = loop
    loop.asked = asked
    pieces, length = [input_ids], input_ids.shape[1]
    while length < max_length:
        tokens, alive = loop.run()
        take = min(steps, max_length - length)
        if False in alive[:take]:
            take = alive.index(False) + 1  # every row has finished at this step
            pieces.append(tokens[:, :take])
            break
        pieces.append(tokens[:, :take])
        length += take
    return torch.cat(pieces, dim=1)
