"""pdserve.engine.gpu_share: the prefill's step mark seen through a second mapping of the file (the decode
process's view), its lease, the decode's TPOT room, its waits; and an EngineLoop holding decode steps back while a
mark is up, and marking its own steps (the prefill side)."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from engine_testutil import random_prompt

from pdserve.engine.gpu_share import DecodeYield, GpuShareFlag, TpotRoom
from pdserve.engine.loop import EngineLoop
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams


@pytest.fixture
def flags(tmp_path):
    prefill, decode = GpuShareFlag(tmp_path / "share"), GpuShareFlag(tmp_path / "share")
    yield prefill, decode
    prefill.close()
    decode.close()


def test_a_mark_shows_in_the_other_mapping_until_cleared_or_lapsed(flags):
    prefill, decode = flags
    assert not decode.marked()
    prefill.mark()
    assert decode.marked()
    prefill.clear()
    assert not decode.marked()
    prefill.mark(lease_ns=20_000_000)  # a prefill that died mid-step: its mark lapses by itself
    assert decode.marked()
    time.sleep(0.03)
    assert not decode.marked()


def test_tpot_room_is_the_tightest_choices_slack_should_its_next_token_be_its_last():
    room = TpotRoom(tpot_ms=10.0)
    ms = 1_000_000
    assert room.room_ms(3.0, 0) == float("inf")  # nothing streams: nothing bounds the wait (the cap does)
    room.streamed("a", 0, 1, False, now_ns=0)  # a's first token at 0
    assert room.room_ms(3.0, 4 * ms) == 10.0 - 4.0 - 3.0  # its next token at 4 + w + 3 ms keeps (..) / 1 <= 10
    room.streamed("a", 0, 1, False, now_ns=6 * ms)
    room.streamed("a", 0, 1, False, now_ns=9 * ms)  # 3 tokens, the first 20 ms ago at 20 ms: 30 - 20 - 3
    room.streamed("b", 0, 1, False, now_ns=18 * ms)  # b just started: 10 - 2 - 3, the tightest
    assert room.room_ms(3.0, 20 * ms) == 5.0
    room.streamed("b", 1, 4, False, now_ns=0)  # b's second choice (n > 1) counts on its own: 40 - 20 - 3
    room.streamed("b", 0, 0, True, now_ns=20 * ms)  # b's first choice finished
    assert room.room_ms(3.0, 20 * ms) == 7.0 and len(room) == 2
    room.streamed("a", 0, 1, False, now_ns=60 * ms)  # a fell behind: 40 - 70 - 3 < 0, no wait for anyone
    assert room.room_ms(3.0, 70 * ms) < 0
    room.ended("a")
    room.ended("b")
    assert len(room) == 0 and room.room_ms(3.0, 70 * ms) == float("inf")


def test_decode_waits_while_marked_within_the_tpot_room_and_the_cap(flags):
    prefill, decode = flags
    room = TpotRoom(tpot_ms=50.0)
    y = DecodeYield(decode, room, cap_ms=30.0)
    assert y.before_step() == 0.0  # no mark: no wait
    prefill.mark()
    t0 = time.perf_counter()
    assert 29.0 <= y.before_step() <= 29.0 + 15 and (time.perf_counter() - t0) * 1e3 >= 29.0  # nothing streams: cap
    room.streamed("r", 0, 1, False, time.time_ns())  # 50 ms of room, minus the next step's 35 ms: 15 ms
    y.after_step(35.0)
    waited = y.before_step()
    assert 13.0 <= waited <= 15.0 + 15 and y.waits == 2
    y.after_step(60.0)  # a step longer than the bound leaves no room at all
    assert y.before_step() == 0.0
    y.after_step(1.0)
    room.ended("r")
    threading.Timer(0.015, prefill.clear).start()  # the prefill step ends after 15 ms: the wait ends with it
    assert 14.0 <= y.before_step() < 29.0
    prefill.mark()
    assert y.before_step(interrupted=lambda: True) == 0.0  # a command to run ends the wait at once
    y.after_step(1.0)
    calls = iter([False, False, True])  # a command cuts the first wait short: the second gets what the cap left
    first = y.before_step(interrupted=lambda: next(calls, False))
    second = y.before_step()
    assert first < 5.0 and 29.0 <= first + second <= 29.0 + 15  # the cap bounds the holds before one step
    assert y.before_step() == 0.0
    prefill.clear()


def test_a_decode_held_back_for_good_still_streams_within_its_tpot_bound(make_engine, tmp_path):
    """A mark up for the whole decode (a prefill that computes without end): the decode waits before every step,
    and each request's TPOT still stays at about the bound, not beyond; the room forgets finished requests."""
    bound_ms = 40.0
    marker = GpuShareFlag(tmp_path / "share")
    dec = EngineLoop(make_engine("llama", num_pages=64))
    room = TpotRoom(bound_ms)
    dec.share_yield = DecodeYield(GpuShareFlag(tmp_path / "share"), room, cap_ms=200.0)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    arrivals: dict[str, list[int]] = {"a": [], "b": []}

    def on_output(rid):
        return lambda o: arrivals[rid].extend([time.perf_counter_ns()] * len(o.new_token_ids))

    try:
        marker.mark(lease_ns=20_000_000_000)
        for i, rid in enumerate(arrivals):
            dec.add_request(EngineRequest(rid, random_prompt(7, seed=i), sp), on_output(rid))
        deadline = time.monotonic() + 30
        while any(len(t) < 16 for t in arrivals.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        for rid, t in arrivals.items():
            assert len(t) == 16, rid
            tpot_ms = (t[-1] - t[0]) / 1e6 / 15
            assert 0.6 * bound_ms <= tpot_ms <= 1.25 * bound_ms, (rid, tpot_ms)  # held back, within its bound
        assert dec.call(lambda e: not e.has_unfinished_requests(), timeout=5)
        assert len(room) == 0 and dec.share_yield.waits >= 10
    finally:
        marker.clear()
        dec.stop()
        marker.close()


def test_engine_loop_holds_decode_steps_back_and_marks_prefill_steps(make_engine, tmp_path):
    """Two loops over one file: the 'prefill' one marks every step; the 'decode' one, with a generous TPOT bound,
    waits while a mark is up (here a test's mark), and its requests still finish once the mark clears."""
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    marker = GpuShareFlag(tmp_path / "share")
    dec = EngineLoop(make_engine("llama", num_pages=32))
    dec.share_yield = DecodeYield(GpuShareFlag(tmp_path / "share"), TpotRoom(1000.0), cap_ms=5000.0)
    pre = EngineLoop(make_engine("llama", num_pages=32))
    pre.share_mark = GpuShareFlag(tmp_path / "share")
    seen: list[bool] = []
    real_step = pre.engine.step
    pre.engine.step = lambda: (seen.append(marker.marked()), real_step())[1]
    try:
        q: queue.Queue = queue.Queue()
        pre.add_request(EngineRequest("p", random_prompt(9, seed=1), sp), q.put)
        while not q.get(timeout=30).finished:
            pass
        assert seen and all(seen) and not marker.marked()  # marked during each step, cleared after
        d: queue.Queue = queue.Queue()
        marker.mark(lease_ns=2_000_000_000)
        # nothing streams yet: the wait is the cap's, until a command or the mark's clearing ends it
        dec.add_request(EngineRequest("d", random_prompt(9, seed=2), sp), d.put)
        time.sleep(0.2)
        t0 = time.perf_counter()
        assert dec.call(lambda e: e.has_unfinished_requests(), timeout=5)  # a command runs during the wait
        assert time.perf_counter() - t0 < 0.5 and marker.marked()
        time.sleep(0.05)
        got_while_marked = d.qsize()  # and the wait goes on after it
        marker.clear()
        outs = [d.get(timeout=30)]
        while not outs[-1].finished:
            outs.append(d.get(timeout=30))
        y = dec.share_yield
        assert got_while_marked == 0 and y.waits >= 2 and y.waited_ms >= 200.0, (y.waits, y.waited_ms)
        assert sum(len(o.new_token_ids) for o in outs) == 6
    finally:
        pre.stop()
        dec.stop()
        marker.close()
