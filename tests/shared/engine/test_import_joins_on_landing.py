"""A decode import whose first token came ahead of its pages (`emit_first_token`) joins the running batch as soon as
its last page lands, with every layer (`import_batch`, or the token itself when the pages were in first), not at
`finish_import`, which the decode service calls only once it read prefill's PrefillDone. That finish_import then only
checks the token, also after the request ended; an abort or release forgets the join. Not for a first token that
ended the request, nor for a forking one (n > 1), which join at finish_import as before."""

from __future__ import annotations

import pytest
from engine_testutil import layout_for, random_prompt, record_launches, run_to_completion

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import SequenceStatus
from pdserve.errors import DuplicateRequest, InvalidRequest
from pdserve.kv.transfer.base import ExportedPages
from pdserve.kv.transfer.layers import LayerStream

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prefill(
    engine: LLMEngine, rid: str, prompt: list[int], sp: SamplingParams, groups: bool = False
) -> tuple[int, list[ExportedPages]]:
    """The prefill side: the first token and the prompt's pages, one batch per page (with `groups`: one per layer of
    each chunk's pages, as a layer-streaming prefill ships them, in shipping order)."""
    layout = layout_for(engine)
    shipped: list[ExportedPages] = []
    stream = LayerStream(layout, 1, shipped.append) if groups else None
    engine.add_request(EngineRequest(rid, prompt, sp, prefill_only=True, layer_stream=stream))
    first = None
    while first is None:
        for o in engine.step():
            first = o.new_token_ids[0] if o.finished else None
    if not groups:
        shipped = [engine.export_batch(rid, [i], layout) for i in range(-(-len(prompt) // engine.page_size))]
    engine.release(rid)
    return first, shipped


def land(engine: LLMEngine, rid: str, batch: ExportedPages) -> None:
    engine.import_batch(rid, batch.page_indexes, batch.num_tokens, batch.rows, layout_for(engine), batch.layers)


def scheduled(engine: LLMEngine, rid: str) -> bool:
    """Whether the request is in the scheduler's queues (joined the batch), not importing."""
    seq = engine._seqs.get(rid)
    if seq is None or seq.status == SequenceStatus.IMPORTING:
        return False
    return seq in engine.scheduler.waiting or seq in engine.scheduler.running


def first_out(engine: LLMEngine, rid: str, token: int) -> None:
    """emit_first_token: the token goes out at once and does not end the request."""
    assert engine.emit_first_token(rid, token) is False
    (out,) = engine.take_pending()
    assert out.request_id == rid and out.new_token_ids == [token] and not out.finished


@pytest.mark.parametrize("n", [3, 9, 19])
def test_pages_landing_after_the_early_token_join_without_finish_import(n, prefill_engine, decode_engine):
    d = decode_engine
    prompt = random_prompt(n, seed=900 + n)
    ref = d.generate([prompt], GREEDY)[0]
    first, pages = prefill(prefill_engine, "a", prompt, GREEDY)
    assert first == ref[0]
    d.begin_import("a", prompt, GREEDY)
    first_out(d, "a", first)
    for p in pages[:-1]:
        land(d, "a", p)
        assert not scheduled(d, "a")
    land(d, "a", pages[-1])
    assert scheduled(d, "a") and d.handoff.joined("a")
    assert run_to_completion(d)["a"]["tokens"] == ref[1:]  # decoded with no finish_import at all
    assert d.allocator.num_used == 0
    with pytest.raises(InvalidRequest, match="differs"):
        d.finish_import("a", (first + 1) % d.model_config.vocab_size)
    d.finish_import("a", first)  # PrefillDone read after the request ended: only checked
    assert not d.handoff.joined("a") and d.take_pending() == [] and d.step() == []
    with pytest.raises(InvalidRequest, match="not importing"):
        d.finish_import("a", first)  # checked once: forgotten after that


def test_an_early_token_after_the_last_page_joins_at_once(prefill_engine, decode_engine):
    d = decode_engine
    prompt = random_prompt(10, seed=31)
    ref = d.generate([prompt], GREEDY)[0]
    first, pages = prefill(prefill_engine, "b", prompt, GREEDY)
    d.begin_import("b", prompt, GREEDY)
    for p in pages:
        land(d, "b", p)
    assert not scheduled(d, "b")  # no first token yet: nothing to decode from
    first_out(d, "b", first)
    assert scheduled(d, "b")
    d.finish_import("b", first)  # before the first step this time: still only a check
    assert d.take_pending() == []
    assert run_to_completion(d)["b"]["tokens"] == ref[1:]
    assert d.allocator.num_used == 0 and not d.handoff.joined("b")


def test_layer_groups_join_when_the_last_group_of_the_last_page_lands(prefill_engine, decode_engine):
    d = decode_engine
    prompt = random_prompt(19, seed=32)  # three chunks of 8, 8 and 3 tokens; two layers each
    ref = d.generate([prompt], GREEDY)[0]
    first, groups = prefill(prefill_engine, "c", prompt, GREEDY, groups=True)
    assert len(groups) == 3 * d.model_config.num_layers and all(g.layers is not None for g in groups)
    d.begin_import("c", prompt, GREEDY)
    first_out(d, "c", first)
    for g in groups[:-1]:
        land(d, "c", g)
        assert not scheduled(d, "c")
    assert groups[-1].layers is not None and groups[-1].layers.stop == d.model_config.num_layers
    land(d, "c", groups[-1])
    assert scheduled(d, "c")
    assert run_to_completion(d)["c"]["tokens"] == ref[1:]
    d.finish_import("c", first)
    assert d.allocator.num_used == 0 and not d.handoff.joined("c")


def test_a_request_that_ends_before_its_finish_import(prefill_engine, decode_engine):
    """max_tokens=2: the step after the landing ends it (pages freed); the finish_import after that is no error. Until
    it comes, the request id stays taken."""
    d = decode_engine
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(7, seed=33)
    ref = d.generate([prompt], sp)[0]
    first, pages = prefill(prefill_engine, "f", prompt, sp)
    d.begin_import("f", prompt, sp)
    first_out(d, "f", first)
    for p in pages:
        land(d, "f", p)
    (out,) = d.step()
    assert out.new_token_ids == ref[1:] and out.finished and out.finish_reason == "length"
    assert "f" not in d.request_ids() and d.allocator.num_used == 0
    assert d.handoff.joined("f")  # its finish_import is still to come
    with pytest.raises(DuplicateRequest):
        d.begin_import("f", prompt, sp)  # the id is in use until then: that finish_import is not the new one's
    d.finish_import("f", first)
    assert not d.handoff.joined("f") and d.take_pending() == [] and not d.has_unfinished_requests()
    d.begin_import("f", prompt, sp)
    d.release("f")
    assert d.allocator.num_used == 0


def test_a_first_token_that_ends_the_request_does_not_join(prefill_engine, decode_engine):
    """max_tokens=1: the early token was the request's last; its finish_import drops it, as before. A request beside it
    whose token did not end it joins on landing."""
    d = decode_engine
    prompt = random_prompt(6, seed=34)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first, pages = prefill(prefill_engine, "e", prompt, one)
    for rid, sp in (("e", one), ("p", GREEDY)):
        d.begin_import(rid, prompt, sp)
    assert d.emit_first_token("e", first) is True
    (out,) = d.take_pending()
    assert out.finished and out.finish_reason == "length"
    first_out(d, "p", first)
    for p in pages:
        land(d, "e", p)
        land(d, "p", p)
    assert not scheduled(d, "e") and not d.handoff.joined("e")
    assert scheduled(d, "p")
    d.finish_import("e", first)
    assert "e" not in d.request_ids()
    d.finish_import("p", first)
    run_to_completion(d)
    assert d.allocator.num_used == 0


@pytest.mark.parametrize("how", ["abort", "release"])
@pytest.mark.parametrize("when", ["decoding", "ended"])
def test_abort_or_release_forgets_the_join(how, when, prefill_engine, decode_engine):
    """The service gives up on a request (its Prefill stream broke before PrefillDone): an abort or release forgets the
    join, whether the request still decodes or ended already; a finish_import after it is refused as for any request
    no longer importing."""
    d = decode_engine
    sp = SamplingParams(max_tokens=2 if when == "ended" else 8, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(9, seed=35)
    first, pages = prefill(prefill_engine, "g", prompt, sp)
    d.begin_import("g", prompt, sp)
    first_out(d, "g", first)
    for p in pages:
        land(d, "g", p)
    assert scheduled(d, "g")
    (out,) = d.step()
    assert out.finished == (when == "ended")
    assert getattr(d, how)("g") == (when == "decoding")  # an ended request is unknown to them
    assert not d.handoff.joined("g")
    outs = d.take_pending()
    if how == "abort" and when == "decoding":
        assert [(o.request_id, o.finish_reason) for o in outs] == [("g", "abort")]
    else:
        assert outs == []
    with pytest.raises(InvalidRequest, match="not importing"):
        d.finish_import("g", first)
    assert d.allocator.num_used == 0 and not d.has_unfinished_requests()


def test_a_forking_request_joins_at_finish_import(prefill_engine, make_engine):
    """n = 2: the forks sample their own first tokens; with every page in it keeps importing until finish_import
    forks it (the handoff does not join it either when given a first token), while a plain request beside it joins
    on landing."""
    d = make_engine("llama", num_pages=64)
    prompt = random_prompt(9, seed=36)
    first, pages = prefill(prefill_engine, "x", prompt, GREEDY)
    d.begin_import("f", prompt, GREEDY, n=2)
    d.begin_import("h", prompt, GREEDY, n=2)
    d.begin_import("p", prompt, GREEDY)
    with pytest.raises(InvalidRequest, match="forks"):
        d.emit_first_token("f", first)
    d.handoff.emit_first_token("h", first)  # past the engine's refusal: the handoff's own check
    d.take_pending()
    first_out(d, "p", first)
    for p in pages:
        for rid in ("f", "h", "p"):
            land(d, rid, p)
    assert not scheduled(d, "f") and not scheduled(d, "h") and scheduled(d, "p")
    assert not d.handoff.joined("f") and not d.handoff.joined("h")
    d.abort("h")
    d.finish_import("f", first)  # forks: both choices queued
    d.finish_import("p", first)
    out = run_to_completion(d)
    assert {o.index for o in out["f"]["outputs"] if o.finished} == {0, 1}
    assert out["p"]["tokens"] == prefill_engine.generate([prompt], GREEDY)[0][1:]
    assert d.allocator.num_used == 0


def test_a_join_holds_back_the_chained_step(make_engine):
    """overlap_decode: a request that joins (here at its first token, as during a step's GPU wait) while a chained
    step is in flight is taken by the next launch, not left out of a chained one."""
    prefill_side = make_engine()
    prompt, bg_prompt = random_prompt(11, seed=37), random_prompt(5, seed=38)
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    bg_sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = prefill_side.generate([prompt], sp)[0]
    first, pages = prefill(prefill_side, "x", prompt, sp)
    eng = make_engine(overlap_decode="on")
    rows = record_launches(eng)  # (chained, rows) of each launch
    eng.add_request(EngineRequest("bg", bg_prompt, bg_sp))
    got: list[int] = []

    def step() -> None:
        for o in eng.step():
            if o.request_id == "x":
                got.extend(o.new_token_ids)

    for _ in range(4):
        step()
    eng.begin_import("x", prompt, sp)
    for p in pages:
        land(eng, "x", p)
    step()  # the landing holds one chain back (`take_landed`)
    step()
    assert rows[-1] == (False, 1) and eng._inflight is not None  # bg alone, in flight
    n = len(rows)
    assert eng.emit_first_token("x", first) is False  # joins while that step computes
    step()  # its tokens (no chained launch: x waits to be scheduled)
    step()
    assert rows[n:] == [(False, 2)]  # x rides the very next launch
    assert got == [first]
    while eng.has_unfinished_requests():
        step()
    eng.finish_import("x", first)
    assert got == want and eng.allocator.num_used == 0
