"""Writing one request's newly computed full pages back to the prompt cache (what `prefix_policy.PrefixPolicy`
decides to write, and when).

    pages_to_write(keys, pages, batches)                                  what a write-back may store, and its bytes
    write_back(cache, ns, keys, write, ask, batches, layout, wait_idle)  the batches' pages `write`, and those of
                                                                          `ask` the store lacks, as host copies
                                                                          (on a `WriteBehind` thread in prefill);
                                                                          `local=`: pages for the local tier alone
    whole_pages(batches, layout)                                           layer-group batches joined into whole
                                                                          pages (host rows), the others as they are
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.value import encode_row
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.payload import PagePayload
from pdserve.kv.transfer import ExportedPages
from pdserve.kv.transfer.grpc_transport import to_host
from pdserve.kv.transfer.page_format import PageFormat


def pages_to_write(keys: list[bytes], pages: Collection[int], batches: list[ExportedPages]) -> tuple[int, int]:
    """(pages, bytes) `write_back` would write at most of `batches` (`pages`: the page indexes it may write), and
    the bytes those batches hold."""
    want = set(pages)
    n = len({idx for b in batches for idx in b.page_indexes if idx in want and idx < len(keys)})  # groups: once
    return n, sum(b.nbytes for b in batches)


def whole_pages(batches: list[ExportedPages], layout: KVLayoutSpec) -> list[ExportedPages]:
    """`batches` as whole pages: those of all layers as they are; the layer groups of one set of pages (a chunk that
    streamed group by group, `pdserve.kv.transfer.layers`) joined into one host batch, each group's rows copied into
    its layers of the whole rows. Pages whose groups do not cover every layer exactly once are left out."""
    whole: list[ExportedPages] = []
    grouped: dict[tuple[int, ...], list[ExportedPages]] = {}
    for b in batches:
        if b.layers is None or b.layers.is_all(layout.num_layers):
            whole.append(b)
        else:
            grouped.setdefault(tuple(b.page_indexes), []).append(b)
    fmt = PageFormat(layout)
    for indexes, parts in grouped.items():
        parts.sort(key=lambda b: b.layers.start if b.layers else 0)
        bounds = [(b.layers.start, b.layers.stop) for b in parts if b.layers is not None]
        if [a for a, _ in bounds] != [0] + [z for _, z in bounds[:-1]] or bounds[-1][1] != layout.num_layers:
            continue  # a gap or an overlap: these pages are not whole
        rows = torch.empty(len(indexes), fmt.page_bytes, dtype=torch.uint8)  # [N, page_bytes]
        dst = fmt.unpack(rows)  # data [N, 2, layers, ...], scales / zeros alike or None
        for b in parts:
            assert b.layers is not None
            src = PageFormat(layout, b.layers.count).unpack(b.host if b.host is not None else to_host(b))
            for d, s in zip(dst, src):
                if d is not None and s is not None:
                    d[:, :, b.layers.start : b.layers.stop] = s
        whole.append(ExportedPages(list(indexes), list(parts[0].num_tokens), rows, host=rows))
    return whole


def write_back(
    cache: PromptCache,
    ns: CacheNamespace,
    keys: list[bytes],
    write: Collection[int],
    ask: Collection[int],
    batches: list[ExportedPages],
    layout: KVLayoutSpec,
    wait_idle: Callable[[], bool] = lambda: True,
    local: Collection[int] = (),
) -> int:
    """Put the pages `write` of `batches` (one request's, in prompt order, in `layout`; full pages with `keys`,
    every full page's), and those of `ask` the store lacks (`PromptCache.stored`: one round trip, which also
    resets the TTL of those it holds), into the cache as one chain (CPU copies; the store write is asynchronous).
    With a local tier, the pages the store holds, and those of `local` (a fetch's, verified), go to the local tier
    alone. `wait_idle` is called before each page (`WriteBehind.wait_idle`); when it says False the chain ends
    there. Returns the pages handed to the cache."""
    batches = whole_pages(batches, layout)
    held = cache.stored(ns, [keys[i] for i in ask]) if ask else []
    in_store = {i for i, h in zip(ask, held) if h}
    to_store = set(write) | (set(ask) - in_store)
    wanted = to_store | ((in_store | set(local)) if cache.local is not None else set())
    items: list[tuple[int, bytes, bytes, PagePayload]] = []  # (page index, key, value, page as views of it)
    stopped = False
    for batch in sorted(batches, key=lambda b: b.page_indexes[0] if b.page_indexes else 0):
        want = [i for i, idx in enumerate(batch.page_indexes) if idx in wanted and idx < len(keys)]
        if not want or stopped:
            continue
        rows = batch.host if batch.host is not None else to_host(batch)  # uint8 [pages, page_bytes]
        for i in sorted(want, key=lambda i: batch.page_indexes[i]):
            idx = batch.page_indexes[i]
            if batch.num_tokens[i] != layout.page_size:  # only full pages have keys; kept as a guard
                continue
            if not wait_idle():
                stopped = True
                break
            value, page = encode_row(rows[i], ns, keys[idx], idx)  # one copy of the page in all
            items.append((idx, keys[idx], value, page))
    items.sort(key=lambda it: it[0])
    cache.put_many(
        ns, [(k, p) for _, k, _, p in items], [v for _, _, v, _ in items], [i in to_store for i, *_ in items]
    )  # counts its own drops
    return len(items)
