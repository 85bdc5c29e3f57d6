"""EngineLoop: one background thread owns an LLMEngine; other threads talk to it through a command queue.

- Commands (`submit(fn)`, and the wrappers below) run on the engine thread between steps, in order.
- Per-request callbacks receive each StepOutput of their request from whoever has the engine: the engine thread,
  or an anytime command's thread (below). Keep them short; they may call engine methods directly, e.g.
  `engine.export_batch`. A callback is dropped after its request's final output (`StepOutput.request_done`: with
  n > 1, the last choice's). If a step raises, every live request is aborted and its callback receives the
  exception instead of a StepOutput.
- Idle means blocked on a condition variable: no busy-spinning, also when work exists but cannot be scheduled
  (e.g. waiting for pages that another request holds) until the next command arrives.
- Host-only commands (`anytime`: an import's page reservation, its first token, its end) need not wait for the
  step: while the engine thread waits for a decode step's tokens on the GPU (`ModelRunner.gpu_wait`) it holds
  nothing, and such a command runs at once on its caller's thread, under the loop's lock (the engine thread takes
  that lock before it touches the engine again), its outputs dispatched from there. Commands still run in the
  order they were submitted: one runs early only when nothing is queued before it, except an `overtakes` one
  (an imported request's first token): it depends on nothing that may be queued (the pages still importing, other
  requests' commands), so it runs at the step's GPU wait ahead of them, and the token leaves within the step
  instead of after it (a request's layer-group imports arrive just before its first token); between steps it
  likewise runs ahead of the commands queued before it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pdserve.engine.engine import LLMEngine, StepOutput
from pdserve.engine.gpu_share import DecodeYield, GpuShareFlag
from pdserve.engine.model_runner import synchronize
from pdserve.engine.page_table import PageAllocator
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams

log = logging.getLogger("pdserve.engine")
T = TypeVar("T")
OutputCallback = Callable[[StepOutput | BaseException], None]
# whether a command may run while a step computes on the GPU (it touches host state only); None: between steps
Anytime = Callable[[LLMEngine], bool] | None
# (fn, its future, anytime, overtakes: may run at a GPU wait ahead of the commands queued before it)
Command = tuple[Callable[[LLMEngine], Any], Future, Anytime, bool]


def _always(engine: LLMEngine) -> bool:
    return True


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str = "engine-loop"):
        self.engine = engine
        self._cv = threading.Condition()
        self._cmds: deque[Command] = deque()
        self._callbacks: dict[str, OutputCallback] = {}  # whoever has the engine: its thread, or an anytime command
        self._stopping = False
        self._gpu_waiting = False  # under _cv: the engine thread waits on the GPU and has let go of the engine
        self._idle = False  # under _cv: the engine thread waits for work between steps (in _cv.wait)
        self._ran_idle = False  # under _cv: an anytime command ran on its caller's thread while idle: step again
        self.anytime_submitted = 0  # anytime commands submitted, under _cv (metrics: pdserve.telemetry.metrics)
        self.ran_during_gpu_wait = 0  # ... of which ran while a step computed on the GPU, not after it
        self.ran_while_idle = 0  # ... of which ran at once on their callers' threads, the engine thread idle
        engine.runner.gpu_wait = self._gpu_wait
        self.step_started_ns = 0  # epoch ns when the current/last step began (callbacks: their step's start)
        # called on the engine thread after each step with (engine, start ns, end ns), before its outputs go out
        self.step_listener: Callable[[LLMEngine, int, int], None] | None = None
        # a GPU shared with another engine's process (pdserve.engine.gpu_share): a prefill marks its steps, a
        # decode holds its steps back while they run
        self.share_mark: GpuShareFlag | None = None
        self.share_yield: DecodeYield | None = None
        self.share_marks = 0  # steps marked through share_mark (logged at stop)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- generic ---------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[LLMEngine], T], anytime: Anytime = None, overtakes: bool = False) -> Future:
        """Run `fn(engine)` on the engine thread before the next step; the Future holds its result. With `anytime`
        (a check of the engine, e.g. that the request does not fork), `fn` touches host state only and may run as
        soon as the engine thread waits on the GPU: at once on this thread if it waits now, on the GPU or for work,
        and nothing is queued (with `overtakes`, whatever is queued: the caller vouches that `fn` depends on none of
        it). Run at once, it spares the caller two thread switches (an idle decode's first token: its way out)."""
        fut: Future = Future()
        overtakes = overtakes and anytime is not None
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine loop is stopped")
            self.anytime_submitted += anytime is not None
            now = self._gpu_waiting or self._idle
            if anytime is not None and now and (overtakes or not self._cmds) and anytime(self.engine):
                self._run_now(fn, fut)
                if self._idle:  # what it changed may let a step schedule: the engine thread looks again
                    self._ran_idle = True
                    self._cv.notify()
                return fut
            self._cmds.append((fn, fut, anytime, overtakes))
            self._cv.notify()
        return fut

    def call(
        self,
        fn: Callable[[LLMEngine], T],
        timeout: float | None = None,
        anytime: Anytime = None,
        overtakes: bool = False,
    ) -> T:
        """`submit` and wait: exceptions raised by `fn` are re-raised here."""
        return self.submit(fn, anytime, overtakes).result(timeout)

    # ---- requests (block until the engine thread has applied them; errors propagate) ----------------------
    def add_request(self, request: EngineRequest, callback: OutputCallback) -> None:
        """`LLMEngine.add_request`; `callback` gets the request's outputs."""
        self.submit_request(request, callback).result()

    def submit_request(self, request: EngineRequest, callback: OutputCallback) -> Future:
        """`add_request` without the wait: the Future holds the engine's answer (None, or its refusal)."""

        def fn(engine: LLMEngine) -> None:
            engine.add_request(request)
            self._callbacks[request.request_id] = callback

        return self.submit(fn)

    def begin_import(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        callback: OutputCallback,
        resumed_tokens: int = 0,
        resumed_text_chars: int = 0,
        n: int = 1,
        best_of: int = 0,
    ) -> Future:
        """`LLMEngine.begin_import`, queued: the Future holds its outcome (calls submitted after it, e.g. the
        request's imports, run after it). Host-only (checks, page reservation), so it also runs while a step computes
        on the GPU, unless it compiles a grammar (structured output: may take long, the engine thread would wait
        for it) or replays a failover resume."""

        def fn(engine: LLMEngine) -> None:
            engine.begin_import(request_id, prompt_token_ids, sampling, resumed_tokens, resumed_text_chars, n, best_of)
            self._callbacks[request_id] = callback

        quick = sampling.structured is None and not resumed_tokens
        return self.submit(fn, anytime=_always if quick else None)

    def emit_first_token(self, request_id: str, first_token_id: int) -> bool:
        """`LLMEngine.emit_first_token`: its output reaches the callback right after (before any step; while a
        step computes on the GPU, from this thread, ahead of queued commands: the token needs none of the request's
        pages, which keep importing, and its begin_import returned before prefill could send it)."""
        return self.call(lambda e: e.emit_first_token(request_id, first_token_id), anytime=_always, overtakes=True)

    def finish_import(self, request_id: str, first_token_id: int) -> None:
        """`LLMEngine.finish_import`; while a step computes, unless the request forks (which copies pages)."""
        host_only = lambda e: not e.import_forks(request_id)  # noqa: E731
        self.call(lambda e: e.finish_import(request_id, first_token_id), anytime=host_only)

    def abort(self, request_id: str) -> Future:
        """Abort (asynchronously); the callback gets a final "abort" output if the request had not finished."""
        return self.submit(lambda e: e.abort(request_id))

    def abort_admitted(self, request_id: str, admitted: Future) -> Future:
        """`abort`, unless `admitted` (the request's admission, submitted before this) was refused: the id of a
        refused request (a duplicate) may be another caller's. Queued after the admission, so it is decided here."""

        def fn(engine: LLMEngine) -> bool:
            refused = admitted.cancelled() or (admitted.done() and admitted.exception() is not None)
            return False if refused else engine.abort(request_id)

        return self.submit(fn)

    def release(self, request_id: str) -> Future:
        """Free the request's pages (asynchronously); its callback is dropped without further output."""

        def fn(engine: LLMEngine) -> bool:
            self._callbacks.pop(request_id, None)
            if self.share_yield is not None:
                self.share_yield.room.ended(request_id)
            return engine.release(request_id)

        return self.submit(fn)

    @property
    def allocator(self) -> PageAllocator:
        """The engine's page allocator, for reading `num_used` / `num_pages` from any thread without a round trip
        (so possibly one step stale). Never allocate or free through it."""
        return self.engine.allocator

    def stop(self, timeout: float | None = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        if self.anytime_submitted:
            what = "host-only commands (import reservations, first tokens, ends) ran while a step computed on the GPU"
            log.info("%s: %d of %d %s", self._thread.name, self.ran_during_gpu_wait, self.anytime_submitted, what)
            log.info("%s: %d ran at once, the engine thread idle", self._thread.name, self.ran_while_idle)
        if self.share_mark is not None:
            log.info("%s: marked %d steps for a decode sharing the GPU", self._thread.name, self.share_marks)
        if self.share_yield is not None:
            y = self.share_yield
            what = "held steps back for the GPU's prefill"
            log.info("%s: %s %d times, %.0f ms", self._thread.name, what, y.waits, y.waited_ms)

    # ---- engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        self.engine.runner.bind_thread()  # its GPU is this thread's current CUDA device (Triton, graphs)
        blocked = False  # last step scheduled nothing: wait for a command before stepping again
        while True:
            with self._cv:
                while (
                    not self._stopping
                    and not self._cmds
                    and not self._ran_idle
                    and (blocked or not self.engine.has_unfinished_requests())
                ):
                    self._idle = True  # anytime commands run on their callers' threads meanwhile (`submit`)
                    try:
                        self._cv.wait()
                    finally:
                        self._idle = False
                self._ran_idle = False
                if self._stopping:
                    cmds = list(self._cmds)
                    self._cmds.clear()
                    for _, fut, _, _ in cmds:
                        fut.cancel()
                    return
                cmds = list(self._cmds)
                self._cmds.clear()
            self._apply_commands(cmds)
            blocked = False
            for o in self.engine.take_pending():  # e.g. an imported request's first token: stream it now
                self._dispatch(o)
            if self.engine.has_unfinished_requests():
                if self.share_yield is not None:  # a command arriving meanwhile ends the wait, and runs first
                    waited = self.share_yield.before_step(lambda: bool(self._cmds) or self._stopping)
                    if waited and (self._cmds or self._stopping):
                        continue  # (bounded: each wait spends credit that only steps earn)
                try:
                    self.step_started_ns = time.time_ns()
                    if self.share_mark is not None:
                        self.share_mark.mark()
                        self.share_marks += 1
                    try:
                        outputs = self.engine.step()
                    finally:
                        if self.share_mark is not None:
                            self.share_mark.clear()
                    ended_ns = time.time_ns()
                    if self.share_yield is not None:
                        self.share_yield.after_step((ended_ns - self.step_started_ns) / 1e6)
                    if self.step_listener is not None:
                        self.step_listener(self.engine, self.step_started_ns, ended_ns)
                except Exception as e:
                    log.exception("engine step failed; aborting %d requests", len(self._callbacks))
                    self._fail_all(e)
                    continue
                blocked = not outputs and not self.engine.last_step_scheduled
                for o in outputs:
                    self._dispatch(o)

    def _apply_commands(self, cmds: list[Command]) -> None:
        """Engine thread, between steps: the commands taken from the queue, in order, except that an overtaking one
        (an imported request's first token) runs first, its outputs dispatched at once: one in `cmds`, or one
        submitted while they run (before the next of them, or the step after them). It depends on none of them
        (`submit`); a first token that arrives with its request's last layer-group import queued would otherwise
        leave after that import."""
        pending = deque([c for c in cmds if c[3]] + [c for c in cmds if not c[3]])
        while True:
            with self._cv:
                late = [c for c in self._cmds if c[3]]
                for c in late:
                    self._cmds.remove(c)
            batch = [*late, pending.popleft()] if pending else late
            if not batch:
                return
            for fn, fut, _, overtakes in batch:
                self._apply(fn, fut)
                if overtakes:
                    for o in self.engine.take_pending():
                        self._dispatch(o)

    def _apply(self, fn: Callable[[LLMEngine], Any], fut: Future) -> None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:
                fut.set_exception(e)

    def _run_now(self, fn: Callable[[LLMEngine], Any], fut: Future) -> None:
        """An anytime command while the engine thread waits, on the GPU or for work (caller holds _cv), and its
        outputs."""
        self._apply(fn, fut)
        if self._idle:
            self.ran_while_idle += 1
        else:
            self.ran_during_gpu_wait += 1
        for o in self.engine.take_pending():  # only anytime commands add outputs while a step computes
            self._dispatch(o)

    def _gpu_wait(self, event: Any) -> None:
        """The runner's `gpu_wait` (engine thread, inside a step): run the queued anytime commands at the head of the
        queue and the overtaking ones anywhere in it, then let go of the engine until `event` completes; anytime
        commands submitted meanwhile run at once on their callers' threads."""
        with self._cv:
            while self._cmds and (anytime := self._cmds[0][2]) is not None and anytime(self.engine):
                fn, fut, _, _ = self._cmds.popleft()
                self._run_now(fn, fut)
            for cmd in [c for c in self._cmds if c[3]]:
                anytime = cmd[2]
                if anytime is not None and anytime(self.engine):
                    self._cmds.remove(cmd)
                    self._run_now(cmd[0], cmd[1])
            self._gpu_waiting = True
        try:
            synchronize(event)
        finally:
            with self._cv:  # waits for an anytime command running now
                self._gpu_waiting = False

    def _dispatch(self, out: StepOutput | BaseException, request_id: str | None = None) -> None:
        if request_id is not None:
            rid = request_id
        else:
            assert isinstance(out, StepOutput), "an error is dispatched with the request id it fails"
            rid = out.request_id
        cb = self._callbacks.get(rid)
        if cb is None:
            return
        done = isinstance(out, BaseException) or out.request_done  # n > 1: after the last choice's
        if done:
            del self._callbacks[rid]
        if self.share_yield is not None:  # each request's TPOT so far: how long the decode may hold its steps back
            room = self.share_yield.room
            if done:
                room.ended(rid)
            elif isinstance(out, StepOutput):
                room.streamed(rid, out.index, len(out.new_token_ids), out.finished, time.time_ns())
        try:
            cb(out)
        except Exception:
            log.exception("output callback for %s failed", rid)

    def _fail_all(self, err: BaseException) -> None:
        for rid in self.engine.request_ids():
            self.engine.release(rid)
        for rid in list(self._callbacks):
            self._dispatch(err, rid)
