"""Step sizes of the scheduler (scheduler.py): 0 and -1 (auto, until the service resolves it) mean `chunk_size`;
`set_budget` resizes between steps; with room for every decode row beside a full chunk (how a colocated instance
sizes an auto budget) decode rows never shorten a chunk; a step without decode rows may take `idle_chunk_size`."""

from __future__ import annotations

import pytest

from pdserve.engine.page_table import PageAllocator
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence


def make(chunk: int, budget: int) -> Scheduler:
    return Scheduler(PageAllocator(64), page_size=16, chunk_size=chunk, max_num_seqs=64, step_token_budget=budget)


@pytest.mark.parametrize("budget", [0, -1])
def test_unset_or_auto_budget_is_the_chunk_size(budget):
    s = make(512, budget)
    assert s.step_token_budget == 512
    assert [s.prefill_budget(d) for d in (0, 12, 400, 500)] == [512, 500, 128, 128]  # never below a quarter


def test_room_for_every_decode_row_keeps_full_chunks():
    s = make(512, -1)
    s.set_budget(2048, 2048 + 64)
    assert {s.prefill_budget(d) for d in range(65)} == {2048}
    s.set_budget(2048, 2048)  # the decode rows come out of the chunk: 2048 tokens of prompt take two steps
    assert s.prefill_budget(20) == 2028


def test_set_budget_refuses_non_positive_sizes():
    s = make(512, 0)
    with pytest.raises(ValueError, match="must be > 0"):
        s.set_budget(0, 512)
    with pytest.raises(ValueError, match="must be > 0"):
        s.set_budget(512, -1)
    assert (s.chunk_size, s.step_token_budget) == (512, 512)


def test_a_step_without_decode_rows_takes_the_idle_size():
    """Nothing running to stall: the step may prefill up to idle_chunk_size (a colocated instance's largest
    measured step); with decode rows the budget holds again; 0 (the default) changes nothing."""
    s = Scheduler(PageAllocator(512), page_size=16, chunk_size=512, max_num_seqs=64, step_token_budget=-1)
    s.set_budget(512, 512 + 64, 2048)
    assert [s.prefill_budget(d) for d in (0, 1, 64)] == [2048, 512, 512]
    seq = Sequence("long", list(range(3, 2003)), SamplingParams(max_tokens=2))
    s.add(seq)
    batch = s.schedule()
    assert batch is not None and batch.num_decode == 0 and batch.num_new_tokens == [2000]  # one step, not four
    assert batch.prefill_budget == 2048
    s.set_budget(512, 576)
    assert s.idle_chunk_size == 0 and s.prefill_budget(0) == 512
    with pytest.raises(ValueError, match="idle_chunk_size >= 0"):
        s.set_budget(512, 576, -1)


def test_a_chunk_ends_at_the_prefill_stop_and_leaves_its_budget_to_the_others():
    """`prefill_stop` (where a racing prefix fetch starts): the chunk that would cross it ends there; the tokens it
    leaves go to another prompt; once reached, the stop is inert."""
    s = Scheduler(PageAllocator(128), page_size=16, chunk_size=512, max_num_seqs=64)
    long = Sequence("long", list(range(3, 1003)), SamplingParams(max_tokens=2))
    long.prefill_stop = 320
    short = Sequence("short", list(range(3, 303)), SamplingParams(max_tokens=2))
    s.add(long)
    s.add(short)
    batch = s.schedule()
    assert batch is not None and batch.num_new_tokens == [320, 192]  # long stops at 320, short takes the rest
    long.num_computed_tokens, short.num_computed_tokens = 320, 192
    batch = s.schedule()
    assert batch is not None and batch.num_new_tokens == [404, 108]  # past the stop: the whole budget again
