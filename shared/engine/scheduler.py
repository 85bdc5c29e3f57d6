"""Continuous-batching scheduler: chunked prefill steps and decode steps over a paged KV pool.

Policy (kept simple and correct):
- A step is either a prefill batch (up to `chunk_size` new tokens across waiting sequences, FIFO; a long prompt
  spans several steps) or a decode batch (one token for every running sequence). Prefill goes first, except
  that a prefill step is always followed by a decode step when sequences are running (bounded decode stall).
- A sequence gets the pages for all its uncomputed tokens when its prefill starts (so partially prefilled
  sequences can never deadlock each other); decode takes one more page on a page boundary.
- Out of pages while decoding: the newest running sequence is preempted back to the front of the waiting
  queue, its pages freed; it is recomputed later (prompt + completion so far, via prefill).
- A waiting sequence with exactly one uncomputed token (an imported request, or a one-token prompt) joins the
  running batch directly: its next step is a plain decode step.
- At most `max_num_seqs` sequences are admitted (running + partially prefilled) at once.
- A sequence with `prefix_keys` is admitted onto the pool pages that already hold its longest registered prefix
  (PageAllocator prefix reuse); only the tokens after them are computed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.engine.page_table import PageAllocator
from pdserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: tokens computed this step, from seq.num_computed_tokens
    is_prefill: bool


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, chunk_size: int, max_num_seqs: int):
        self.allocator = allocator
        self.page_size = page_size
        self.chunk_size = chunk_size
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order
        self._last_was_prefill = False

    # ---- membership --------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues (finish/abort); its pages are left to the caller."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def free_pages(self, seq: Sequence) -> None:
        if seq.page_table:
            self.allocator.free(seq.page_table)
            seq.page_table = []

    def prefill_done(self, seq: Sequence) -> None:
        """A prefilled (not prefill-only) sequence sampled its token: it joins the decode batch."""
        self.waiting.remove(seq)
        self._join_running(seq)

    def _join_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.running.sort(key=lambda s: s.arrival)

    def _num_admitted(self) -> int:
        return len(self.running) + sum(1 for s in self.waiting if s.status == SequenceStatus.PREFILLING)

    def pages_for(self, seq: Sequence, num_tokens: int) -> int:
        """Extra pages `seq` needs so that its first `num_tokens` tokens have slots."""
        return max(0, -(-num_tokens // self.page_size) - len(seq.page_table))

    def has_schedulable_waiting(self) -> bool:
        """Whether a waiting sequence could join the next step (to prefill or to decode): not one importing."""
        return any(s.status in (SequenceStatus.WAITING, SequenceStatus.PREFILLING) for s in self.waiting)

    # ---- scheduling --------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        self._admit_decode_ready()
        if self._last_was_prefill and self.running:
            batch = self._schedule_decode() or self._schedule_prefill()
        else:
            batch = self._schedule_prefill() or self._schedule_decode()
        self._last_was_prefill = batch is not None and batch.is_prefill
        return batch

    def _admit_decode_ready(self) -> None:
        admitted = self._num_admitted()
        ready = [
            s
            for s in self.waiting
            if not s.prefill_only and s.num_uncomputed == 1 and s.status == SequenceStatus.WAITING
        ]
        for seq in ready[: max(0, self.max_num_seqs - admitted)]:
            self.waiting.remove(seq)
            self._join_running(seq)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget, admitted = self.chunk_size, self._num_admitted()
        seqs: list[Sequence] = []
        counts: list[int] = []
        for seq in self.waiting:
            if budget == 0:
                break
            if seq.status == SequenceStatus.WAITING:  # not started: admit it with all its pages, or stop (FIFO)
                shared = self._reusable_prefix(seq)
                need = self.pages_for(seq, seq.num_tokens) - len(shared)
                free = self.allocator.num_free - self.allocator.num_evictable(shared)
                if admitted >= self.max_num_seqs or need > free:
                    break
                if shared:  # the prefix's KV is in the pool already: hold those pages, compute after them
                    self.allocator.share(shared)
                    seq.page_table = shared
                    seq.num_computed_tokens = len(shared) * self.page_size
                    seq.num_shared_pages, seq.shared_pages_reported = len(shared), False
                seq.page_table.extend(self.allocator.allocate(need))
                seq.status = SequenceStatus.PREFILLING
                admitted += 1
            n = min(seq.num_uncomputed, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts, True) if seqs else None

    def _reusable_prefix(self, seq: Sequence) -> list[int]:
        """Registered pool pages holding the longest prefix of `seq`'s full pages, leaving at least its last token
        to compute; none for a sequence that has pages or computed tokens already (a prompt-cache import)."""
        if not seq.prefix_keys or seq.page_table or seq.num_computed_tokens:
            return []
        return self.allocator.held_prefix(seq.prefix_keys[: (seq.num_tokens - 1) // self.page_size])

    def _schedule_decode(self) -> ScheduledBatch | None:
        i = 0
        while i < len(self.running):  # oldest first; victims are taken from the end (newest)
            seq = self.running[i]
            need = self.pages_for(seq, seq.num_computed_tokens + 1)
            while need > self.allocator.num_free and self.running[-1] is not seq:
                self._preempt(self.running[-1])
            if need > self.allocator.num_free:  # seq is the newest and still does not fit
                self._preempt(seq)
                break
            seq.page_table.extend(self.allocator.allocate(need))
            i += 1
        if not self.running:
            return None
        return ScheduledBatch(list(self.running), [1] * len(self.running), False)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free all pages; the sequence re-prefills prompt + completion later."""
        self.running.remove(seq)
        self.free_pages(seq)
        seq.num_computed_tokens = seq.num_imported_pages = seq.num_shared_pages = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
