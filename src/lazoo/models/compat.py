"""The cache's name across the transformers releases lazoo supports (5.17 to the newest 5.x).

Up to 5.23 a model forward takes, and its output holds, `past_key_values` (`cache_params` for Mamba-style
models); from 5.24 both are `cache`: `generate` passes `cache=`, output dataclasses have a `cache` field and
answer `.past_key_values` with a deprecation warning. lazoo's forwards take every name (`cache_argument`),
write outputs under the installed release's field (`CACHE_FIELD`) and read back under either name without a
warning (`CacheAliases`), so the same code (and an exported `trust_remote_code` folder) runs on both sides.
"""

from __future__ import annotations

from dataclasses import fields

from transformers.modeling_outputs import BaseModelOutputWithPast

#: the field of transformers' model outputs that holds the cache in the installed release (also the name under
#: which `generate` passes it to the forward)
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(BaseModelOutputWithPast)} else "past_key_values"
#: names a caller may still use for the cache (older transformers, user code written for it)
LEGACY_CACHE_NAMES = ("past_key_values", "cache_params")


def cache_argument(cache=None, past_key_values=None, kwargs: dict | None = None):
    """The one cache passed to a forward under any of its names (`cache`, `past_key_values`, or a
    `cache_params` left in `kwargs`, which is removed from there). Two different caches are an error."""
    given = {"cache": cache, "past_key_values": past_key_values}
    if kwargs is not None and "cache_params" in kwargs:
        given["cache_params"] = kwargs.pop("cache_params")
    found = {name: value for name, value in given.items() if value is not None}
    values = list(found.values())
    if any(v is not values[0] for v in values[1:]):
        raise ValueError(f"got different caches as {' and '.join(found)}: pass one (`cache`, or `past_key_values` "
                         "on transformers before 5.24)")
    return values[0] if values else None


class CacheAliases:
    """Mixed into lazoo's output dataclasses: `.cache` and `.past_key_values` both read the cache, with no
    deprecation warning, whichever of the two is the installed release's field."""

    if CACHE_FIELD == "cache":
        @property
        def past_key_values(self):
            return self.cache
    else:
        @property
        def cache(self):
            return self.past_key_values


def output_cache_kwargs(cache) -> dict:
    """`{field: cache}` for building a transformers output dataclass without a deprecation warning."""
    return {CACHE_FIELD: cache}
