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


def whole_pages(
    batches: list[ExportedPages], layout: KVLayoutSpec, cache: PromptCache | None = None
) -> list[ExportedPages]:
    """`batches` as whole pages: those of all layers as they are; the layer groups of one set of pages (a chunk that
    streamed group by group, `pdserve.kv.transfer.layers`) joined into one host batch (`_host_rows`). Pages whose
    groups do not cover every layer exactly once are left out. `cache`: whose "write" stream joins device groups."""
    whole = []
    for unit in _units(batches, layout):
        if _is_whole(unit, layout):
            whole.append(unit[0])
        elif (rows := _host_rows(unit, layout, cache)) is not None:
            whole.append(ExportedPages(list(unit[0].page_indexes), list(unit[0].num_tokens), rows, host=rows))
    return whole


def _is_whole(unit: list[ExportedPages], layout: KVLayoutSpec) -> bool:
    """A unit of one batch of all layers."""
    return len(unit) == 1 and (unit[0].layers is None or unit[0].layers.is_all(layout.num_layers))


def _units(batches: list[ExportedPages], layout: KVLayoutSpec) -> list[list[ExportedPages]]:
    """`batches` in prompt order as units of whole pages: a batch of all layers alone, or the layer groups of one
    set of pages together (sorted by layer)."""
    units: dict[tuple[int, ...], list[ExportedPages]] = {}
    out: list[list[ExportedPages]] = []
    for b in batches:
        if _is_whole([b], layout):
            out.append([b])
        else:
            units.setdefault(tuple(b.page_indexes), []).append(b)
    for parts in units.values():
        out.append(sorted(parts, key=lambda b: b.layers.start if b.layers else 0))
    return sorted(out, key=lambda u: u[0].page_indexes[0] if u[0].page_indexes else 0)


def _host_rows(unit: list[ExportedPages], layout: KVLayoutSpec, cache: PromptCache | None) -> torch.Tensor | None:
    """A unit's whole rows on the host, uint8 [pages, page_bytes]: the batch's own (or its device rows copied),
    or its groups joined, each group's rows copied into its layers of the rows; None for groups that do not cover
    every layer exactly once. Groups on the device are joined there (`_device_join`), also where the transport made
    host copies: a host join of a 2k prompt's groups is ~140 MB of strided copies on every core, beside the
    services' threads, where the device does it in well under a millisecond and one copy brings it over."""
    if _is_whole(unit, layout):
        return unit[0].host if unit[0].host is not None else to_host(unit[0])
    bounds = [(b.layers.start, b.layers.stop) for b in unit if b.layers is not None]
    if [a for a, _ in bounds] != [0] + [z for _, z in bounds[:-1]] or bounds[-1][1] != layout.num_layers:
        return None  # a gap or an overlap: these pages are not whole
    if all(b.rows.is_cuda for b in unit):
        return _device_join(unit, bounds, layout, cache)
    rows = torch.empty(len(unit[0].page_indexes), PageFormat(layout).page_bytes, dtype=torch.uint8)
    _join_into(rows, [b.host if b.host is not None else to_host(b) for b in unit], bounds, layout)
    return rows


def _join_into(
    rows: torch.Tensor, parts: list[torch.Tensor], bounds: list[tuple[int, int]], layout: KVLayoutSpec
) -> None:
    """Copy each layer group's rows `parts[i]` (uint8 [N, its page_bytes]) into layers `bounds[i]` of `rows` (uint8
    [N, page_bytes], same device)."""
    dst = PageFormat(layout).unpack(rows)  # data [N, 2, layers, ...], scales / zeros alike or None
    for part, (start, stop) in zip(parts, bounds):
        for d, src in zip(dst, PageFormat(layout, stop - start).unpack(part)):
            if d is not None and src is not None:
                d[:, :, start:stop].copy_(src)


def _device_join(
    unit: list[ExportedPages], bounds: list[tuple[int, int]], layout: KVLayoutSpec, cache: PromptCache | None
) -> torch.Tensor:
    """Device groups joined into whole rows on the device, on a side stream (after each group's gather; the cache's
    "write" stream, whose allocator pool keeps the joined rows' memory for the next join), then one copy to pinned
    host memory: the engine's stream and this process's CPU cores do none of it."""
    device = unit[0].rows.device
    stream = cache.copy_stream(device, "write") if cache is not None else torch.cuda.Stream(device=device)
    with torch.cuda.stream(stream):
        for b in unit:
            if b.ready is not None:
                stream.wait_event(b.ready)  # the group's gather, queued on the engine's stream
        rows = torch.empty(len(unit[0].page_indexes), PageFormat(layout).page_bytes, dtype=torch.uint8, device=device)
        _join_into(rows, [b.rows for b in unit], bounds, layout)
        host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        for b in unit:
            b.rows.record_stream(stream)
    stream.synchronize()
    return host


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
    held = cache.stored(ns, [keys[i] for i in ask]) if ask else []
    in_store = {i for i, h in zip(ask, held) if h}
    to_store = set(write) | (set(ask) - in_store)
    wanted = to_store | ((in_store | set(local)) if cache.local is not None else set())
    items: list[tuple[int, bytes, bytes, PagePayload]] = []  # (page index, key, value, page as views of it)
    for unit in _units(batches, layout):
        head = unit[0]  # a unit's batches hold the same pages
        want = [i for i, idx in enumerate(head.page_indexes) if idx in wanted and idx < len(keys)]
        want = [i for i in want if head.num_tokens[i] == layout.page_size]  # only full pages have keys (a guard)
        rows = None  # uint8 [pages, page_bytes] on the host, made once the engine is idle
        for i in sorted(want, key=lambda i: head.page_indexes[i]):
            if not wait_idle():
                return _put(cache, ns, items, to_store)
            rows = _host_rows(unit, layout, cache) if rows is None else rows
            if rows is None:
                break  # groups that are not whole pages: none of these
            idx = head.page_indexes[i]
            value, page = encode_row(rows[i], ns, keys[idx], idx)  # one copy of the page in all
            items.append((idx, keys[idx], value, page))
    return _put(cache, ns, items, to_store)


def _put(
    cache: PromptCache, ns: CacheNamespace, items: list[tuple[int, bytes, bytes, PagePayload]], to_store: set[int]
) -> int:
    items.sort(key=lambda it: it[0])
    cache.put_many(
        ns, [(k, p) for _, k, _, p in items], [v for _, _, v, _ in items], [i in to_store for i, *_ in items]
    )  # counts its own drops
    return len(items)
