"""WriteBehind: write-backs wait for idle moments, page by page; bounded by bytes and by waiting; drops counted.
write_back with a wait that gives up: the chain's head is cached, nothing after the gap."""

from __future__ import annotations

import threading
import time

import pytest
from cache_testutil import INT8, make_page, namespace

from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.serving import pages_to_write, write_back
from pdserve.cache.store import MemoryStore
from pdserve.cache.write_behind import WriteBehind
from pdserve.kv.transfer import ExportedPages
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.testing.wait import wait_until


class Switch:
    def __init__(self, busy: bool = False):
        self.busy = busy

    def __call__(self) -> bool:
        return self.busy


def paced_job(log: list[int], pages: int):
    """A job writing `pages` pages, one per idle moment, recording each."""

    def job(wait_idle) -> int:
        for i in range(pages):
            if not wait_idle():
                return i
            log.append(i)
        return pages

    return job


def test_jobs_run_in_order_while_idle_and_pause_while_busy():
    busy, log, drops = Switch(), [], []
    wb = WriteBehind(busy, max_bytes=100, max_wait_s=10, on_drop=drops.append)
    busy.busy = True  # the instance computes: nothing is written
    assert wb.submit(paced_job(log, 3), pages=3, nbytes=10) and wb.submit(paced_job(log, 2), pages=2, nbytes=10)
    time.sleep(0.1)
    assert log == []
    busy.busy = False
    assert wb.flush(5)
    assert log == [0, 1, 2, 0, 1] and drops == []
    wb.close()


def test_a_new_job_drops_the_oldest_waiting_ones_to_fit():
    busy, drops = Switch(busy=True), []
    wb = WriteBehind(busy, max_bytes=100, max_wait_s=10, on_drop=drops.append)
    logs: dict[str, list[int]] = {k: [] for k in "abcde"}
    gate = threading.Event()

    def running(wait_idle) -> int:  # takes the writer at once and holds 30 bytes until the gate opens
        gate.wait(5)
        return paced_job(logs["a"], 1)(wait_idle)

    assert wb.submit(running, pages=1, nbytes=30)
    wait_until(lambda: wb._running, what="the first job running")
    assert wb.submit(paced_job(logs["b"], 4), pages=4, nbytes=40)
    assert wb.submit(paced_job(logs["c"], 3), pages=3, nbytes=30)  # 100: fits
    assert wb.submit(paced_job(logs["d"], 2), pages=2, nbytes=20)  # drops b (the oldest waiting)
    assert drops == [4]
    assert not wb.submit(paced_job(logs["e"], 5), pages=5, nbytes=80)  # c and d dropped, still 110 beside a
    assert drops == [4, 3, 2, 5]
    gate.set()
    busy.busy = False
    assert wb.flush(5) and logs == {"a": [0], "b": [], "c": [], "d": [], "e": []}
    assert wb.submit(paced_job(logs["e"], 2), pages=2, nbytes=100)  # the bytes were given back
    assert wb.flush(5) and logs["e"] == [0, 1] and drops == [4, 3, 2, 5]
    wb.close()


def test_a_job_kept_waiting_too_long_drops_the_rest_of_its_pages():
    busy, log, drops = Switch(), [], []
    wb = WriteBehind(busy, max_bytes=100, max_wait_s=0.2, on_drop=drops.append)
    gate = threading.Event()

    def job(wait_idle) -> int:
        assert wait_idle()
        log.append(0)
        gate.wait(5)  # the instance turns busy for good after the first page
        return 1 + sum(1 for _ in range(3) if wait_idle())

    assert wb.submit(job, pages=4, nbytes=1)
    wait_until(lambda: log == [0], what="the first page")
    busy.busy = True
    t0 = time.monotonic()
    gate.set()
    assert wb.flush(5)
    assert drops == [3] and time.monotonic() - t0 >= 0.2
    wb.close()


def test_a_failing_job_counts_its_pages_and_the_writer_goes_on():
    busy, log, drops = Switch(), [], []
    wb = WriteBehind(busy, max_bytes=100, max_wait_s=1, on_drop=drops.append)

    def broken(wait_idle) -> int:
        raise RuntimeError("boom")

    assert wb.submit(broken, pages=2, nbytes=1) and wb.submit(paced_job(log, 1), pages=1, nbytes=1)
    assert wb.flush(5) and drops == [2] and log == [0]
    wb.close()
    assert not wb.submit(paced_job(log, 1), pages=1, nbytes=1)  # closed: refused, counted
    assert drops == [2, 1]


@pytest.mark.parametrize("bad", [dict(max_bytes=0), dict(max_wait_s=0)])
def test_bad_bounds_are_refused(bad):
    with pytest.raises(ValueError):
        WriteBehind(Switch(), **{"max_bytes": 1, "max_wait_s": 1.0, **bad})


def batches_of(pages, split: int) -> list[ExportedPages]:
    """Two CPU batches of whole int8 pages (rows in the transfer format), split at page `split`."""
    fmt = PageFormat(INT8)
    rows = fmt.rows_from_payloads(pages)
    n = len(pages)
    return [
        ExportedPages(list(range(0, split)), [INT8.page_size] * split, rows[:split]),
        ExportedPages(list(range(split, n)), [INT8.page_size] * (n - split), rows[split:]),
    ]


@pytest.mark.parametrize("allowed", [6, 2, 0])
def test_write_back_that_stops_caches_the_chain_head_only(allowed):
    ns = namespace()
    cache = PromptCache(MemoryStore(1 << 20))
    prompt = list(range(100, 100 + 6 * INT8.page_size))
    keys = ns.page_keys(prompt)
    pages = [make_page(INT8, i) for i in range(6)]
    batches = batches_of(pages, 4)
    assert pages_to_write(keys, range(1, 6), batches)[0] == 5  # page 0 came from elsewhere
    left = [allowed]

    def wait_idle() -> bool:
        left[0] -= 1
        return left[0] >= 0

    written = write_back(cache, ns, keys, range(6), [], batches, INT8, wait_idle)
    assert written == allowed
    assert cache.flush()
    hit = cache.lookup(ns, prompt + [1], max_pages=6)
    assert hit.num_pages == allowed
    for got, want in zip(hit.pages, pages):
        assert got.data.equal(want.data) and got.scales.equal(want.scales)
    cache.close()
