"""The engine's side of a prompt-cache prefix fetch that races the compute (`pdserve.cache.prefix_fetch`).

    load_landed(engine)       at each step start (`LLMEngine.step`), before the scheduler picks the step's work

A sequence admitted with `EngineRequest.prefix_fetch` starts computing at once while its cached pages are fetched
in the background. At each step start, for each such sequence (waiting or part-way through its prefill), the pages
that landed from where its compute stands are loaded into its pages and `num_computed_tokens` advanced past them:
the chunk the scheduler picks next starts after them. Pages the compute reached first are computed, and their
fetched copies discarded. The compute stops where the fetch starts (`Sequence.prefill_stop`, set from
`PrefixFetch.split_page`: a chunk ends there rather than compute pages that are on their way); a fetch that ends
without landing a page from there on is dropped, and with it the stop. Loading needs the sequence's pages: a
sequence still waiting gets them here when it is the next one the scheduler would admit (all its pages, as the
scheduler's admission takes them), else it waits for the scheduler.

Waiting instead of computing, only when the engine has nothing else to run (no decode batch, no other prompt to
prefill), from the measured rates (the fetch's own, or the store's recent one, and the engine's prefill rate): the
step waits for every cached page still to land when that is sooner than computing the next chunk while the pages
after it land (then the fetch skips that chunk's pages: `skip_to`); a wait ends by 1.5x its prediction or the
next chunk's compute time, whichever is longer (so a fetch that stalls costs at most about one chunk); whatever
landed is loaded, the rest computed. On a GPU the engine thread reaches the next step while the device still
computes the last chunk, so that wait overlaps it; first of all, it waits for the pages for as long as the device
is still busy (`ModelRunner.device_busy`), which costs nothing. While a rate is unknown, the request waits for the
fetch's next batch (which measures it) for at most `PROBE_SHARE` of its cached span's compute time
(`UNMEASURED_WAIT_S` without a prefill rate): a first hit costs at most that much more than computing.

A failure here (a page the pool cannot take) ends that fetch; the sequence computes, the step goes on.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from pdserve.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pdserve.cache.prefix_fetch import PrefixFetch
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.page_table import PageAllocator
    from pdserve.engine.scheduler import Scheduler


class LLMEngine(Protocol):
    """What loading fetched pages uses of `pdserve.engine.engine.LLMEngine` (a structural type: that module
    imports this one, so it is not imported back)."""

    page_size: int
    scheduler: Scheduler
    allocator: PageAllocator
    runner: ModelRunner


log = logging.getLogger("pdserve.engine")
WAIT_SLACK_S = 0.002  # added to a wait's predicted length (thread wake-up)
PROBE_SHARE = 0.03  # rates unknown: a request waits at most this share of its cached span's compute time ...
UNMEASURED_WAIT_S = 0.05  # ... or this long when the engine's prefill rate is unknown too (its first prompts)
BUSY_POLL_S = 0.001  # while the device computes the last chunk: how often the wait for pages checks it


def load_landed(engine: LLMEngine) -> None:
    """Load landed prefix pages into the sequences racing a fetch; wait for pages about to land when the engine is
    otherwise idle and waiting is measured to beat computing. Engine thread, at a step's start."""
    sched = engine.scheduler
    racing = [
        s
        for s in sched.waiting
        if getattr(s, "prefix_fetch", None) is not None
        and s.status in (SequenceStatus.WAITING, SequenceStatus.PREFILLING)
    ]
    if not racing:
        return
    others = any(
        getattr(s, "prefix_fetch", None) is None and s.status in (SequenceStatus.WAITING, SequenceStatus.PREFILLING)
        for s in sched.waiting
    )
    idle = not sched.running and not others
    for i, seq in enumerate(racing):
        try:
            _advance(engine, seq, may_wait=idle and i == 0)
        except Exception as e:  # the prompt is computed instead
            log.warning("request %s: prefix fetch dropped (computing instead): %s", seq.request_id, e)
            _drop_fetch(seq)


def _drop_fetch(seq: Sequence) -> None:
    fetch, seq.prefix_fetch = seq.prefix_fetch, None
    seq.prefill_stop = 0  # nothing to stop for: chunks take their whole budget
    if fetch is not None:
        fetch.cancel()  # its owner (the request's plan) closes it; what the engine loaded stays listed


def _advance(engine: LLMEngine, seq: Sequence, may_wait: bool) -> None:
    fetch = seq.prefix_fetch
    assert fetch is not None
    ps = engine.page_size
    limit = min(fetch.end_page, (seq.num_prompt_tokens - 1) // ps)  # the last prompt token is always computed
    while True:
        at = seq.num_computed_tokens
        page = at // ps
        if page >= limit or (fetch.finished and fetch.landed <= max(page, fetch.start_page)) or page < fetch.first_page:
            _drop_fetch(seq)  # past the fetched range, or nothing (more) will land (or a preempted restart)
            return
        if at % ps:  # a chunk ended inside a page: that page is computed; later pages may still load
            return
        usable = fetch.usable_end(page)
        if usable > page:
            if not _load(engine, seq, fetch, page, min(usable, limit)):
                return
            continue
        if not may_wait or page < fetch.skip_before or not _has_pages(engine, seq):  # skip_before: not fetched
            _skip_computed(engine, seq, fetch, page)  # what this step computes is not fetched any more
            return
        if _wait_while_device_busy(engine, fetch, limit) and fetch.usable_end(page) > page:
            continue  # pages landed while the device finished the last chunk: load them
        chunk_end = min(limit, page + _chunk_pages(engine))
        t_all = fetch.expected_landing_s(limit)  # every page still wanted, from here
        t_chunk = _compute_s(fetch, chunk_end - page, ps)
        if t_all is not None and t_chunk > 0:  # both rates known: the sooner of two plans
            t_rest = fetch.expected_landing_s(limit, chunk_end) or 0.0  # the pages after this chunk, alone
            if t_all >= max(t_chunk, t_rest):  # computing this chunk while the rest lands is no slower
                fetch.skip_to(chunk_end)  # it has its pages: this step computes that chunk
                return
            fetch.wait(limit, min(_compute_s(fetch, limit - page, ps), max(1.5 * t_all, t_chunk)) + WAIT_SLACK_S)
        else:  # a rate unknown: wait for the next batch within the probe budget (it measures the fetch)
            t_all = _compute_s(fetch, limit - page, ps)
            left = (PROBE_SHARE * t_all if t_all > 0 else UNMEASURED_WAIT_S) - fetch.probe_waited_s
            if left <= 0:
                _skip_computed(engine, seq, fetch, page)
                return
            t0 = time.monotonic()
            fetch.wait(page + 1, left)
            fetch.probe_waited_s += time.monotonic() - t0
        if fetch.usable_end(page) <= page:
            _skip_computed(engine, seq, fetch, page)
            return  # nothing came within the wait: compute


def _wait_while_device_busy(engine: LLMEngine, fetch: PrefixFetch, limit: int) -> bool:
    """Wait for the pages up to `limit` for as long as the device still computes the chunk the engine launched
    last (the next chunk could not start before it ends); True when it waited. On a GPU the engine thread is
    back here long before the device is (a graph-launched chunk returns in a fraction of its compute time), when
    the fetch may not have landed, or measured, anything yet."""
    runner, waited = engine.runner, False
    while runner.device_busy():
        waited = True
        if fetch.wait(limit, BUSY_POLL_S) >= min(limit, fetch.end_page) or fetch.finished:
            break
    return waited


def _skip_computed(engine: LLMEngine, seq: Sequence, fetch: PrefixFetch, page: int) -> None:
    """This step computes `seq` from `page` on (an admitted prefill is scheduled each step): the fetch need not fetch
    the pages its chunk covers (up to its stop: the pages from there are the fetch's to land)."""
    if seq.status == SequenceStatus.PREFILLING:
        fetch.skip_to(page + min(_chunk_pages(engine), seq.num_schedulable // engine.page_size))


def _chunk_pages(engine: LLMEngine) -> int:
    """Pages a prefill chunk covers at most (what one step computes of a prompt)."""
    return max(1, engine.scheduler.chunk_size // engine.page_size)


def _compute_s(fetch: PrefixFetch, pages: int, page_size: int) -> float:
    """Seconds computing `pages` pages takes at the engine's measured prefill rate (0: unmeasured)."""
    rate = fetch.prefill_tokens_per_s or 0.0
    return pages * page_size / rate if rate > 0 else 0.0


def _has_pages(engine: LLMEngine, seq: Sequence) -> bool:
    """Whether `seq` holds its pages, taking them now if it is the next the scheduler would admit."""
    if seq.status == SequenceStatus.PREFILLING:
        return True
    sched = engine.scheduler
    head = next((s for s in sched.waiting if s.status == SequenceStatus.WAITING), None)
    if head is not seq or seq.page_table or seq.prefix_keys:  # prefix_keys: admission may share pool pages
        return bool(seq.page_table)
    admitted = len(sched.running) + sum(1 for s in sched.waiting if s.status == SequenceStatus.PREFILLING)
    need = sched.pages_for(seq, seq.num_tokens)
    if admitted >= sched.max_num_seqs or need > engine.allocator.num_free:
        return False
    seq.page_table = engine.allocator.allocate(need)  # what admission would take; it takes no more then
    return True


def _load(engine: LLMEngine, seq: Sequence, fetch: PrefixFetch, start: int, end: int) -> bool:
    """Load landed pages [start, end) into `seq`'s pages and count them computed; False: no pages yet."""
    if not _has_pages(engine, seq):
        return False
    landed = fetch.take(start, end, host_views=False)  # the upload holds every page on CUDA
    physical = seq.page_table[start:end]
    runner = engine.runner
    for p in landed.payloads:  # one page with an upload: every page of a fetch has its namespace's layout
        runner.check_payload(p)
    up = landed.upload
    if up is not None:  # CUDA: already on the device (this stream waits for its copy)
        runner.kv_cache.scatter_pages(physical, up.data, up.scales, up.zeros, landed.payloads[0].group_size)
    else:
        runner.import_full_pages(physical, landed.payloads)
    seq.num_computed_tokens = end * engine.page_size
    seq.num_imported_pages = max(seq.num_imported_pages, end)  # imported: never registered as computed here
    fetch.mark_loaded(start, end)
    return True
