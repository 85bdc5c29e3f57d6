"""Continuous-batching scheduler: mixed steps of decode rows and prefill chunks over a paged KV pool.

Policy (kept simple and correct):
- Every step decodes one token for every running sequence (the decode rows) and, in the same forward, computes
  prefill chunks of waiting sequences with what is left of the step's token budget (the prefill rows): a step of
  D decode rows prefills at most `prefill_budget(D)` = min(`chunk_size`, `step_token_budget` − D) tokens, never
  fewer than a quarter of min(`chunk_size`, `step_token_budget`) (`MIN_PREFILL_SHARE`), so prompts progress beside
  a full decode batch (a budget of 0 or -1 is `chunk_size`; -1, auto, is resolved by the service that runs the
  engine: a colocated instance sizes both from its measured step costs, `set_budget`, with room for every decode
  row beside a full chunk). A step with no decode rows may prefill up to `idle_chunk_size` (set_budget; default:
  the budget above): the budget holds TPOT by bounding how long a step stalls the running streams, and with none
  running a larger step only saves the per-step weight read. Decode rows are never dropped: the budget bounds
  the step's time, and so TPOT. A step with
  no prefill is a pure decode step (the decode CUDA graphs), one with no running sequence a pure prefill step (a
  prefill-only instance's steps are all of that kind).
- Prefill rows of several sequences share a step. The budget goes first to the oldest waiting sequence (queue
  order), up to a quarter of it (`HEAD_SHARE`), then to every candidate by fewest uncomputed tokens first
  (shortest remaining first, the oldest counted after its share; ties in queue order). A long prompt thus
  never holds back a short one that arrived after it by more than a step (a short prompt of up to three quarters
  of the budget is computed in the next step), and it still advances by at least a quarter of the budget every
  step while it is the oldest, so no prompt starves; prompts of equal length run in arrival order (the one that
  started has fewer tokens left).
- A sequence gets the pages for all its uncomputed tokens when its prefill starts (so partially prefilled
  sequences can never deadlock each other); decode takes one more page on a page boundary. The sequences a step
  gives tokens to start in queue order: once one does not fit (pages or `max_num_seqs`), no later one starts in
  that step; the oldest waiting sequence is always given tokens, so it starts as soon as the pool can hold it.
- Out of pages while decoding: the newest running sequence is preempted back to the front of the waiting
  queue, its pages freed; it is recomputed later (prompt + completion so far, via prefill).
- A waiting sequence with exactly one uncomputed token (an imported request, or a one-token prompt) joins the
  running batch directly: its next step decodes it.
- At most `max_num_seqs` sequences are admitted (running + partially prefilled) at once.
- A sequence with `prefix_keys` is admitted onto the pool pages that already hold its longest registered prefix
  (PageAllocator prefix reuse); only the tokens after them are computed.
- A chunk ends at a sequence's `prefill_stop` rather than cross it (where the pages of a prefix fetch racing the
  compute start: pdserve.engine.prefix_fetch); the budget it leaves goes to the other candidates.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.engine.page_table import PageAllocator
from pdserve.engine.sequence import Sequence, SequenceStatus

MIN_PREFILL_SHARE = 4  # a step's prefill budget is never below 1/4 of min(chunk_size, step_token_budget)
HEAD_SHARE = 4  # the oldest prefilling sequence is given up to 1/4 of the step's prefill budget first


@dataclass
class ScheduledBatch:
    """One step: `seqs[:num_decode]` decode one token each (running sequences), `seqs[num_decode:]` compute
    prompt chunks (`num_new_tokens[i]` tokens from `seqs[i].num_computed_tokens` on)."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_decode: int
    prefill_budget: int = 0  # prefill tokens this step could have taken (the capacity meter's "full step")

    @property
    def is_decode(self) -> bool:
        """A pure decode step (no prefill rows)."""
        return self.num_decode == len(self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.num_new_tokens[self.num_decode :])


class Scheduler:
    def __init__(
        self, allocator: PageAllocator, page_size: int, chunk_size: int, max_num_seqs: int, step_token_budget: int = 0
    ):
        self.allocator = allocator
        self.page_size = page_size
        self.chunk_size = chunk_size
        self.max_num_seqs = max_num_seqs
        self.step_token_budget = step_token_budget if step_token_budget > 0 else chunk_size  # 0 / -1 (auto): chunk
        self.idle_chunk_size = 0  # prefill tokens of a step without decode rows, where above the budget (set_budget)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order

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

    def set_budget(self, chunk_size: int, step_token_budget: int, idle_chunk_size: int = 0) -> None:
        """Change the step's sizes between steps (a colocated instance sizes them from measured step costs after
        start-up, `pdserve.decode.step_budget`); partly prefilled prompts continue under the new sizes.
        `idle_chunk_size`: prefill tokens a step without decode rows may take (0: the budget's; a size the engine's
        activation memory holds, the caller's to know)."""
        if chunk_size <= 0 or step_token_budget <= 0 or idle_chunk_size < 0:
            raise ValueError(f"chunk_size and step_token_budget must be > 0, idle_chunk_size >= 0, got {chunk_size}, "
                             f"{step_token_budget}, {idle_chunk_size}")  # fmt: skip
        self.chunk_size, self.step_token_budget = chunk_size, step_token_budget
        self.idle_chunk_size = idle_chunk_size

    def prefill_budget(self, num_decode: int) -> int:
        """Prefill tokens a step with `num_decode` decode rows may compute (module docstring)."""
        cap = min(self.chunk_size, self.step_token_budget)
        if num_decode == 0:
            return max(cap, self.idle_chunk_size)
        return min(cap, max(self.step_token_budget - num_decode, max(1, cap // MIN_PREFILL_SHARE)))

    # ---- scheduling --------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """The next step: every running sequence's decode row, then prefill chunks within the budget left."""
        self._admit_decode_ready()
        decode = self._schedule_decode()
        budget = self.prefill_budget(len(decode))
        prefill, counts = self._schedule_prefill(budget)
        if not decode and not prefill:
            return None
        return ScheduledBatch(decode + prefill, [1] * len(decode) + counts, len(decode), budget)

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

    def _schedule_decode(self) -> list[Sequence]:
        """The running sequences, each with a page for one more token (preempting the newest when out of pages)."""
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
        return list(self.running)

    def _schedule_prefill(self, budget: int) -> tuple[list[Sequence], list[int]]:
        """Prefill rows within `budget` tokens: (sequences in queue order, tokens of each)."""
        cands: list[Sequence] = []
        startable = self.max_num_seqs - self._num_admitted()
        for seq in self.waiting:
            if seq.status == SequenceStatus.PREFILLING:
                cands.append(seq)
            elif seq.status == SequenceStatus.WAITING and startable > 0:
                cands.append(seq)
                startable -= 1
        if not cands or budget <= 0:
            return [], []
        plan = share_prefill_budget([s.num_schedulable for s in cands], budget)
        seqs: list[Sequence] = []
        counts: list[int] = []
        blocked = False  # a sequence could not start: none after it in the queue starts this step
        for seq, n in zip(cands, plan):
            if seq.status == SequenceStatus.WAITING:
                if blocked or not n:
                    continue
                if not self._start(seq):
                    blocked = True
                    continue
            if n:
                seqs.append(seq)
                counts.append(min(n, seq.num_schedulable))  # a reused prefix may have shortened it
        left = budget - sum(counts)
        for i, seq in enumerate(seqs):  # budget of sequences that could not start: to the others, oldest first
            if left <= 0:
                break
            more = min(seq.num_schedulable - counts[i], left)
            counts[i] += more
            left -= more
        return seqs, counts

    def _start(self, seq: Sequence) -> bool:
        """Admit a waiting sequence to prefill with all its pages (onto a reusable pool prefix when it has one);
        False when the pool cannot hold it now."""
        shared = self._reusable_prefix(seq)
        need = self.pages_for(seq, seq.num_tokens) - len(shared)
        free = self.allocator.num_free - self.allocator.num_evictable(shared)
        if need > free:
            return False
        if shared:  # the prefix's KV is in the pool already: hold those pages, compute after them
            self.allocator.share(shared)
            seq.page_table = shared
            seq.num_computed_tokens = len(shared) * self.page_size
            seq.num_shared_pages, seq.shared_pages_reported = len(shared), False
        seq.page_table.extend(self.allocator.allocate(need))
        seq.status = SequenceStatus.PREFILLING
        return True

    def _reusable_prefix(self, seq: Sequence) -> list[int]:
        """Registered pool pages holding the longest prefix of `seq`'s full pages, leaving at least its last token
        to compute; none for a sequence that has pages or computed tokens already (a prompt-cache import)."""
        if not seq.prefix_keys or seq.page_table or seq.num_computed_tokens:
            return []
        return self.allocator.held_prefix(seq.prefix_keys[: (seq.num_tokens - 1) // self.page_size])

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free all pages; the sequence re-prefills prompt + completion later."""
        self.running.remove(seq)
        self.free_pages(seq)
        seq.num_computed_tokens = seq.num_imported_pages = seq.num_shared_pages = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)


def share_prefill_budget(remaining: list[int], budget: int) -> list[int]:
    """Tokens for each prefill candidate (`remaining[i]` uncomputed tokens, in queue order) out of `budget`: the
    oldest (index 0) first gets up to budget / HEAD_SHARE, then candidates by fewest tokens left (the oldest's
    after that share) first, ties in queue order."""
    give = [0] * len(remaining)
    give[0] = min(remaining[0], max(1, budget // HEAD_SHARE))
    left = budget - give[0]
    for i in sorted(range(len(remaining)), key=lambda i: (remaining[i] - give[i], i)):
        if left <= 0:
            break
        n = min(remaining[i] - give[i], left)
        give[i] += n
        left -= n
    return give
