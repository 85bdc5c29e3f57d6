"""One request as the engine admits it: what `LLMEngine.add_request` / `EngineLoop.add_request` take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.sampling import SamplingParams
from pdserve.kv.payload import PagePayload
from pdserve.kv.transfer.layers import LayerStream

if TYPE_CHECKING:
    from pdserve.cache.prefix_fetch import PrefixFetch


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
    hold its longest registered prefix, and registers the full pages it computed when it ends.
    `layer_stream`: prefill-only; each chunk's completed pages go to its sink layer group by layer group during the
    forward (`pdserve.kv.transfer.layers`), besides `ready_pages`.
    `prefix_fetch`: the prompt cache's pages after `cached_pages`, fetched while the prompt computes; those that
    land before the compute reaches them are loaded instead (`pdserve.engine.prefix_fetch`).
    `n`, `best_of` (0: n): the prompt is computed once, then the request forks into `best_of` sequences over its
    shared pages and returns `n` completions (StepOutput.index), the best by cumulative logprob when best_of > n
    (`pdserve.engine.forks`); not with prefill_only, forced_token_ids or a failover resume."""

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
    layer_stream: LayerStream | None = None
    prefix_fetch: PrefixFetch | None = None
    n: int = 1
    best_of: int = 0
