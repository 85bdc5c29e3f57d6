"""Decode CUDA graphs at tensor parallel: every rank captured the same graphs (`cuda_graphs.DecodeGraphRunner`, the
model's NCCL all-reduces and the logits' all-gather inside them), so a replay on rank 0 is a collective that every
rank must join with the same batch size and inputs. Rank 0's `LeaderGraphs` broadcasts each replay (and each masked
re-draw) before running it; a follower's `follower_handlers` replays its own graphs from those messages.

Messages (int64, on the plan group; worker.py's kinds are below 16):

    [GRAPH_RUN, B, chained, positions(B), ids(B, none when chained), per row: reset, n, table entries(n)]
    [GRAPH_MASK, b, words, bitmask(b * words)]   the grammar bitmask of a masked re-draw (int32 words)

A chained run (ids none) feeds each row the previous run's argmax: each rank takes its own, equal on every rank
since the logits are all-gathered and a masked re-draw is replayed everywhere with the same bitmask. Page tables
travel as deltas, as the runner writes them into its static buffer: a row whose table is the same list object as
the last run's sends only its new entries (reset 0), any other sends the whole table (reset 1); a follower keeps one
list per row and extends it in place, so its runner rewrites only the new entries too.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from pdserve.engine.tp.comm import TPGroup

GRAPH_RUN, GRAPH_MASK = 16, 17


class TableDeltas:
    """Rank 0's record of what each row's table was last sent as (list object, entries), like the runner's own."""

    def __init__(self, max_batch: int):
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * max_batch

    def encode(self, tables: list[list[int]]) -> list[int]:
        out: list[int] = []
        for i, t in enumerate(tables):
            sent, n = self._rows[i]
            if sent is not t or n > len(t):
                sent, n = None, 0
            out += [int(sent is None), len(t) - n, *t[n:]]
            self._rows[i] = (t, len(t))
        return out


def run_message(
    deltas: TableDeltas, ids: list[int] | None, positions: list[int], tables: list[list[int]]
) -> torch.Tensor:
    """The GRAPH_RUN message of one replay (`ids` None: chained)."""
    b = len(positions)
    if len(tables) != b or (ids is not None and len(ids) != b):
        raise ValueError(f"graph run of {b} positions with {len(tables)} tables and {len(ids or [])} ids")
    head = [GRAPH_RUN, b, int(ids is None), *positions, *(ids or [])]
    return torch.tensor(head + deltas.encode(tables), dtype=torch.int64)


def mask_message(bitmask: torch.Tensor) -> torch.Tensor:
    """The GRAPH_MASK message of `bitmask` [b, words] int32."""
    b, words = bitmask.shape
    return torch.cat([torch.tensor([GRAPH_MASK, b, words], dtype=torch.int64), bitmask.reshape(-1).to(torch.int64)])


class FollowerTables:
    """A follower's page table per row, kept across runs and extended in place by GRAPH_RUN deltas."""

    def __init__(self, max_batch: int):
        self.rows: list[list[int]] = [[] for _ in range(max_batch)]

    def apply(self, v: list[int], pos: int, b: int, num_pages: int) -> list[list[int]]:
        """Apply the per-row deltas at v[pos:] for rows 0..b-1 -> the tables; ValueError for a bad message."""
        for i in range(b):
            if pos + 2 > len(v):
                raise ValueError("GRAPH_RUN message ends inside its tables")
            reset, n = v[pos], v[pos + 1]
            entries = v[pos + 2 : pos + 2 + n]
            if reset not in (0, 1) or n < 0 or len(entries) != n:
                raise ValueError("GRAPH_RUN table delta does not add up")
            if any(not 0 <= p < num_pages for p in entries):
                raise ValueError("GRAPH_RUN page outside the pool")
            if reset:
                self.rows[i] = entries
            else:
                self.rows[i].extend(entries)
            pos += 2 + n
        if pos != len(v):
            raise ValueError(f"GRAPH_RUN message has {len(v) - pos} ints past its tables")
        return self.rows[:b]


def decode_run(
    msg: torch.Tensor, tables: FollowerTables, max_batch: int, vocab_size: int, num_pages: int
) -> tuple[list[int] | None, list[int], list[list[int]]]:
    """A GRAPH_RUN message -> (ids or None when chained, positions, tables); ValueError for one that does not add
    up (sizes, token ids, positions, pages)."""
    v = msg.tolist()
    if len(v) < 3 or v[0] != GRAPH_RUN or not 1 <= v[1] <= max_batch or v[2] not in (0, 1):
        raise ValueError(f"bad GRAPH_RUN header {v[:3]}")
    b, chained = v[1], bool(v[2])
    positions = v[3 : 3 + b]
    pos = 3 + b
    ids = None if chained else v[pos : pos + b]
    pos += 0 if chained else b
    if len(positions) != b or (ids is not None and len(ids) != b):
        raise ValueError("GRAPH_RUN message shorter than its header")
    if min(positions) < 0 or (ids is not None and any(not 0 <= i < vocab_size for i in ids)):
        raise ValueError("GRAPH_RUN position or token id out of range")
    return ids, positions, tables.apply(v, pos, b, num_pages)


def decode_mask(msg: torch.Tensor, max_batch: int, words: int) -> torch.Tensor:
    """A GRAPH_MASK message -> the bitmask [b, words] int32."""
    if msg.numel() < 3 or int(msg[0]) != GRAPH_MASK:
        raise ValueError("not a GRAPH_MASK message")
    b, w = int(msg[1]), int(msg[2])
    if not 1 <= b <= max_batch or w != words or msg.numel() != 3 + b * w:
        raise ValueError(f"GRAPH_MASK of {b} x {w} words does not match this rank's {max_batch} x {words}")
    return msg[3:].to(torch.int32).view(b, w)


class LeaderGraphs:
    """Rank 0's decode graphs at TP > 1: `run` and `sample_masked` broadcast their message (under `guard`: a
    failed collective ends the instance) before replaying; everything else is the wrapped runner's."""

    def __init__(self, graphs, group: TPGroup, guard: Callable[[], AbstractContextManager[None]]):
        self._graphs, self._group, self._guard = graphs, group, guard
        self._deltas = TableDeltas(graphs.max_batch)

    def run(self, input_ids: list[int] | None, positions: list[int], page_tables: list[list[int]]) -> torch.Tensor:
        self._graphs.check_chain(input_ids is None, len(positions))  # a refused run is never broadcast
        with self._guard():
            self._group.broadcast_ints(run_message(self._deltas, input_ids, positions, page_tables))
            return self._graphs.run(input_ids, positions, page_tables)

    def sample_masked(self, bitmask: torch.Tensor):
        with self._guard():
            self._group.broadcast_ints(mask_message(bitmask))
            return self._graphs.sample_masked(bitmask)

    def capture(self) -> None:
        raise RuntimeError(
            "re-capturing the decode graphs of a tensor-parallel instance (set_kernels) is not supported: every "
            "rank would have to capture with it"
        )

    def __getattr__(self, name: str):
        return getattr(self._graphs, name)


def follower_handlers(graphs, vocab_size: int, num_pages: int) -> dict[int, Callable[[torch.Tensor], None]]:
    """A follower's handlers of GRAPH_RUN and GRAPH_MASK (`worker.follow`'s `handlers`), replaying `graphs` (its
    DecodeGraphRunner; None: this rank has none, and a graph message is an error)."""

    def missing(msg: torch.Tensor) -> None:
        raise ValueError("a decode graph message for a rank without decode graphs (its config differs from rank 0's)")

    if graphs is None:
        return {GRAPH_RUN: missing, GRAPH_MASK: missing}
    tables = FollowerTables(graphs.max_batch)

    def run(msg: torch.Tensor) -> None:
        ids, positions, rows = decode_run(msg, tables, graphs.max_batch, vocab_size, num_pages)
        if not graphs.can_run(len(positions), max(positions) + 1):
            raise ValueError(f"GRAPH_RUN of {len(positions)} rows up to position {max(positions)}: not captured")
        graphs.run(ids, positions, rows)

    def mask(msg: torch.Tensor) -> None:
        words = -(-vocab_size // 32)
        graphs.sample_masked(decode_mask(msg, graphs.max_batch, words))

    return {GRAPH_RUN: run, GRAPH_MASK: mask}
