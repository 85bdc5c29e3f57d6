"""The prefix policy (`pdserve.cache.prefix_policy`) with a stand-in cache and namespace: the pool's prefix wins
when it reaches as far as the cache's copy (and the cache is not asked when the pool holds all it may serve),
prompt logprobs / a resume take nothing, and the write-back stores only the pages the request computed, now or
behind the engine."""

from __future__ import annotations

import pytest
import torch

from pdserve.cache import prefix_policy
from pdserve.cache.prefix_policy import PrefixPolicy
from pdserve.cache.prompt_cache import CacheLookup
from pdserve.kv.transfer import ExportedPages

PAGE = 4


class Namespace:
    """Page keys: one per full page of the prompt."""

    def page_keys(self, prompt: list[int]) -> list[bytes]:
        return [bytes([i]) for i in range(len(prompt) // PAGE)]


class Cache:
    """Serves the first `cached` pages of any prompt; records its lookups."""

    local = None  # no local tier

    def __init__(self, cached: int):
        self.cached = cached
        self.lookups: list[tuple[int, float | None, list[bytes] | None]] = []

    def lookup(self, ns, prompt, max_pages, tokens_per_s, keys) -> CacheLookup:
        self.lookups.append((max_pages, tokens_per_s, keys))
        all_keys = Namespace().page_keys(prompt)
        return CacheLookup(all_keys, [object()] * min(self.cached, max_pages), local_hits=1)  # type: ignore[list-item]


PROMPT = list(range(6 * PAGE + 1))  # 6 full pages, all reusable (the last token is computed)


@pytest.mark.parametrize(
    "in_pool, cached, want_pool, want_hit, asked",
    [
        (0, 3, 0, 3, True),  # nothing in the pool: the cache's pages
        (3, 3, 3, 0, True),  # as far as the cache's copy: the pool's pages, no copy
        (2, 4, 0, 4, True),  # the cache reaches further
        (6, 6, 6, 0, False),  # the pool holds all it may serve: the cache is not asked
    ],
)
def test_pool_prefix_against_the_cache(in_pool, cached, want_pool, want_hit, asked):
    cache = Cache(cached)
    held: list[list[bytes]] = []

    def pool_held(keys: list[bytes]) -> int:
        held.append(keys)
        return in_pool

    plan = PrefixPolicy(cache, PAGE, pool_reuse=True).plan(Namespace(), PROMPT, False, 123.0, pool_held)  # type: ignore[arg-type]
    assert (plan.pool_pages, plan.hit.num_pages, bool(cache.lookups)) == (want_pool, want_hit, asked)
    assert held == [Namespace().page_keys(PROMPT)[:6]] and plan.max_reuse == 6
    assert plan.prefix_keys == Namespace().page_keys(PROMPT)  # the engine starts on / registers these
    assert (plan.cached_pages is None) == (want_hit == 0)
    if asked:
        assert cache.lookups == [(6, 123.0, plan.keys)]  # the keys made once, handed to the cache
    attrs = plan.attributes(cache_enabled=True)
    assert attrs["pdserve.cache.pool_pages"] == want_pool and attrs["pdserve.cache.pages_hit"] == want_hit
    assert attrs["pdserve.cache.pages_miss"] == 6 - want_pool - want_hit


def test_compute_all_takes_nothing_and_writes_nothing():
    cache = Cache(6)
    plan = PrefixPolicy(cache, PAGE, pool_reuse=True).plan(Namespace(), PROMPT, True, None, lambda keys: 6)  # type: ignore[arg-type]
    assert (plan.pool_pages, plan.hit.num_pages, plan.prefix_keys, plan.write_keys) == (0, 0, None, [])
    assert not cache.lookups and plan.attributes(True)["pdserve.cache.pages_miss"] == 6


def test_without_pool_reuse_only_the_cache_serves_and_new_pages_follow_its_hit():
    cache = Cache(2)
    plan = PrefixPolicy(cache, PAGE, pool_reuse=False).plan(Namespace(), PROMPT, False, None)  # type: ignore[arg-type]
    assert plan.prefix_keys is None and cache.lookups == [(6, None, None)]
    assert plan.hit.num_pages == 2 and plan.new_pages() == [2, 3, 4, 5]
    assert PrefixPolicy(None, PAGE, pool_reuse=False).plan(Namespace(), PROMPT, False, None).hit.num_pages == 0  # type: ignore[arg-type]


def batches() -> list[ExportedPages]:
    rows = torch.zeros(7, 8, dtype=torch.uint8)
    return [ExportedPages([0, 1, 2, 3], [PAGE] * 4, rows[:4]), ExportedPages([4, 5, 6], [PAGE, PAGE, 1], rows[4:])]


class Behind:
    def __init__(self):
        self.jobs: list[tuple[int, int]] = []

    def submit(self, job, pages: int, nbytes: int) -> None:
        self.jobs.append((pages, nbytes))


def test_write_back_now_or_behind_the_engine(monkeypatch):
    written: list[tuple[list[bytes], int]] = []
    monkeypatch.setattr(
        prefix_policy,
        "write_back",
        lambda cache, ns, keys, write, ask, b, layout, *a, **kw: written.append((keys, write[0] if write else None)),
    )
    cache = Cache(0)
    plan = PrefixPolicy(cache, PAGE, pool_reuse=True).plan(Namespace(), PROMPT, False, None, lambda keys: 0)  # type: ignore[arg-type]
    PrefixPolicy(cache, PAGE, pool_reuse=True).write_back(Namespace(), plan, 2, batches(), None)  # type: ignore[arg-type]
    assert written == [(plan.write_keys, 2)]
    behind = Behind()
    PrefixPolicy(cache, PAGE, True, behind).write_back(Namespace(), plan, 2, batches(), None)  # type: ignore[arg-type]
    assert behind.jobs == [(4, 7 * 8)] and len(written) == 1  # pages 2-5 queued; the batches' bytes held
    PrefixPolicy(None, PAGE, True, behind).write_back(Namespace(), plan, 2, batches(), None)  # type: ignore[arg-type]
    assert len(behind.jobs) == 1  # no cache: nothing
