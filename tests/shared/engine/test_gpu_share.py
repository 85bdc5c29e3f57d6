"""pdserve.engine.gpu_share: the prefill's step mark seen through a second mapping of the file (the decode
process's view), its lease, the decode's credit, its waits; and an EngineLoop holding decode steps back while a
mark is up, and marking its own steps (the prefill side)."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from engine_testutil import random_prompt

from pdserve.engine.gpu_share import DecodeYield, GpuShareFlag, YieldCredit
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


def test_credit_is_earned_by_fast_steps_capped_and_spent():
    c = YieldCredit(target_step_ms=10.0, cap_ms=25.0)
    c.earn(6.0)
    assert c.ms == 4.0
    c.earn(12.0)  # a slow step earns nothing (and takes nothing)
    assert c.ms == 4.0
    for _ in range(10):
        c.earn(0.0)
    assert c.ms == 25.0
    c.spend(30.0)
    assert c.ms == 0.0


def test_decode_waits_while_marked_within_its_credit(flags):
    prefill, decode = flags
    y = DecodeYield(decode, YieldCredit(10.0, 100.0))
    assert y.before_step() == 0.0  # no mark: no wait
    prefill.mark()
    assert y.before_step() == 0.0  # no credit yet: no wait
    y.after_step(0.0)
    y.after_step(0.0)  # 20 ms of credit
    t0 = time.perf_counter()
    waited = y.before_step()
    assert 19.0 <= waited <= 19.0 + 15 and (time.perf_counter() - t0) * 1e3 >= 19.0  # the credit, then it steps
    assert y.credit.ms == 0.0 and y.waits == 1
    for _ in range(10):
        y.after_step(0.0)
    threading.Timer(0.015, prefill.clear).start()  # the prefill step ends after 15 ms: the wait ends with it
    waited = y.before_step()
    assert 14.0 <= waited < 60.0 and y.credit.ms > 30.0
    prefill.mark()
    assert y.before_step(interrupted=lambda: True) == 0.0  # a command to run ends the wait at once
    prefill.clear()


def test_engine_loop_holds_decode_steps_back_and_marks_prefill_steps(make_engine, tmp_path):
    """Two loops over one file: the 'prefill' one marks every step; the 'decode' one, with credit, waits while a
    mark is up (here a test's mark), and its requests still finish once the mark clears."""
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    marker = GpuShareFlag(tmp_path / "share")
    dec = EngineLoop(make_engine("llama", num_pages=32))
    dec.share_yield = DecodeYield(GpuShareFlag(tmp_path / "share"), YieldCredit(1000.0, 5000.0))
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
        # 9 prompt tokens, chunks of 8: the first step runs (no credit yet) and earns credit, the second waits
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
