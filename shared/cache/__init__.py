"""Prompt cache: KV pages of prompt prefixes, shared by every instance through Redis (or in-process).

keys.py (chained page keys + namespace), value.py (one value per page: header, CRC32C, raw page bytes),
value_auth.py (the cache secret: MACed values, keyed store key names, rotation), store.py /
redis_store.py (byte stores; resp_fetch.py: GETEX values read straight into buffers), prefix_fetch.py (a
prompt's pages fetched in the background, racing the engine's compute), local_tier.py (in-memory LRU in front of
Redis), writer.py (async write-back), breaker.py (circuit breaker), stats.py (counters), prompt_cache.py
(PromptCache, build_prompt_cache), config.py (CacheOptions), serving.py (lookup and write-back around one request
on a prefill or colocated instance); the private redis-server launcher for tests lives in pdserve.testing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.cache.keys import CacheNamespace
    from pdserve.cache.prompt_cache import CacheLookup, PromptCache, build_prompt_cache

__all__ = ["CacheNamespace", "CacheLookup", "PromptCache", "build_prompt_cache"]
_HOMES = {"CacheNamespace": "keys", "CacheLookup": "prompt_cache", "PromptCache": "prompt_cache"}


def __getattr__(name: str) -> Any:
    """The names above, imported on first use: `pdserve.cache.value_auth` alone (what `pdserve up` needs) then
    loads without torch."""
    if name in __all__:
        return getattr(importlib.import_module(f"pdserve.cache.{_HOMES.get(name, 'prompt_cache')}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
