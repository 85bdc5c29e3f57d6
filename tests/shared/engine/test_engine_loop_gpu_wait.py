"""EngineLoop's anytime commands: while the engine thread waits for a decode step on the GPU, an imported request's
first token and the end of its import run at once on the caller's thread; anything else, and anything queued behind
a command that must wait, waits for the step. On CPU a launch computes at once, so these hold the step "on the GPU"
with an event the test opens (the runner's `gpu_wait` is what the loop replaces, on CPU and GPU alike)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest
from engine_testutil import layout_for, random_prompt

from pdserve.engine.engine import LLMEngine
from pdserve.engine.loop import EngineLoop
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.testing.wait import wait_until

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BACKGROUND = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


class Gate:
    """Holds decode launches "on the GPU": launch i (from 1) completes once `open(i)` or `set()` was called."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._launched = 0
        self._opened = 0

    def event(self) -> GateEvent:
        with self._cv:
            self._launched += 1
            return GateEvent(self, self._launched)

    def open(self, through: int) -> None:
        with self._cv:
            self._opened = max(self._opened, through)
            self._cv.notify_all()

    def set(self) -> None:
        self.open(1 << 30)

    def is_set(self) -> bool:
        return self._opened >= self._launched

    def wait(self, index: int) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: self._opened >= index, 20), "the test never opened the step"


class GateEvent:
    """Stands in for a step's CUDA event: complete once the test opens its gate this far."""

    def __init__(self, gate: Gate, index: int):
        self.gate, self.index = gate, index

    def synchronize(self) -> None:
        self.gate.wait(self.index)


def hold_steps(loop: EngineLoop, gate: Gate) -> None:
    """From now on every decode launch completes only as `gate` opens (installed on the engine thread)."""

    def install(engine: LLMEngine) -> None:
        launch = engine.runner.launch_decode

        def gated(seqs, positions, prev):
            out = launch(seqs, positions, prev)
            out._done = gate.event()  # type: ignore[assignment]
            return out

        engine.runner.launch_decode = gated  # type: ignore[method-assign]

    loop.call(install)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list]:
    result: list = []
    t = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    t.start()
    return t, result


def exported(engine: LLMEngine, rid: str, prompt: list[int]):
    """Prefill `prompt` on `engine` (the prefill side): its first token and its pages, exported."""
    engine.add_request(EngineRequest(rid, prompt, GREEDY, prefill_only=True))
    first, ready = None, []
    while first is None:
        for o in engine.step():
            ready += o.ready_pages
            first = o.new_token_ids[0] if o.finished else None
    batch = engine.export_batch(rid, ready, layout_for(engine))
    engine.release(rid)
    return first, batch


def tokens(q: queue.Queue) -> list[int]:
    out = []
    while True:
        o = q.get(timeout=20)
        assert not isinstance(o, BaseException), o
        out += o.new_token_ids
        if o.finished:
            return out


@pytest.fixture
def loop(make_engine):
    lp = EngineLoop(make_engine("llama", num_pages=64, overlap_decode="on"))
    yield lp
    lp.stop()


def test_first_token_and_finish_import_do_not_wait_for_the_step(loop, llama_engine):
    bg_prompt, prompt = random_prompt(6, 11), random_prompt(9, 12)
    ref, bg_ref = llama_engine.generate([prompt], GREEDY)[0], llama_engine.generate([bg_prompt], BACKGROUND)[0]
    first, batch = exported(llama_engine, "x", prompt)
    layout = layout_for(llama_engine)

    bg: queue.Queue = queue.Queue()
    loop.add_request(EngineRequest("bg", bg_prompt, BACKGROUND), bg.put)
    q: queue.Queue = queue.Queue()
    loop.begin_import("x", prompt, GREEDY, q.put).result(20)
    loop.call(lambda e: e.import_batch("x", batch.page_indexes, batch.num_tokens, batch.rows, layout))

    gate = Gate()
    hold_steps(loop, gate)
    assert wait_until(lambda: loop._gpu_waiting, timeout=20)
    t, _ = in_thread(lambda: loop.emit_first_token("x", first))
    t.join(10)
    assert not t.is_alive() and not gate.is_set()  # done while the step still computes
    out = q.get(timeout=5)  # dispatched from the caller's thread already
    assert out.new_token_ids == [first] and loop.ran_during_gpu_wait == 1
    t, _ = in_thread(lambda: loop.finish_import("x", first))
    t.join(10)
    assert not t.is_alive() and not gate.is_set() and loop.ran_during_gpu_wait == 2 == loop.anytime_submitted
    gate.set()
    assert [first, *tokens(q)] == ref
    assert tokens(bg) == bg_ref  # the step the commands ran beside is untouched
    assert loop.call(lambda e: e.allocator.num_used) == 0


def test_other_commands_and_those_queued_behind_them_wait_for_the_step(loop, llama_engine):
    prompt = random_prompt(7, 13)
    ref = llama_engine.generate([prompt], GREEDY)[0]
    first, batch = exported(llama_engine, "y", prompt)
    layout = layout_for(llama_engine)
    bg: queue.Queue = queue.Queue()
    loop.add_request(EngineRequest("bg", random_prompt(5, 14), BACKGROUND), bg.put)
    q: queue.Queue = queue.Queue()
    loop.begin_import("y", prompt, GREEDY, q.put).result(20)

    gate = Gate()
    hold_steps(loop, gate)
    assert wait_until(lambda: loop._gpu_waiting, timeout=20)
    order: list[str] = []
    rows = (batch.page_indexes, batch.num_tokens, batch.rows, layout)
    imported = loop.submit(lambda e: (order.append("import"), e.import_batch("y", *rows)))
    t, _ = in_thread(lambda: (loop.emit_first_token("y", first), order.append("first")))
    t.join(0.5)
    assert t.is_alive() and not imported.done()  # a GPU command, and the host-only one queued behind it
    gate.set()
    imported.result(20)
    t.join(20)
    assert order == ["import", "first"]
    loop.finish_import("y", first)
    assert tokens(q) == ref
    tokens(bg)


def test_a_forking_import_ends_between_steps(loop, llama_engine):
    """finish_import of an n > 1 request forks it (a page copy on the device): it waits for the step."""
    prompt = random_prompt(8, 15)
    first, batch = exported(llama_engine, "z", prompt)
    layout = layout_for(llama_engine)
    bg: queue.Queue = queue.Queue()
    loop.add_request(EngineRequest("bg", random_prompt(5, 16), BACKGROUND), bg.put)
    q: queue.Queue = queue.Queue()
    loop.begin_import("z", prompt, GREEDY, q.put, n=2).result(20)
    loop.call(lambda e: e.import_batch("z", batch.page_indexes, batch.num_tokens, batch.rows, layout))
    assert loop.call(lambda e: e.import_forks("z"))

    gate = Gate()
    hold_steps(loop, gate)
    assert wait_until(lambda: loop._gpu_waiting, timeout=20)
    t, _ = in_thread(lambda: loop.finish_import("z", first))
    t.join(0.5)
    assert t.is_alive() and loop.ran_during_gpu_wait == 0 and loop.anytime_submitted == 1
    gate.set()
    t.join(20)
    assert not t.is_alive()
    done = 0
    while done < 2:
        o = q.get(timeout=20)
        done += o.finished
    tokens(bg)


def test_one_queued_while_the_engine_was_busy_runs_as_the_next_step_waits(loop, llama_engine):
    """A first token submitted while the engine thread runs a command (not waiting on the GPU) is queued; it runs
    as soon as the next step's wait begins, not after that step."""
    prompt = random_prompt(6, 17)
    ref = llama_engine.generate([prompt], GREEDY)[0]
    first, batch = exported(llama_engine, "w", prompt)
    layout = layout_for(llama_engine)
    bg: queue.Queue = queue.Queue()
    loop.add_request(EngineRequest("bg", random_prompt(5, 18), BACKGROUND), bg.put)
    q: queue.Queue = queue.Queue()
    loop.begin_import("w", prompt, GREEDY, q.put).result(20)
    loop.call(lambda e: e.import_batch("w", batch.page_indexes, batch.num_tokens, batch.rows, layout))

    gate = Gate()
    hold_steps(loop, gate)
    assert wait_until(lambda: loop._gpu_waiting, timeout=20)
    busy, go = threading.Event(), threading.Event()
    loop.submit(lambda e: (busy.set(), go.wait(20)))
    gate.open(1)  # the held step ends; the engine thread runs the command above
    assert busy.wait(20) and not loop._gpu_waiting
    t, _ = in_thread(lambda: loop.emit_first_token("w", first))
    assert wait_until(lambda: len(loop._cmds) == 1, timeout=10)  # queued: the engine is busy
    go.set()
    t.join(10)
    assert not t.is_alive() and loop.ran_during_gpu_wait == 1 and not gate.is_set()  # the next step still held
    assert q.get(timeout=5).new_token_ids == [first]
    gate.set()
    loop.finish_import("w", first)
    assert [first, *tokens(q)] == ref
    tokens(bg)
