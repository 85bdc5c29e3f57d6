"""EngineLoop: one background thread owns an LLMEngine; other threads talk to it through a command queue.

- Commands (`submit(fn)`, and the wrappers below) run on the engine thread between steps, in order.
- Per-request callbacks receive each StepOutput of their request on the engine thread (keep them short; they
  may call engine methods directly, e.g. `engine.export_batch`, since they run on the engine thread). A callback is
  dropped after its request's final output (`StepOutput.request_done`: with n > 1, the last choice's). If a step
  raises, every live request is aborted and its callback
  receives the exception instead of a StepOutput.
- Idle means blocked on a condition variable: no busy-spinning, also when work exists but cannot be scheduled
  (e.g. waiting for pages that another request holds) until the next command arrives.
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
from pdserve.engine.page_table import PageAllocator
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams

log = logging.getLogger("pdserve.engine")
T = TypeVar("T")
OutputCallback = Callable[[StepOutput | BaseException], None]


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str = "engine-loop"):
        self.engine = engine
        self._cv = threading.Condition()
        self._cmds: deque[tuple[Callable[[LLMEngine], Any], Future]] = deque()
        self._callbacks: dict[str, OutputCallback] = {}  # engine thread only
        self._stopping = False
        self.step_started_ns = 0  # epoch ns when the current/last step began (callbacks: their step's start)
        # called on the engine thread after each step with (engine, start ns, end ns), before its outputs go out
        self.step_listener: Callable[[LLMEngine, int, int], None] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- generic ---------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[LLMEngine], T]) -> Future:
        """Run `fn(engine)` on the engine thread before the next step; the Future holds its result."""
        fut: Future = Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine loop is stopped")
            self._cmds.append((fn, fut))
            self._cv.notify()
        return fut

    def call(self, fn: Callable[[LLMEngine], T], timeout: float | None = None) -> T:
        """`submit` and wait: exceptions raised by `fn` are re-raised here."""
        return self.submit(fn).result(timeout)

    # ---- requests (block until the engine thread has applied them; errors propagate) ----------------------
    def add_request(self, request: EngineRequest, callback: OutputCallback) -> None:
        """`LLMEngine.add_request`; `callback` gets the request's outputs."""

        def fn(engine: LLMEngine) -> None:
            engine.add_request(request)
            self._callbacks[request.request_id] = callback

        self.call(fn)

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
        """`LLMEngine.begin_import`, queued: the Future holds its outcome (the engine thread takes it between steps;
        calls submitted after it, e.g. the request's imports, run after it)."""

        def fn(engine: LLMEngine) -> None:
            engine.begin_import(request_id, prompt_token_ids, sampling, resumed_tokens, resumed_text_chars, n, best_of)
            self._callbacks[request_id] = callback

        return self.submit(fn)

    def emit_first_token(self, request_id: str, first_token_id: int) -> bool:
        """`LLMEngine.emit_first_token`: its output reaches the callback right after (before any step)."""
        return self.call(lambda e: e.emit_first_token(request_id, first_token_id))

    def finish_import(self, request_id: str, first_token_id: int) -> None:
        self.call(lambda e: e.finish_import(request_id, first_token_id))

    def abort(self, request_id: str) -> Future:
        """Abort (asynchronously); the callback gets a final "abort" output if the request had not finished."""
        return self.submit(lambda e: e.abort(request_id))

    def release(self, request_id: str) -> Future:
        """Free the request's pages (asynchronously); its callback is dropped without further output."""

        def fn(engine: LLMEngine) -> bool:
            self._callbacks.pop(request_id, None)
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

    # ---- engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        self.engine.runner.bind_thread()  # its GPU is this thread's current CUDA device (Triton, graphs)
        blocked = False  # last step scheduled nothing: wait for a command before stepping again
        while True:
            with self._cv:
                while not self._stopping and not self._cmds and (blocked or not self.engine.has_unfinished_requests()):
                    self._cv.wait()
                if self._stopping:
                    cmds = list(self._cmds)
                    self._cmds.clear()
                    for _, fut in cmds:
                        fut.cancel()
                    return
                cmds = list(self._cmds)
                self._cmds.clear()
            for fn, fut in cmds:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except BaseException as e:
                        fut.set_exception(e)
            blocked = False
            for o in self.engine.take_pending():  # e.g. an imported request's first token: stream it now
                self._dispatch(o)
            if self.engine.has_unfinished_requests():
                try:
                    self.step_started_ns = time.time_ns()
                    outputs = self.engine.step()
                    if self.step_listener is not None:
                        self.step_listener(self.engine, self.step_started_ns, time.time_ns())
                except Exception as e:
                    log.exception("engine step failed; aborting %d requests", len(self._callbacks))
                    self._fail_all(e)
                    continue
                blocked = not outputs and not self.engine.last_step_scheduled
                for o in outputs:
                    self._dispatch(o)

    def _dispatch(self, out: StepOutput | BaseException, request_id: str | None = None) -> None:
        if request_id is not None:
            rid = request_id
        else:
            assert isinstance(out, StepOutput), "an error is dispatched with the request id it fails"
            rid = out.request_id
        cb = self._callbacks.get(rid)
        if cb is None:
            return
        if isinstance(out, BaseException) or out.request_done:  # n > 1: after the last choice's
            del self._callbacks[rid]
        try:
            cb(out)
        except Exception:
            log.exception("output callback for %s failed", rid)

    def _fail_all(self, err: BaseException) -> None:
        for rid in self.engine.request_ids():
            self.engine.release(rid)
        for rid in list(self._callbacks):
            self._dispatch(err, rid)
