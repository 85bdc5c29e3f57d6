"""EngineLoop's anytime commands: while the engine thread waits for a decode step on the GPU, an imported request's
first token and the end of its import run at once on the caller's thread; anything else, and anything queued behind
a command that must wait, waits for the step. On CPU a launch computes at once, so these hold the step "on the GPU"
with an event the test opens (the runner's `gpu_wait` is what the loop replaces, on CPU and GPU alike)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from engine_testutil import layout_for, prefill_and_export, queued_tokens, random_prompt

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


@dataclass
class Import:
    """A request imported into the loop's engine beside a decoding one ("bg"): its reference tokens, the first
    token and pages prefill produced, the queues of both."""

    rid: str
    ref: list[int]
    first: int
    rows: tuple  # import_batch's (page_indexes, num_tokens, rows, layout)
    q: queue.Queue
    bg: queue.Queue

    def import_pages(self, loop: EngineLoop) -> None:
        loop.call(lambda e: e.import_batch(self.rid, *self.rows))


def start_import(loop: EngineLoop, prefill: LLMEngine, rid: str, seed: int, n: int = 1, pages: bool = True) -> Import:
    """Start "bg" decoding, prefill a prompt on `prefill` and begin its import (`n` choices); with `pages`, its
    pages imported too (the request then waits only for its first token and the end of its import)."""
    prompt = random_prompt(6 + seed % 4, seed)
    ref = prefill.generate([prompt], GREEDY)[0]
    first, batch = prefill_and_export(prefill, rid, prompt, GREEDY)
    bg: queue.Queue = queue.Queue()
    loop.add_request(EngineRequest("bg", random_prompt(5, seed + 1), BACKGROUND), bg.put)
    q: queue.Queue = queue.Queue()
    loop.begin_import(rid, prompt, GREEDY, q.put, n=n).result(20)
    imp = Import(rid, ref, first, (batch.page_indexes, batch.num_tokens, batch.rows, layout_for(prefill)), q, bg)
    if pages:
        imp.import_pages(loop)
    return imp


@pytest.fixture
def loop(make_engine):
    lp = EngineLoop(make_engine("llama", num_pages=64, overlap_decode="on"))
    yield lp
    lp.stop()


def test_first_token_and_finish_import_do_not_wait_for_the_step(loop, llama_engine):
    bg_ref = llama_engine.generate([random_prompt(5, 12)], BACKGROUND)[0]
    x = start_import(loop, llama_engine, "x", 11)
    gate = Gate()
    hold_steps(loop, gate)
    assert wait_until(lambda: loop._gpu_waiting, timeout=20)
    before = loop.anytime_submitted  # its begin_import (between steps: no step was held yet)
    t, _ = in_thread(lambda: loop.emit_first_token("x", x.first))
    t.join(10)
    assert not t.is_alive() and not gate.is_set()  # done while the step still computes
    out = x.q.get(timeout=5)  # dispatched from the caller's thread already
    assert out.new_token_ids == [x.first] and loop.ran_during_gpu_wait == 1
    t, _ = in_thread(lambda: loop.finish_import("x", x.first))
    t.join(10)
    assert not t.is_alive() and not gate.is_set() and loop.ran_during_gpu_wait == 2 == loop.anytime_submitted - before
    gate.set()
    assert [x.first, *queued_tokens(x.q)] == x.ref
    assert queued_tokens(x.bg) == bg_ref  # the step the commands ran beside is untouched
    assert loop.call(lambda e: e.allocator.num_used) == 0


def held_step_with_import_queued(loop: EngineLoop, prefill: LLMEngine, rid: str, seed: int):
    """An import begun (pages not yet in) while a step is held on the GPU, its pages' import queued behind the step:
    (the Import, the gate, the order list the import appends "import" to, the import's Future)."""
    imp = start_import(loop, prefill, rid, seed, pages=False)
    gate = Gate()
    hold_steps(loop, gate)
    assert wait_until(lambda: loop._gpu_waiting, timeout=20)
    order: list[str] = []
    imported = loop.submit(lambda e: (order.append("import"), e.import_batch(rid, *imp.rows)))
    return imp, gate, order, imported


def busy_between_steps(loop: EngineLoop, gate: Gate, go: threading.Event) -> None:
    """A step held on `gate`, then the engine thread busy between steps (a command that waits for `go`)."""
    hold_steps(loop, gate)
    assert wait_until(lambda: loop._gpu_waiting, timeout=20)
    busy = threading.Event()
    loop.submit(lambda e: (busy.set(), go.wait(20)))
    gate.open(1)  # the held step ends; the engine thread runs the command above
    assert busy.wait(20) and not loop._gpu_waiting


def overtook(loop: EngineLoop, imp: Import, gate: Gate, order: list[str], imported) -> None:
    """The first token went out while the import queued before it still waits for the held step; then the import,
    and the request decodes its reference tokens."""
    assert not imported.done() and imp.q.get(timeout=5).new_token_ids == [imp.first]
    gate.set()
    imported.result(20)
    assert order == ["first", "import"]
    loop.finish_import(imp.rid, imp.first)
    assert [imp.first, *queued_tokens(imp.q)] == imp.ref
    queued_tokens(imp.bg)
    assert loop.call(lambda e: e.allocator.num_used) == 0


def test_other_commands_and_those_queued_behind_them_wait_for_the_step(loop, llama_engine):
    y, gate, order, imported = held_step_with_import_queued(loop, llama_engine, "y", 13)
    t, _ = in_thread(lambda: (loop.finish_import("y", y.first), order.append("finish")))
    t.join(0.5)
    assert t.is_alive() and not imported.done()  # a GPU command, and the host-only one queued behind it
    gate.set()
    imported.result(20)
    t.join(20)
    assert order == ["import", "finish"]
    assert queued_tokens(y.q) == y.ref
    queued_tokens(y.bg)


def test_a_first_token_overtakes_the_commands_queued_before_it(loop, llama_engine):
    """The first token needs none of its request's pages (they keep importing): it leaves while the step computes,
    ahead of an import queued before it, and the request still decodes its reference tokens."""
    v, gate, order, imported = held_step_with_import_queued(loop, llama_engine, "v", 19)
    t, _ = in_thread(lambda: (loop.emit_first_token("v", v.first), order.append("first")))
    t.join(10)
    assert not t.is_alive() and not gate.is_set()
    overtook(loop, v, gate, order, imported)


def test_a_first_token_queued_behind_commands_runs_before_the_next_step(loop, llama_engine):
    """Submitted while the engine thread is busy between steps, behind an import: it runs as soon as the busy command
    ended, ahead of that import (which waits for the next step) and before that step."""
    u = start_import(loop, llama_engine, "u", 21, pages=False)
    gate, go = Gate(), threading.Event()
    busy_between_steps(loop, gate, go)
    order: list[str] = []
    imported = loop.submit(lambda e: (order.append("import"), e.import_batch("u", *u.rows)))
    t, _ = in_thread(lambda: (loop.emit_first_token("u", u.first), order.append("first")))
    assert wait_until(lambda: len(loop._cmds) == 2, timeout=10)  # both queued: the engine is busy
    go.set()  # the first token runs at once; the import comes after the next step, which waits on the gate
    t.join(20)
    assert not t.is_alive() and loop.ran_during_gpu_wait == 0  # out between the steps
    overtook(loop, u, gate, order, imported)


def test_a_forking_import_ends_between_steps(loop, llama_engine):
    """finish_import of an n > 1 request forks it (a page copy on the device): it waits for the step."""
    z = start_import(loop, llama_engine, "z", 15, n=2)
    assert loop.call(lambda e: e.import_forks("z"))
    gate = Gate()
    hold_steps(loop, gate)
    assert wait_until(lambda: loop._gpu_waiting, timeout=20)
    t, _ = in_thread(lambda: loop.finish_import("z", z.first))
    t.join(0.5)
    assert t.is_alive() and loop.ran_during_gpu_wait == 0
    gate.set()
    t.join(20)
    assert not t.is_alive()
    done = 0
    while done < 2:
        done += z.q.get(timeout=20).finished
    queued_tokens(z.bg)


def test_one_queued_while_the_engine_was_busy_runs_right_after_that_command(loop, llama_engine):
    """A first token submitted while the engine thread runs a command (not waiting on the GPU) is queued; it runs
    as soon as that command ended, before the next step (not at that step's wait, nor after it)."""
    w = start_import(loop, llama_engine, "w", 17)
    gate, go = Gate(), threading.Event()
    busy_between_steps(loop, gate, go)
    t, _ = in_thread(lambda: loop.emit_first_token("w", w.first))
    assert wait_until(lambda: len(loop._cmds) == 1, timeout=10)  # queued: the engine is busy
    go.set()
    t.join(10)
    assert not t.is_alive() and loop.ran_during_gpu_wait == 0 and not gate.is_set()  # the next step still held
    assert w.q.get(timeout=5).new_token_ids == [w.first]
    gate.set()
    loop.finish_import("w", w.first)
    assert [w.first, *queued_tokens(w.q)] == w.ref
    queued_tokens(w.bg)


def test_a_page_reservation_runs_beside_the_step_unless_it_compiles_or_resumes(loop, llama_engine):
    """begin_import (checks and pages: host-only) completes while a step is held; a failover resume's (its tokens
    replayed) waits for the step, as a structured output's grammar compile would."""
    bg: queue.Queue = queue.Queue()
    loop.add_request(EngineRequest("bg", random_prompt(5, 19), BACKGROUND), bg.put)
    gate = Gate()
    hold_steps(loop, gate)
    assert wait_until(lambda: loop._gpu_waiting, timeout=20)
    q: queue.Queue = queue.Queue()
    plain = loop.begin_import("p", random_prompt(9, 20), GREEDY, q.put)
    plain.result(10)
    assert not gate.is_set() and loop.ran_during_gpu_wait == 1
    assert loop.allocator.num_used > 0  # its pages reserved while the step computes
    resumed = loop.begin_import("r", random_prompt(9, 21), GREEDY, q.put, resumed_tokens=2)
    with pytest.raises(TimeoutError):
        resumed.result(0.5)
    gate.set()
    resumed.result(20)
    loop.release("p").result(20)
    loop.release("r").result(20)
    queued_tokens(bg)


def test_an_idle_engine_runs_them_on_the_callers_thread_and_then_steps(loop, llama_engine):
    """Nothing decoding: the engine thread waits for work, so the import's reservation, first token and end run at
    once on their callers' threads (the first token's output dispatched from there). The first token, its pages in,
    joins the request and wakes the engine thread, which decodes the reference tokens; the end (PrefillDone read
    late) then only checks the token."""
    assert wait_until(lambda: loop._idle, timeout=20)
    prompt = random_prompt(9, 23)
    ref = llama_engine.generate([prompt], GREEDY)[0]
    first, batch = prefill_and_export(llama_engine, "i", prompt, GREEDY)
    q: queue.Queue = queue.Queue()
    where: list[int] = []
    loop.begin_import("i", prompt, GREEDY, lambda o: (where.append(threading.get_ident()), q.put(o))).result(20)
    assert loop.ran_while_idle == 1
    loop.call(lambda e: e.import_batch("i", batch.page_indexes, batch.num_tokens, batch.rows, layout_for(llama_engine)))
    assert wait_until(lambda: loop._idle, timeout=20)
    t, caller = in_thread(lambda: (loop.emit_first_token("i", first), threading.get_ident())[1])
    t.join(10)
    assert not t.is_alive() and loop.ran_while_idle == 2 and loop.ran_during_gpu_wait == 0
    assert where[0] == caller[0]  # the output went out on the caller's thread, not the engine's
    assert q.get(timeout=5).new_token_ids == [first]
    assert [first, *queued_tokens(q)] == ref  # the engine thread woke to decode it
    assert wait_until(lambda: loop._idle, timeout=20)
    loop.finish_import("i", first)
    assert loop.ran_while_idle == 3
    assert loop.call(lambda e: (e.allocator.num_used, e.handoff.joined("i"))) == (0, False)
