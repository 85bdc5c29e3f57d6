"""The rank runtime of a tensor-parallel instance: rank 0 (the instance: gRPC server, scheduler) broadcasts each
step's plan and runs it; ranks > 0 wait for plans and run the same forward, joining its collectives.

A plan is int64 integers (never pickled): token ids, each sequence's start position, new-token count and page
table (the slot mapping and positions follow from those, as `AttentionMetadata` builds them), the number of decode
rows, and the hidden-state rows whose logits are computed (every rank joins the logits all-gather). Messages:

    [STEP, S, T, num_decode, R, starts(S), q_lens(S), table_lens(S), token_ids(T), tables(sum table_lens), rows(R)]
    [IDLE]      rank 0's heartbeat while it has no step (a follower's wait fails after the group timeout)
    [SHUTDOWN]  followers return
    [LOGITS, rows...]          logits of these rows of the last step's hidden states (every rank joins the gather;
                               an engine step may compute several such blocks: prompt logprobs, sampled rows)
    [COPY, n, src(n), dst(n)]  copy whole KV pages (a fork's copy-on-write of its prompt's last page)
    [SCATTER, ...]             imported KV pages: each rank receives exactly its heads' bytes (`page_import`)
                               and writes them into its pool
    [GATHER, ...]              exported KV pages: each rank gathers (and quantizes) its heads and sends them to
                               rank 0, which assembles the pages of every KV head (`page_export`); a STEP may
                               carry such exports of layer groups, run inside its forward as each group's last
                               layer is written (a streaming prefill chunk, `--kv-layer-group`)

Failure: a collective with a dead rank fails (gloo: at once when the peer's connection closes, otherwise after the
group's timeout); the runtime lets that error end the process. `exit_with_parent` ends a rank whose parent (the
instance that started it) is gone, so no rank outlives its instance.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model import CausalLM
from pdserve.engine.tp.comm import TPGroup
from pdserve.engine.tp.page_export import GATHER, LayerExport, decode_gather, send_parts
from pdserve.engine.tp.page_import import SCATTER, receive_scatter

log = logging.getLogger("pdserve.engine.tp")

STEP, IDLE, SHUTDOWN, LOGITS, COPY = 1, 2, 3, 4, 5
_HEADER = 5  # STEP, S, T, num_decode, R


@dataclass
class StepPlan:
    """One forward, as every rank runs it."""

    token_ids: list[int]  # [T] the step's new tokens, sequence by sequence
    starts: list[int]  # [S] tokens already in the pool per sequence
    q_lens: list[int]  # [S] new tokens per sequence (sum T)
    page_tables: list[list[int]]  # [S][pages] physical pages covering start + q_len tokens
    num_decode: int  # the first num_decode sequences are decode rows
    logit_rows: list[int]  # rows of the step's hidden states [T, hidden] whose logits are computed
    # layer groups exported during the forward, in the order rank 0 exports them (`page_export.LayerExport`)
    exports: list[LayerExport] = field(default_factory=list)

    def encode(self) -> torch.Tensor:
        """The plan as a 1-D int64 tensor (the STEP message): its fields, then the exports, when there are any,
        as [count, then each one's GATHER message]."""
        s, t = len(self.starts), len(self.token_ids)
        header = [STEP, s, t, self.num_decode, len(self.logit_rows)]
        flat = list(itertools.chain.from_iterable(self.page_tables))
        lens = [len(p) for p in self.page_tables]
        tail = [len(self.exports), *(x for e in self.exports for x in e.message().tolist())] if self.exports else []
        return torch.tensor(
            header + self.starts + self.q_lens + lens + self.token_ids + flat + self.logit_rows + tail,
            dtype=torch.int64,
        )

    @classmethod
    def decode(cls, msg: torch.Tensor, vocab_size: int, num_pages: int, page_size: int = 1 << 20) -> StepPlan:
        """A STEP message -> the plan; ValueError for one that does not add up (lengths, ids, pages, rows, the
        exports' pages and token counts against `page_size`)."""
        v = msg.tolist()
        if len(v) < _HEADER or v[0] != STEP:
            raise ValueError("not a STEP message")
        _, s, t, num_decode, r = v[:_HEADER]
        if min(s, t, num_decode, r) < 0 or num_decode > s:
            raise ValueError(f"bad plan header {v[:_HEADER]}")
        pos = _HEADER
        starts, q_lens, lens = v[pos : pos + s], v[pos + s : pos + 2 * s], v[pos + 2 * s : pos + 3 * s]
        pos += 3 * s
        end = pos + t + sum(lens) + r
        if len(lens) != s or min(lens, default=0) < 0 or len(v) < end:
            raise ValueError(f"plan of {len(v)} ints does not match its header {v[:_HEADER]}")
        try:
            exports = LayerExport.decode_all(v[end:], num_pages, page_size)
        except ValueError as e:
            raise ValueError(f"plan of {len(v)} ints does not match its header {v[:_HEADER]}: {e}") from None
        ids = v[pos : pos + t]
        pos += t
        tables = []
        for n in lens:
            tables.append(v[pos : pos + n])
            pos += n
        rows = v[pos : pos + r]
        if sum(q_lens) != t or min(q_lens, default=1) < 0 or min(starts, default=0) < 0:
            raise ValueError("plan q_lens / starts do not match its tokens")
        if any(not 0 <= i < vocab_size for i in ids) or any(not 0 <= p < num_pages for tb in tables for p in tb):
            raise ValueError("plan token id or page outside the model's vocabulary / the pool")
        if any(not 0 <= x < t for x in rows):
            raise ValueError("plan logit row outside the step's tokens")
        return cls(ids, starts, q_lens, tables, num_decode, rows, exports)


def logits_message(rows: list[int]) -> torch.Tensor:
    """The LOGITS message for `rows` of the last step's hidden states."""
    return torch.tensor([LOGITS, *rows], dtype=torch.int64)


def copy_message(src: list[int], dst: list[int]) -> torch.Tensor:
    """The COPY message: page src[i] -> dst[i]."""
    if len(src) != len(dst):
        raise ValueError(f"copy of {len(src)} pages to {len(dst)}")
    return torch.tensor([COPY, len(src), *src, *dst], dtype=torch.int64)


def decode_rows(msg: torch.Tensor, num_rows: int) -> list[int]:
    """A LOGITS message -> its rows; ValueError unless each is a row of the last step (`num_rows` of them)."""
    rows = msg.tolist()[1:]
    if any(not 0 <= r < num_rows for r in rows):
        raise ValueError(f"LOGITS row outside the last step's {num_rows} rows")
    return rows


def decode_copy(msg: torch.Tensor, num_pages: int) -> tuple[list[int], list[int]]:
    """A COPY message -> (src, dst); ValueError for one that does not add up or names a page outside the pool."""
    v = msg.tolist()
    if len(v) < 2 or v[1] < 0 or len(v) != 2 + 2 * v[1]:
        raise ValueError(f"COPY message of {len(v)} ints does not match its count")
    pages = v[2:]
    if any(not 0 <= p < num_pages for p in pages):
        raise ValueError("COPY page outside the pool")
    n = v[1]
    return pages[:n], pages[n:]


def forward_plan(model: CausalLM, cache: KVCache, backend, plan: StepPlan, page_size: int) -> torch.Tensor:
    """One forward of `plan` on this rank -> hidden states [T, hidden]."""
    device = cache.device
    meta = AttentionMetadata(plan.starts, plan.q_lens, plan.page_tables, page_size, device, plan.num_decode)
    return model(torch.tensor(plan.token_ids, dtype=torch.long, device=device), meta, cache, backend)  # [T, h]


def run_plan(model: CausalLM, cache: KVCache, backend, plan: StepPlan, page_size: int) -> torch.Tensor:
    """One forward of `plan` on this rank -> logits [R, vocab] float32 of its `logit_rows` (the full vocabulary
    on every rank, after the all-gather)."""
    hidden = forward_plan(model, cache, backend, plan, page_size)  # [T, h]
    if not plan.logit_rows:  # every rank skips the gather alike (they run the same plan)
        return hidden.new_zeros(0, model.config.vocab_size, dtype=torch.float32)
    return model.compute_logits(hidden[plan.logit_rows])


class PlanLeader:
    """Rank 0's side: broadcast a plan, then run it (`step`); `idle` while there is no step (more often than the
    group timeout); `shutdown` once."""

    def __init__(self, model: CausalLM, cache: KVCache, backend, group: TPGroup, page_size: int):
        if not group.is_root:
            raise ValueError("PlanLeader runs on rank 0")
        self.model, self.cache, self.backend, self.group, self.page_size = model, cache, backend, group, page_size

    def step(self, plan: StepPlan) -> torch.Tensor:
        self.group.broadcast_ints(plan.encode())
        return run_plan(self.model, self.cache, self.backend, plan, self.page_size)

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Broadcast and run `plan` (its logit_rows ignored) -> hidden [T, hidden]; `logits` computes rows of it."""
        if plan.logit_rows:
            plan = StepPlan(plan.token_ids, plan.starts, plan.q_lens, plan.page_tables, plan.num_decode, [])
        self.group.broadcast_ints(plan.encode())
        return forward_plan(self.model, self.cache, self.backend, plan, self.page_size)

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits [len(rows), vocab] float32 of `rows` of the last `forward`'s hidden states (the ranks gather)."""
        self.group.broadcast_ints(logits_message(rows))
        return self.model.compute_logits(hidden[rows])

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole KV pages on every rank (each its own heads)."""
        self.group.broadcast_ints(copy_message(src, dst))
        self.cache.copy_pages(src, dst)

    def idle(self) -> None:
        self.group.broadcast_ints(torch.tensor([IDLE], dtype=torch.int64))

    def shutdown(self) -> None:
        self.group.broadcast_ints(torch.tensor([SHUTDOWN], dtype=torch.int64))


def follow(
    model: CausalLM,
    cache: KVCache,
    backend,
    group: TPGroup,
    page_size: int,
    kv_heads: tuple[int, ...] = (),
    handlers: Mapping[int, Callable[[torch.Tensor], None]] | None = None,
) -> int:
    """A rank > 0's loop: run each broadcast plan until SHUTDOWN; returns the steps run. A failed collective
    (a rank died, or rank 0 sent nothing within the group timeout) raises. `kv_heads`: the global KV head of each
    of this rank's pool heads (an imported batch must carry that many). `handlers`: message kind -> what runs it,
    for kinds other modules add (`graph_step`: decode graph replays)."""
    if group.is_root:
        raise ValueError("follow runs on ranks > 0")
    steps = 0
    hidden = None  # [T, hidden] of the last step: LOGITS messages compute rows of it
    while True:
        msg = group.broadcast_ints(None)
        kind = int(msg[0]) if msg.numel() else -1
        if kind == SHUTDOWN:
            return steps
        if kind == IDLE:
            continue
        if kind == LOGITS:
            rows = decode_rows(msg, 0 if hidden is None else hidden.shape[0])
            assert hidden is not None  # decode_rows refuses any row without a step
            model.compute_logits(hidden[rows])
            continue
        if kind == COPY:
            cache.copy_pages(*decode_copy(msg, cache.num_pages))
            continue
        if kind == SCATTER:
            pages, data, scales, zeros, g, span = receive_scatter(group, msg, cache.num_pages)
            if kv_heads and data.shape[4] != len(kv_heads):
                raise ValueError(f"SCATTER of {data.shape[4]} KV heads to a rank holding {len(kv_heads)}")
            cache.scatter_pages(pages, data, scales, zeros, g, span)
            continue
        if kind == GATHER:
            send_parts(group, cache.gather_pages(*decode_gather(msg, cache.num_pages, page_size)))
            continue
        if handlers is not None and kind in handlers:
            handlers[kind](msg)
            steps += 1
            continue
        plan = StepPlan.decode(msg, model.config.vocab_size, cache.num_pages, page_size)
        model.layer_hook = export_hook(group, cache, plan.exports) if plan.exports else None
        try:
            hidden = forward_plan(model, cache, backend, plan, page_size)
        finally:
            model.layer_hook = None
        if plan.logit_rows:
            model.compute_logits(hidden[plan.logit_rows])
        steps += 1


def export_hook(group: TPGroup, cache: KVCache, exports: list[LayerExport]):
    """A follower's layer hook for one forward: after each layer, its part of every group ending there, in the
    plan's order (rank 0's hook gathers the same groups at the same layer, `page_export.leader_gather`)."""

    # the pages' index tensors made before the forward: no host-to-device copy (a device sync) inside it
    indexes = [torch.tensor(e.pages, dtype=torch.long, device=cache.device) for e in exports]

    def hook(layer: int) -> None:
        for e, index in zip(exports, indexes):
            if e.stop - 1 == layer:
                send_parts(group, cache.gather_pages(*e.gather_args(), index=index))

    return hook


def exit_with_parent(poll_s: float = 0.5, code: int = 3) -> threading.Thread:
    """Start a daemon thread that ends this process (os._exit(code)) once its parent process is gone (the instance
    that started this rank): a rank blocked in a collective never outlives it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.error("TP rank: parent process %d is gone, exiting", parent)
        os._exit(code)

    t = threading.Thread(target=watch, name="tp-parent-watch", daemon=True)
    t.start()
    return t
