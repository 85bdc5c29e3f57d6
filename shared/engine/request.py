"""One request as the engine admits it: what `LLMEngine.add_request` / `EngineLoop.add_request` take."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling import SamplingParams
from pdserve.kv.payload import PagePayload


@dataclass
class EngineRequest:
    """A request to queue. `forced_token_ids`: teacher forcing (the i-th sampled token is replaced by the i-th
    forced one; the logits are those the model produced).
    `cached_pages`: KV of the prompt's first N full pages from a prompt cache, written into the pool when the
    request is first scheduled; at least the last prompt token is computed. `keep_cached_upload`: keep the device
    copy the import made of them (exact bytes, their own format) for `take_cached_upload`.
    `sampled_before`: tokens already sampled elsewhere (a failover resume: the prompt ends with them); a seeded
    request skips their draws.
    `resumed_tokens`, `resumed_text_chars`: a failover resume on an engine that prefills itself (colocated): the
    last `resumed_tokens` prompt tokens count as completion tokens, their first `resumed_text_chars` characters
    were delivered already.
    `prefix_keys`: keys of the prompt's full pages (`pdserve.cache.keys`); the request starts on the pool pages that
    hold its longest registered prefix, and registers the full pages it computed when it ends."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prefill_only: bool = False
    forced_token_ids: list[int] | None = None
    cached_pages: list[PagePayload] | None = None
    sampled_before: int = 0
    resumed_tokens: int = 0
    resumed_text_chars: int = 0
    keep_cached_upload: bool = False
    prefix_keys: list[bytes] | None = None
