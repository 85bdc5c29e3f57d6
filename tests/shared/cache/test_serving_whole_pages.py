"""whole_pages: a chunk that streamed layer group by layer group reaches the prompt cache's write-back as its groups'
batches; joined, they are the very rows of the whole pages (int8 with scales, asymmetric int8 with zeros, dense), a
set of groups with a gap or an overlap is left out, and a write-back of groups caches what one of whole pages does."""

from __future__ import annotations

import pytest
import torch
from cache_testutil import DENSE, INT8, PAGE, make_page, namespace

from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.serving import pages_to_write, whole_pages, write_back
from pdserve.cache.store import MemoryStore
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer import ExportedPages
from pdserve.kv.transfer.layers import LayerRange, layer_groups
from pdserve.kv.transfer.page_format import PageFormat

ASYM = KVLayoutSpec("int8", page_size=PAGE, num_layers=3, num_kv_heads=2, head_dim=8, group_size=4, asymmetric=True)
LAYOUTS = {"int8": INT8, "asym3": ASYM, "dense": DENSE}


def group_batch(whole: torch.Tensor, layout: KVLayoutSpec, r: LayerRange, indexes: list[int]) -> ExportedPages:
    """The layer group `r` of whole rows uint8 [N, page_bytes], as the engine's hook exports it."""
    data, scales, zeros = PageFormat(layout).unpack(whole)
    parts = [t[:, :, r.start : r.stop] for t in (data, scales, zeros) if t is not None]
    rows = PageFormat(layout, r.count).pack(*parts, *([None] * (3 - len(parts))))
    return ExportedPages(indexes, [layout.page_size] * len(indexes), rows, layers=r)


def rows_of(layout: KVLayoutSpec, n: int, first: int = 0) -> torch.Tensor:
    return PageFormat(layout).rows_from_payloads([make_page(layout, first + i) for i in range(n)])


@pytest.mark.parametrize("name", LAYOUTS)
def test_groups_join_into_the_whole_rows(name):
    layout = LAYOUTS[name]
    first, second = rows_of(layout, 3), rows_of(layout, 2, first=3)
    groups = [group_batch(first, layout, r, [0, 1, 2]) for r in layer_groups(layout.num_layers, 1)]
    batches = [*reversed(groups), ExportedPages([3, 4], [PAGE, PAGE], second)]  # any order; whole ones kept
    joined = sorted(whole_pages(batches, layout), key=lambda b: b.page_indexes[0])
    assert [b.page_indexes for b in joined] == [[0, 1, 2], [3, 4]]
    assert joined[0].rows.equal(first) and joined[0].host is joined[0].rows and joined[0].layers is None
    assert joined[1].rows is second


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: groups still on the device join there")
@pytest.mark.parametrize("name", LAYOUTS)
def test_groups_on_the_device_join_there_into_the_whole_rows(name):
    layout, device = LAYOUTS[name], torch.device("cuda")
    first = rows_of(layout, 3)
    groups = []
    for r in layer_groups(layout.num_layers, 1):  # one layer a group: several groups for every layout
        g = group_batch(first, layout, r, [0, 1, 2])
        rows = g.rows.to(device)
        ready = torch.cuda.Event()
        ready.record()
        # a transport's host copy (grpc) is not what gets joined: the device rows are (zeros here would show it)
        host = torch.zeros_like(g.rows).pin_memory() if r.start == 0 else None
        groups.append(ExportedPages(g.page_indexes, g.num_tokens, rows, ready=ready, host=host, layers=r))
    cache = PromptCache(MemoryStore(1 << 20))
    (joined,) = whole_pages(groups[::-1], layout, cache)  # on the cache's "write" stream, not its fetch stream
    assert cache.copy_stream(device, "write") is not cache.copy_stream(device)
    assert joined.rows.device.type == "cpu" and joined.rows.is_pinned() and joined.rows.equal(first)


def test_groups_with_a_gap_or_an_overlap_are_left_out():
    layout = ASYM  # 3 layers
    rows = rows_of(layout, 2)
    gap = [group_batch(rows, layout, LayerRange(0, 1), [0, 1]), group_batch(rows, layout, LayerRange(2, 3), [0, 1])]
    overlap = [group_batch(rows, layout, r, [0, 1]) for r in (LayerRange(0, 2), LayerRange(1, 3))]
    short = [group_batch(rows, layout, LayerRange(0, 2), [0, 1])]
    for batches in (gap, overlap, short):
        assert whole_pages(batches, layout) == []


def test_write_back_of_layer_groups_caches_the_pages():
    ns, layout = namespace(), INT8
    cache = PromptCache(MemoryStore(1 << 20))
    prompt = list(range(200, 200 + 5 * PAGE))
    keys = ns.page_keys(prompt)
    pages = [make_page(layout, i) for i in range(5)]
    rows = PageFormat(layout).rows_from_payloads(pages)
    batches = [group_batch(rows[:4], layout, r, [0, 1, 2, 3]) for r in layer_groups(layout.num_layers, 1)]
    batches.append(ExportedPages([4], [PAGE], rows[4:]))
    assert pages_to_write(keys, range(5), batches)[0] == 5  # a page of two groups counts once
    assert write_back(cache, ns, keys, range(5), [], batches, layout) == 5
    assert cache.flush()
    hit = cache.lookup(ns, prompt + [1], max_pages=5)
    assert hit.num_pages == 5
    for got, want in zip(hit.pages, pages):
        assert got.data.equal(want.data) and got.scales is not None and got.scales.equal(want.scales)
    cache.close()


def test_a_write_back_that_stops_copies_no_more_groups(monkeypatch):
    """The groups' device rows are copied to the host only once the engine is idle for their first page: a write-back
    stopped before a unit copies none of it."""
    import pdserve.cache.serving as serving

    copied: list[int] = []

    def to_host(b: ExportedPages):
        copied.append(b.page_indexes[0])
        return b.rows

    monkeypatch.setattr(serving, "to_host", to_host)
    ns, layout = namespace(), INT8
    cache = PromptCache(MemoryStore(1 << 20))
    prompt = list(range(300, 300 + 4 * PAGE))
    keys = ns.page_keys(prompt)
    rows = PageFormat(layout).rows_from_payloads([make_page(layout, i) for i in range(4)])
    batches = [group_batch(rows[a : a + 2], layout, r, [a, a + 1]) for a in (0, 2) for r in layer_groups(2, 1)]
    left = [2]

    def wait_idle() -> bool:
        left[0] -= 1
        return left[0] >= 0

    assert write_back(cache, ns, keys, range(4), [], batches, layout, wait_idle) == 2
    assert copied == [0, 0]  # the first unit's two groups; the second unit's never left the device
    cache.close()
