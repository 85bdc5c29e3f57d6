"""Thread budget of a service: long RPCs (generation streams, the KV stream) hold a worker thread each for their
whole life, so at most `limit` of them run at once; the server's pool has `limit` + a reserved control budget of
threads, so health checks, Stats and the Registry always find one (pdserve.server.runner).

A long RPC beyond the limit fails RESOURCE_EXHAUSTED at once (with a retry-after) instead of waiting inside gRPC
where admission cannot see it. The gate also drains: `close()` refuses new long RPCs (UNAVAILABLE "<service>
shutting down"), `wait_idle(t)` waits for the running ones, `end_all()` ends those still running with UNAVAILABLE
"<service> shutting down": it runs the callbacks each servicer registered with `context.add_callback` (which
cancel its downstream calls and queue waits) and reports the context inactive, so the servicer returns promptly
and the gate sends the status.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, cast

import grpc

from pdserve.client_retry import PUSHBACK_KEYS

log = logging.getLogger("pdserve.server.stream_gate")

LONG_RPCS = frozenset(
    {
        "/pdserve.v1.Generation/Generate",
        "/pdserve.v1.Generation/GenerateStream",
        "/pdserve.v1.Decode/Generate",
        "/pdserve.v1.Prefill/Prefill",
    }
)
RETRY_AFTER_MS = 500  # pushback of a call refused for want of a thread


class _Once:
    def __init__(self, fn: Callable[[], None]):
        self._fn: Callable[[], None] | None = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class GatedContext:
    """The servicer's view of its context: the real one, plus `end()` (drain over) which runs the registered
    callbacks and makes `is_active()` False. Everything else is the real context's."""

    def __init__(self, context: grpc.ServicerContext):
        self._ctx = context
        self._lock = threading.Lock()
        self._callbacks: list[_Once] = []
        self.ended = False
        self.left = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        once = _Once(callback)
        with self._lock:
            if self.ended:
                return False
            self._callbacks.append(once)
        return self._ctx.add_callback(once)

    def is_active(self) -> bool:
        return not self.ended and self._ctx.is_active()

    def end(self) -> None:
        with self._lock:
            self.ended = True
            callbacks = list(self._callbacks)
        for cb in callbacks:
            try:
                cb()
            except Exception:  # a callback's failure must not stop the others
                log.exception("callback of an ended RPC failed")


class StreamGate(grpc.ServerInterceptor):
    def __init__(self, service: str, limit: int, methods: frozenset[str] = LONG_RPCS):
        if limit < 1:
            raise ValueError(f"stream limit must be >= 1, got {limit}")
        self.service, self.limit, self.methods = service, limit, methods
        self._cond = threading.Condition()
        self._active: set[GatedContext] = set()
        self._closing = False
        self.rejected = 0  # calls refused for want of a slot (Stats, tests)

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._active)

    # ---- admission ------------------------------------------------------------------------------------------
    def _enter(self, context: grpc.ServicerContext) -> GatedContext:
        with self._cond:
            if self._closing:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.service} shutting down")
            if len(self._active) >= self.limit:
                self.rejected += 1
                ms = str(RETRY_AFTER_MS)
                context.set_trailing_metadata(tuple((k, ms) for k in PUSHBACK_KEYS))
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.service} is at its limit of {self.limit} concurrent streams (--max-streams); retry later",
                )
            gated = GatedContext(context)
            self._active.add(gated)
        if not context.add_callback(lambda: self._leave(gated)):  # whatever ends the RPC
            self._leave(gated)  # it ended already: the callback would never run, and the slot never come back
        return gated

    def _leave(self, gated: GatedContext) -> None:
        with self._cond:
            if gated.left:
                return
            gated.left = True
            self._active.discard(gated)
            self._cond.notify_all()

    def _ended(self, gated: GatedContext, context: grpc.ServicerContext) -> None:
        if gated.ended:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.service} shutting down")

    # ---- drain ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Refuse new long RPCs from now on (UNAVAILABLE)."""
        with self._cond:
            self._closing = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no long RPC runs (True) or `timeout` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._active, timeout=max(0.0, timeout))

    def end_all(self) -> int:
        """End every running long RPC with UNAVAILABLE "<service> shutting down"; returns how many."""
        with self._cond:
            running = list(self._active)
        for gated in running:
            gated.end()
        return len(running)

    # ---- interceptor ----------------------------------------------------------------------------------------
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.methods:
            return handler
        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(self._streaming(handler.stream_stream), **kw)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(self._unary(handler.stream_unary), **kw)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(self._streaming(handler.unary_stream), **kw)
        return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary), **kw)

    def _unary(self, behavior):
        def run(request, context: grpc.ServicerContext):
            gated = self._enter(context)
            try:
                response = behavior(request, cast(grpc.ServicerContext, gated))
            except Exception:
                self._ended(gated, context)
                raise
            finally:
                self._leave(gated)
            self._ended(gated, context)  # a partial answer of an ended call is not an answer
            return response

        return run

    def _streaming(self, behavior):
        def run(request, context: grpc.ServicerContext):
            gated = self._enter(context)
            inner = None
            try:
                inner = behavior(request, cast(grpc.ServicerContext, gated))
                for item in inner:
                    self._ended(gated, context)
                    yield item
                self._ended(gated, context)
            except GeneratorExit:
                raise
            except Exception:
                self._ended(gated, context)
                raise
            finally:
                if inner is not None and hasattr(inner, "close"):
                    inner.close()
                self._leave(gated)

        return run
