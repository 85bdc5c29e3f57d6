"""Page allocator units, and the pool returning to all-free after finishing/aborting in every state."""

from __future__ import annotations

import pytest
from engine_testutil import random_prompt, run_to_completion

from pdserve.engine.page_table import OutOfPages, PageAllocator
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import SequenceStatus
from pdserve.errors import DuplicateRequest

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_allocator_allocate_free_counts():
    a = PageAllocator(8)
    assert (a.num_free, a.num_used) == (8, 0)
    x = a.allocate(3)
    y = a.allocate(5)
    assert len(set(x) | set(y)) == 8 and set(x) | set(y) == set(range(8))
    assert (a.num_free, a.num_used) == (0, 8)
    a.free(x)
    assert (a.num_free, a.num_used) == (3, 5)
    assert sorted(a.allocate(3)) == sorted(x)
    assert a.allocate(0) == []


def test_allocator_out_of_pages_allocates_nothing():
    a = PageAllocator(4)
    a.allocate(3)
    with pytest.raises(OutOfPages):
        a.allocate(2)
    assert (a.num_free, a.num_used) == (1, 3)


def test_allocator_double_free_and_unknown_ids():
    a = PageAllocator(4)
    x = a.allocate(2)
    a.free(x)
    with pytest.raises(ValueError):
        a.free(x)
    y = a.allocate(2)
    with pytest.raises(ValueError):
        a.free([y[0], y[0]])
    with pytest.raises(ValueError):
        a.free([99])
    assert a.num_used == 2  # failed frees changed nothing
    with pytest.raises(ValueError):
        PageAllocator(0)
    with pytest.raises(ValueError):
        a.allocate(-1)


def test_pool_all_free_after_requests_finish(llama_engine):
    e = llama_engine
    prompts = [random_prompt(n, seed=n) for n in (1, 4, 9, 29)]
    e.generate(prompts, GREEDY)
    assert e.allocator.num_used == 0 and not e.request_ids()


def test_abort_waiting(llama_engine):
    e = llama_engine
    e.add_request(EngineRequest("w", random_prompt(9, 1), GREEDY))
    assert e.abort("w")
    outs = e.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("w", True, "abort")]
    assert e.allocator.num_used == 0 and not e.has_unfinished_requests()
    assert not e.abort("w") and not e.abort("nope")


def test_abort_mid_prefill_and_running(llama_engine):
    e = llama_engine
    e.add_request(EngineRequest("long", random_prompt(29, 2), GREEDY))  # 4 chunks of 8
    e.add_request(EngineRequest("short", random_prompt(3, 3), GREEDY))
    e.step()  # first chunk: 'long' takes the whole budget
    assert e._seqs["long"].status == SequenceStatus.PREFILLING and e.allocator.num_used > 0
    assert e.abort("long")
    for _ in range(3):
        e.step()
    assert e._seqs["short"].status == SequenceStatus.RUNNING
    assert e.abort("short")
    reasons = {o.request_id: o.finish_reason for o in e.step() if o.finished}
    assert reasons == {"short": "abort"}
    assert e.allocator.num_used == 0 and not e.has_unfinished_requests()


def test_abort_and_release_importing(llama_engine):
    e = llama_engine
    e.begin_import("imp", random_prompt(10, 4), GREEDY)
    assert e.allocator.num_used == 3
    assert e.abort("imp")
    assert [o.finish_reason for o in e.step()] == ["abort"]
    e.begin_import("imp2", random_prompt(10, 4), GREEDY)
    assert e.release("imp2") and e.step() == []  # release: no output
    assert e.allocator.num_used == 0


def test_begin_import_out_of_pages_leaks_nothing(make_engine):
    e = make_engine("llama", num_pages=6)
    e.begin_import("a", random_prompt(16, 5), GREEDY)  # 4 pages
    with pytest.raises(OutOfPages):
        e.begin_import("b", random_prompt(16, 6), GREEDY)
    assert e.allocator.num_used == 4 and e.request_ids() == ["a"]
    e.release("a")
    assert e.allocator.num_used == 0


def test_prefill_only_holds_pages_until_release(llama_engine):
    e = llama_engine
    e.add_request(EngineRequest("p", random_prompt(10, 7), GREEDY, prefill_only=True))
    res = run_to_completion(e)
    assert res["p"]["outputs"][-1].finish_reason == "prefill_done"
    assert e.allocator.num_used == 3  # ceil(10 / 4): kept for export
    assert e.abort("p")  # finished already: frees, no output
    assert e.step() == [] and e.allocator.num_used == 0


def test_rejects_bad_requests(llama_engine):
    e = llama_engine
    with pytest.raises(ValueError, match="empty"):
        e.add_request(EngineRequest("x", [], GREEDY))
    with pytest.raises(ValueError, match="vocabulary"):
        e.add_request(EngineRequest("x", [1, 10_000], GREEDY))
    with pytest.raises(ValueError, match="context"):
        e.add_request(EngineRequest("x", [5] * e.max_model_len, GREEDY))
    with pytest.raises(ValueError, match="max_tokens"):
        e.add_request(EngineRequest("x", [5], SamplingParams(max_tokens=0)))
    e.add_request(EngineRequest("x", [5, 6], GREEDY))
    with pytest.raises(DuplicateRequest, match="duplicate"):
        e.add_request(EngineRequest("x", [5, 6], GREEDY))
    e.release("x")
    assert e.allocator.num_used == 0 and not e.has_unfinished_requests()


def test_prompt_larger_than_pool_is_rejected(make_engine):
    e = make_engine("llama", num_pages=4)
    with pytest.raises(OutOfPages, match="pages"):
        e.add_request(EngineRequest("big", random_prompt(40, 8), GREEDY))


def test_scheduler_budgets(make_engine):
    """Prefill steps stay within chunk_size tokens; at most max_num_seqs sequences are admitted at once."""
    e = make_engine("llama", chunk_size=8, max_num_seqs=2)
    for i, n in enumerate((13, 3, 5, 1)):
        e.add_request(EngineRequest(f"r{i}", random_prompt(n, seed=i), GREEDY))
    seen = 0
    while e.has_unfinished_requests():
        batch = e.scheduler.schedule()
        if batch is None:
            break
        assert sum(batch.num_new_tokens) <= 8
        admitted = len(e.scheduler.running) + sum(s.status == SequenceStatus.PREFILLING for s in e.scheduler.waiting)
        assert admitted <= 2
        seen += 1
        e._run(batch, False)
    assert seen > 0 and not e.request_ids() and e.allocator.num_used == 0
