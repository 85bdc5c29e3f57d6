"""EngineLoop: engine on a background thread, commands from other threads, per-request callbacks."""

from __future__ import annotations

import queue
import sys
import threading

import pytest
from engine_testutil import layout_for, random_prompt

from pdserve.engine.loop import EngineLoop
from pdserve.engine.page_table import OutOfPages
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.testing.wait import wait_until

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def drain(q: queue.Queue, timeout: float = 20.0) -> list:
    outs = []
    while True:
        o = q.get(timeout=timeout)
        outs.append(o)
        if isinstance(o, BaseException) or o.finished:
            return outs


@pytest.fixture
def loop(make_engine):
    lp = EngineLoop(make_engine("llama", num_pages=32))
    yield lp
    lp.stop()
    assert not lp._thread.is_alive()


def test_generate_through_loop_matches_direct(loop, llama_engine):
    prompts = [random_prompt(n, seed=n) for n in (3, 12)]
    refs = llama_engine.generate(prompts, GREEDY)
    qs = [queue.Queue() for _ in prompts]
    # submit from several threads at once
    ts = [
        threading.Thread(target=loop.add_request, args=(EngineRequest(f"r{i}", p, GREEDY), q.put))
        for i, (p, q) in enumerate(zip(prompts, qs))
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for q, ref in zip(qs, refs):
        outs = drain(q)
        assert [t for o in outs for t in o.new_token_ids] == ref
        assert outs[-1].finish_reason == "length"
    assert (loop.allocator.num_used, loop.allocator.num_pages) == (0, 32)


def test_errors_propagate_to_caller(loop):
    with pytest.raises(ValueError, match="empty"):
        loop.add_request(EngineRequest("bad", [], GREEDY), lambda o: None)
    with pytest.raises(OutOfPages):
        loop.begin_import("big", random_prompt(200, 1), GREEDY, lambda o: None).result(10)  # queued: its Future
    assert loop.call(lambda e: e.request_ids()) == []


def test_abort_admitted_spares_a_request_id_whose_admission_was_refused(loop):
    """A duplicate id's refused admission must not lead to aborting the request that holds the id; an admission the
    engine took (or one still queued) is aborted, after it runs."""
    held = loop.begin_import("twice", random_prompt(8, 3), GREEDY, lambda o: None)
    held.result(10)
    refused = loop.begin_import("twice", random_prompt(8, 4), GREEDY, lambda o: None)
    assert not loop.abort_admitted("twice", refused).result(10)  # queued after the refusal: it sees it
    assert refused.exception() is not None and loop.call(lambda e: e.request_ids()) == ["twice"]
    assert loop.abort_admitted("twice", held).result(10)
    pending = loop.begin_import("later", random_prompt(8, 5), GREEDY, lambda o: None)
    assert loop.abort_admitted("later", pending).result(10)  # submitted before the admission ran: still after it
    assert loop.call(lambda e: e.request_ids()) == [] and loop.allocator.num_used == 0


def test_abort_release_and_idle(loop):
    q: queue.Queue = queue.Queue()
    loop.add_request(
        EngineRequest("a", random_prompt(5, 2), SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)), q.put
    )
    q.get(timeout=20)  # running
    assert loop.abort("a").result(10) is True
    assert drain(q)[-1].finish_reason == "abort"
    # prefill-only request: pages kept after prefill_done until release
    q2: queue.Queue = queue.Queue()
    loop.add_request(EngineRequest("p", random_prompt(9, 3), GREEDY, prefill_only=True), q2.put)
    assert drain(q2)[-1].finish_reason == "prefill_done"
    assert loop.allocator.num_used == 3
    assert loop.release("p").result(10) is True
    assert loop.allocator.num_used == 0
    # idle loop blocks instead of spinning: its thread parks in a wait without a timeout (nothing to poll)
    assert loop.call(lambda e: e.has_unfinished_requests()) is False
    wait_until(lambda: parked_in_wait(loop._thread), timeout=10, what="the idle engine thread blocks")


def parked_in_wait(thread: threading.Thread) -> bool:
    """`thread` is inside threading.Condition.wait(timeout=None): blocked until notified, not polling."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is threading.Condition.wait.__code__:
            return frame.f_locals.get("timeout") is None
        frame = frame.f_back
    return False


def test_import_through_loop(loop, llama_engine):
    prompt = random_prompt(7, 4)
    ref = llama_engine.generate([prompt], GREEDY)[0]
    llama_engine.add_request(EngineRequest("x", prompt, GREEDY, prefill_only=True))
    first, ready = None, []
    while first is None:
        for o in llama_engine.step():
            ready += o.ready_pages
            first = o.new_token_ids[0] if o.finished else None
    layout = layout_for(llama_engine)
    b = llama_engine.export_batch("x", ready, layout)
    llama_engine.release("x")
    q: queue.Queue = queue.Queue()
    loop.begin_import("x", prompt, GREEDY, q.put)
    loop.call(lambda e: e.import_batch("x", b.page_indexes, b.num_tokens, b.rows, layout))
    loop.finish_import("x", first)
    assert [t for o in drain(q) for t in o.new_token_ids] == ref


def test_step_failure_reaches_callbacks(loop):
    q: queue.Queue = queue.Queue()

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    loop.call(lambda e: setattr(e, "_run", boom))
    loop.add_request(EngineRequest("f", random_prompt(4, 5), GREEDY), q.put)
    err = q.get(timeout=20)
    assert isinstance(err, RuntimeError) and "kaboom" in str(err)
    assert loop.call(lambda e: (e.request_ids(), e.allocator.num_used)) == ([], 0)
