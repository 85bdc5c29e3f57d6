"""The router's head start (`Prefill.Start`): a request's prefill begins while the router's call to decode and
decode's Prefill stream are still on their way, and the stream takes the computed request over.

Without it the prefill starts two hops after the router's dispatch (router -> decode, decode -> prefill); with it, one
hop after, in parallel with decode's. The request waits here, in the engine, its pages in this instance's pool,
until decode's stream names the same request id and start key (`take`); pages computed before that ship as soon as it
attaches. What the stream would have decided before the engine had the request comes from the last stream this
instance served (`DecodeShape`: decode's page layout, whether it takes layer groups, whether its transport moves
bytes device to device); a stream that differs, or a request that differs from what was started, drops the start and
computes anew, counted in `HeadStarts.mismatched`. A start no stream takes within `wait_s` is dropped (`expired`):
decode refused the request, or the router's call to decode failed.

States of a start: admitting (reserved before its lookup; then the engine's admission runs) -> waiting -> taken (by
its stream) or expired."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

from pdserve.kv.codec import KVLayoutSpec
from pdserve.prefill.prefill_call import PrefillCall

log = logging.getLogger("pdserve.prefill")

ADMITTING, WAITING, TAKEN, EXPIRED = "admitting", "waiting", "taken", "expired"


@dataclass(frozen=True)
class DecodeShape:
    """What a Prefill stream decides before its request reaches the engine, as the last stream decided it."""

    layout: KVLayoutSpec  # the pages' format decode asks for
    layer_group: int  # layers per shipment (`OutgoingTransfer.layer_group`)
    device_to_device: bool  # the transport moves bytes device to device (a cached prefix ships from the device)

    def serves(self, stream: DecodeShape, cached_prefix: bool) -> bool:
        """Whether a start made for this shape serves `stream`'s: the transport's kind matters only to a request
        with a cached prefix (where its pages ship from), so decode instances on this host and elsewhere share
        starts."""
        same_transport = self.device_to_device == stream.device_to_device or not cached_prefix
        return self.layout == stream.layout and self.layer_group == stream.layer_group and same_transport


@dataclass
class HeadStart:
    """One started request: what it was started with (compared with its stream's request) and its call."""

    request_id: str
    key: bytes
    prompt: list[int]
    sampling: bytes  # SamplingParams, serialized deterministically
    cache_scope: str
    shape: DecodeShape
    expires: float  # time.monotonic()
    call: PrefillCall | None = None  # set by `admit`, before the engine has it (a stream reads it once admitted)
    admitted: Future = field(default_factory=Future)  # True once the engine has it; its refusal's exception
    state: str = ADMITTING


class HeadStarts:
    """The started requests not yet taken by a stream, at most `limit`. `drop(start)` gives an admitted start's
    engine request and pages back: it only queues that on the engine loop, and is called under the registry's lock,
    so that a stream that finds no start afterwards queues its own admission of the id behind the drop.

    Start and stream race (they come by different hops): a stream that carries a key and finds no start leaves a
    mark for `wait_s`, and a Start arriving after its stream is refused, never admitted beside it. A start whose
    admission is still queued does not expire (a stream may still wait for it); it does once admitted."""

    def __init__(self, wait_s: float, limit: int, drop: Callable[[HeadStart], None]) -> None:
        self.wait_s, self.limit, self._drop = wait_s, limit, drop
        self._cv = threading.Condition()
        self._starts: dict[str, HeadStart] = {}
        self._streamed: dict[str, float] = {}  # request id -> until when a Start for it comes too late
        self._closed = False
        self.shape: DecodeShape | None = None  # the last stream's (any thread; replaced whole)
        # counters (metrics): started, taken by their stream, dropped for a difference, expired, refused here
        self.started = self.taken = self.mismatched = self.expired = self.refused = 0
        self._thread = threading.Thread(target=self._expire_loop, name="head-start-expiry", daemon=True)
        self._thread.start()

    def reserve(self, start: HeadStart) -> str:
        """Register `start` (admitting) before its lookup and call are made, so that its stream, from now on, waits
        for it rather than computing the request beside it; "" once registered, else why not (full, a start of that
        id already here, its stream came first, shutdown). `admit` or `abandon` must follow."""
        with self._cv:
            why = self._refusal(start.request_id)
            if why:
                self.refused += 1
                return why
            self._starts[start.request_id] = start
            self._cv.notify()
        return ""

    def admit(self, start: HeadStart, call: PrefillCall, submit: Callable[[], Future]) -> None:
        """A reserved start's call, and its admission to the engine (`submit`: its Future, the engine's answer, which
        `start.admitted` relays)."""
        start.call = call
        try:
            admission = submit()
        except Exception as e:
            self._admitted(start, e)
            return
        admission.add_done_callback(lambda f: self._admitted(start, _error(f)))

    def abandon(self, start: HeadStart, error: BaseException) -> None:
        """A reserved start that could not be made (its stream then gets the same request's own answer)."""
        self._admitted(start, error)

    def _refusal(self, request_id: str) -> str:
        if self._closed:
            return "prefill is shutting down"
        if request_id in self._streamed:
            return "decode's stream for this request came first"
        if request_id in self._starts:
            return "a head start of this request id is here already"
        if len(self._starts) >= self.limit:
            return f"{self.limit} head starts already wait for their streams"
        return ""

    def _admitted(self, start: HeadStart, error: BaseException | None) -> None:
        """The engine's answer (on its thread): the start waits for its stream, or is gone (refused)."""
        with self._cv:
            if error is not None:
                if self._starts.get(start.request_id) is start:
                    del self._starts[start.request_id]
                self.refused += 1
            else:
                self.started += 1
                if start.state == ADMITTING:
                    start.state = WAITING
                self._cv.notify()  # it may be due already
        if error is not None:
            log.info("prefill rid=%s: head start not admitted: %s", start.request_id, error)
            start.admitted.set_exception(error)
        else:
            start.admitted.set_result(True)

    def take(self, request_id: str, key: bytes) -> HeadStart | None:
        """The start of `request_id` whose key is `key`, now its stream's; None if there is none (expired, another
        key, or not come yet: then none will be admitted for `wait_s`). The caller waits for `admitted` and attaches
        or drops it."""
        with self._cv:
            start = self._starts.get(request_id)
            if start is None:
                if not self._closed:
                    self._streamed[request_id] = time.monotonic() + self.wait_s
                    self._cv.notify()
                return None
            if not hmac.compare_digest(start.key, key):
                return None
            del self._starts[request_id]
            start.state = TAKEN
            self.taken += 1
            return start

    def mismatch(self, start: HeadStart, why: str) -> None:
        """A taken start its stream cannot use: dropped (once admitted); the stream computes the request anew."""
        with self._cv:
            self.taken -= 1
            self.mismatched += 1
            log.info("prefill rid=%s: head start dropped (%s)", start.request_id, why)
            if start.admitted.exception() is None:
                self._drop(start)

    @property
    def waiting(self) -> int:
        with self._cv:
            return len(self._starts)

    def _expire_loop(self) -> None:
        with self._cv:
            while True:
                now = time.monotonic()
                for rid in [r for r, until in self._streamed.items() if until <= now]:
                    del self._streamed[rid]
                for s in [s for s in self._starts.values() if s.state == WAITING and s.expires <= now]:
                    del self._starts[s.request_id]
                    self.expired += 1
                    s.state = EXPIRED
                    log.info("prefill rid=%s: head start expired (no stream within %.1f s)", s.request_id, self.wait_s)
                    self._drop(s)
                if self._closed and not self._starts:
                    return
                times = [s.expires for s in self._starts.values() if s.state == WAITING]
                nxt = min([*times, *self._streamed.values()], default=now + 3600.0)
                self._cv.wait(max(0.001, nxt - now))

    def close(self) -> None:
        """Shutdown: every start still waiting is dropped (one still admitting, once admitted)."""
        with self._cv:
            self._closed = True
            for s in self._starts.values():
                s.expires = 0.0
            self._cv.notify()
        self._thread.join(timeout=5.0)


def _error(admission: Future) -> BaseException | None:
    """The admission's refusal (a cancelled one: the engine loop stopped), None when admitted."""
    return CancelledError("the engine loop stopped") if admission.cancelled() else admission.exception()
