"""One Prefill call from admission on: the engine thread's outputs become events in an outbox (`on_output`), and the
stream writer turns them into the stream's messages (`messages`): a chunk's pages as soon as the chunk computed (in
layer groups as the forward computes them, when decode accepts them and --kv-layer-group splits the model: the
engine hands each group to `layer_stream`'s sink during the forward), the first token ahead of the last chunk's pages
when decode asked for it, and PrefillDone last."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Span

from pdserve.cache.prefix_policy import PrefixPlan
from pdserve.engine.engine import StepOutput
from pdserve.engine.loop import EngineLoop
from pdserve.engine.sampling import TokenLogprob
from pdserve.errors import DeadlineExceeded
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer import ExportedPages, OutgoingTransfer
from pdserve.kv.transfer.layers import LayerStream
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.server.proto_convert import logprob_to_proto, prompt_logprobs_to_proto
from pdserve.telemetry.rates import WorkRate
from pdserve.telemetry.service import RequestScope
from pdserve.v1 import internal_pb2

log = logging.getLogger("pdserve.prefill")


@dataclass
class FirstToken:
    """Outbox: the prompt's last output; its token goes to decode ahead of the pages still to ship."""

    out: StepOutput


@dataclass
class PromptDone:
    """Outbox: the prompt's last output; every page of the prompt is in the outbox before it."""

    out: StepOutput


Event = ExportedPages | FirstToken | PromptDone | BaseException


class PrefillCall:
    """The state of one admitted request. `on_output` runs on the engine thread, everything else on the stream
    writer's. `plan`: where the prompt's prefix comes from; `early_first`: stream the first token ahead; `rate`: the
    instance's prefill rate, fed per chunk; `started`: time.perf_counter() at the RPC's start. `layer_group` and
    `device_to_device`: the transfer's (`OutgoingTransfer`), decided before the engine has the request.

    A call made by the router's head start (`pdserve.prefill.head_start`) computes before any stream exists: `tx` and
    `scope` come with `attach`, its chunk spans wait for them, and `early_first` is decode's to set there."""

    def __init__(
        self,
        loop: EngineLoop,
        request_id: str,
        prompt: list[int],
        layout: KVLayoutSpec,
        plan: PrefixPlan,
        early_first: bool,
        rate: WorkRate,
        started: float,
        *,
        layer_group: int,
        device_to_device: bool,
        tx: OutgoingTransfer | None = None,
        scope: RequestScope | None = None,
    ) -> None:
        self.loop, self.request_id, self.prompt, self.layout = loop, request_id, prompt, layout
        self.plan, self.early_first, self.rate = plan, early_first, rate
        self._tx, self._scope = tx, scope
        self._lock = threading.Lock()  # _scope and _early_spans: the engine thread's chunks vs `attach`
        self._early_spans: list[tuple[int, int, dict[str, Any]]] = []  # chunk spans computed before `attach`
        self.started = started  # time.perf_counter() when the RPC began (PrefillDone.prefill_ms)
        self.outbox: queue.Queue[Event] = queue.Queue()
        self.computed_from: int | None = None  # engine thread: the first prompt token this request computed
        self.computed_tokens = 0  # engine thread: prompt tokens this request computed (the rest came cached)
        self.prompt_logprobs: list[TokenLogprob] = []  # sampling.prompt_logprobs, chunk by chunk (engine thread)
        self.first: StepOutput | None = None  # engine thread -> writer: the prompt's last output (early_first)
        self.first_sent = False
        # The shipped batches the prompt cache's write-back takes after PrefillDone: whole pages, and with a write-back
        # due the layer groups too (it joins them on the host, behind the engine, instead of a second device gather)
        self.shipped: list[ExportedPages] = []
        # Layer groups: the engine thread hands each group of a chunk's pages to `_group_computed` during the forward
        # (EngineRequest.layer_stream); `streamed`: the pages that went out so (not exported again after the step).
        self.layer_stream = LayerStream(layout, layer_group, self._group_computed) if layer_group else None
        self.streamed: set[int] = set()
        self.ship: Span | None = None  # prefill.kv_ship span: first page shipped -> PrefillDone
        # The cached prefix ships as stored: the exact cached bytes (the pool may hold them at another precision).
        # A host transport sends the host copies now, beside the compute. A device-to-device one sends the device
        # copy the engine's import makes (one host pass in all), with the first chunk.
        self.upload_pending = bool(plan.hit.pages) and device_to_device
        if plan.hit.pages and not self.upload_pending:
            rows = PageFormat(layout).rows_from_payloads(plan.hit.pages)
            self.outbox.put(ExportedPages(self._cached_indexes(), self._cached_tokens(), rows))

    @property
    def tx(self) -> OutgoingTransfer:
        """The transfer to decode (stream writer only; a head start's once attached)."""
        assert self._tx is not None, "PrefillCall used before attach"
        return self._tx

    @property
    def scope(self) -> RequestScope:
        """The Prefill stream's request scope (stream writer only; a head start's once attached)."""
        assert self._scope is not None, "PrefillCall used before attach"
        return self._scope

    def attach(self, tx: OutgoingTransfer, scope: RequestScope, early_first: bool) -> None:
        """A head start taken over by decode's stream: its transfer, its scope (the chunk spans computed so far go
        to it with their own times) and whether decode wants the first token ahead of the pages."""
        self._tx, self.early_first = tx, early_first
        with self._lock:
            self._scope = scope
            spans, self._early_spans = self._early_spans, []
        for start_ns, end_ns, attrs in spans:
            scope.record("prefill.chunk", start_ns, attrs, end_ns)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens this request did not compute (from the prompt cache or the pool's prefixes)."""
        return max(0, len(self.prompt) - self.computed_tokens) if self.computed_from is not None else 0

    @property
    def prefix_pages(self) -> int:
        """Leading prompt pages this request did not compute: the pool's or the cache tiers' prefix, and pages its
        fetch loaded before the first chunk (the write-back skips those as fetched). A count of cached tokens is
        no such boundary: pages a fetch loaded after a computed chunk count there too."""
        return max(0, self.computed_from) // self.layout.page_size if self.computed_from is not None else 0

    # ---- engine thread ---------------------------------------------------------------------------------
    def on_output(self, out: StepOutput | BaseException) -> None:
        """Each output of the request: export the pages its chunk finished, right after the chunk."""
        if isinstance(out, BaseException):
            self.outbox.put(out)
            return
        try:
            if out.finish_reason == "abort":
                self.outbox.put(RuntimeError("prefill aborted"))
                return
            self.prompt_logprobs.extend(out.prompt_logprobs)
            fetched = self.plan.fetch.take_loaded() if self.plan.fetch is not None else []
            if fetched:  # prefix pages the engine loaded from the prompt cache's fetch: shipped from the pool
                self.outbox.put(self.loop.engine.export_batch(self.request_id, fetched, self.layout))
            if out.token_range:  # this step computed one chunk of the prompt
                self._chunk_computed(out)
            if out.finished:  # with early_first decode streams it while the pages below are on their way
                self.first = out  # the writer takes it between an earlier chunk's messages too
                self.outbox.put(FirstToken(out))
            ready = [p for p in out.ready_pages if p not in self.streamed]  # streamed: left during the forward
            if ready:  # one device gather per chunk; the writer ships it
                self.outbox.put(self.loop.engine.export_batch(self.request_id, ready, self.layout))
            if out.finished:
                self.outbox.put(PromptDone(out))
        except Exception as e:
            self.outbox.put(e)

    def _group_computed(self, exported: ExportedPages) -> None:
        """Engine thread, during the forward: one layer group of the pages this chunk completes; the writer ships it
        (after its `ready` event) while the forward computes the next layers."""
        self.streamed.update(exported.page_indexes)
        self.outbox.put(exported)

    def _chunk_computed(self, out: StepOutput) -> None:
        token_range, start_ns = out.token_range, self.loop.step_started_ns  # its step's start (outputs follow it)
        assert token_range is not None
        if self.computed_from is None:
            self.computed_from = token_range[0] or -1  # -1: computed from the start
        self.computed_tokens += token_range[1] - token_range[0]
        self.rate.add_to_step(start_ns, token_range[1] - token_range[0], start_ns / 1e9, time.time_ns() / 1e9)
        with self._lock:
            scope = self._scope
        if scope is None or scope.recording:
            attrs: dict[str, Any] = {"pdserve.chunk.start": token_range[0], "pdserve.chunk.end": token_range[1],
                                             "pdserve.chunk.ready_pages": len(out.ready_pages)}  # fmt: skip
            runner = self.loop.engine.runner
            launched = runner.launched_ns - start_ns  # step start -> forward queued
            if launched >= 0:  # (the span's end: its outputs, after the device computed a sampled chunk)
                attrs["pdserve.chunk.launched_ms"] = round(launched / 1e6, 3)
                # of which the forward's launch, and the engine thread's CPU time in it (the rest: blocked)
                attrs["pdserve.chunk.forward_ms"] = round(runner.launch_wall_ns / 1e6, 3)
                attrs["pdserve.chunk.forward_cpu_ms"] = round(runner.launch_cpu_ns / 1e6, 3)
                attrs["pdserve.chunk.layer_export_ms"] = round(runner.layer_export_ns / 1e6, 3)
                attrs["pdserve.chunk.graph_tokens"] = runner.launch_graph_tokens  # 0: launched eagerly
            self._record_chunk(scope, start_ns, attrs)
        if self.upload_pending:  # the step that imported the prefix ran its first chunk
            self.upload_pending = False
            if token_range[0] > 0:  # else preempted before the import: recomputed, in ready_pages
                self.outbox.put(self._cached_batch())

    def _record_chunk(self, scope: RequestScope | None, start_ns: int, attrs: dict[str, Any]) -> None:
        """The chunk's span, or (a head start not attached yet) its times and attributes until `attach`."""
        if scope is not None:
            scope.record("prefill.chunk", start_ns, attrs)
            return
        end_ns = time.time_ns()
        with self._lock:
            if self._scope is None:
                self._early_spans.append((start_ns, end_ns, attrs))
                return
            scope = self._scope  # attached meanwhile
        scope.record("prefill.chunk", start_ns, attrs, end_ns)

    def _cached_batch(self) -> ExportedPages:
        """After the prefix's import: the cached prefix as one batch, packed on the device from the engine's upload
        (host rows if the import kept none: pages of mixed formats)."""
        engine, fmt, pages = self.loop.engine, PageFormat(self.layout), self.plan.hit.pages
        up = engine.take_cached_upload(self.request_id)
        if up is None:
            return ExportedPages(self._cached_indexes(), self._cached_tokens(), fmt.rows_from_payloads(pages))
        rows = fmt.pack(up.data, up.scales, up.zeros)  # uint8 [N, page_bytes] on the device
        return ExportedPages(self._cached_indexes(), self._cached_tokens(), rows, engine.runner.record_event())

    def _cached_indexes(self) -> list[int]:
        return list(range(self.plan.hit.num_pages))

    def _cached_tokens(self) -> list[int]:
        return [p.num_tokens for p in self.plan.hit.pages]

    # ---- stream writer ---------------------------------------------------------------------------------
    def messages(
        self, deadline: float, ack_timeout: float, is_active: Callable[[], bool]
    ) -> Generator[Any, None, internal_pb2.PrefillDone | None]:
        """The stream's messages after the transport choice, up to (not including) PrefillDone, which it returns
        (None: the caller went away). Raises DeadlineExceeded past `deadline` or the ack bound, the transfer's
        errors, and RuntimeError("prefill failed: ...") for the engine's."""
        while True:
            event = self._next_event(deadline, ack_timeout, is_active)
            if event is None:
                return None
            if isinstance(event, PromptDone):
                return self._done(event.out)
            if isinstance(event, FirstToken):
                yield from self._first_token()  # unless it went out between an earlier chunk's batches
                continue
            if self.ship is None:
                self.tx.connect()  # cuda-ipc: decode opened the buffer (or this request falls back to grpc)
                attrs = {"pdserve.kv.dtype": self.layout.dtype, "pdserve.kv.transport": self.tx.transport}
                self.ship = self.scope.child("prefill.kv_ship", attrs)
            yield from self._first_token()  # ready already: ahead of this batch (a last chunk's last layer group)
            for msg in self.tx.send(event):  # an earlier chunk's batches: the first token overtakes the rest
                yield msg
                yield from self._first_token()
            if event.layers is None or self.plan.write_keys:
                self.shipped.append(event)

    def _next_event(
        self, deadline: float, ack_timeout: float, is_active: Callable[[], bool]
    ) -> ExportedPages | FirstToken | PromptDone | None:
        while True:
            try:
                event = self.outbox.get(timeout=max(0.01, min(1.0, ack_timeout, deadline - time.monotonic())))
            except queue.Empty:
                event = None
            self.tx.poll()  # decode stopped storing pages: give them back
            if isinstance(event, BaseException):
                raise RuntimeError(f"prefill failed: {event}")
            if event is not None:
                return event
            if not is_active():
                return None
            if time.monotonic() > deadline:
                raise DeadlineExceeded("prefill exceeded request_timeout_s")

    def _first_token(self) -> Iterator[internal_pb2.PrefillServerMessage]:
        """The early first token, if decode wants it, it is ready and not sent yet."""
        if self.early_first and self.first is not None and not self.first_sent:
            self.first_sent = True
            ft = internal_pb2.PrefillFirstToken(token_id=self.first.new_token_ids[0], cached_tokens=self.cached_tokens)
            if self.first.logprobs:
                ft.logprob.CopyFrom(logprob_to_proto(self.first.logprobs[0]))
            self.scope.event("first_token_out")  # handed to gRPC (the span's first_token event: at PrefillDone)
            yield internal_pb2.PrefillServerMessage(first_token=ft)

    def _done(self, out: StepOutput) -> internal_pb2.PrefillDone:
        values, tops = prompt_logprobs_to_proto(self.prompt_logprobs)
        done = internal_pb2.PrefillDone(
            first_token_id=out.new_token_ids[0],
            num_pages=self.tx.pages.num_shipped,
            cached_tokens=self.cached_tokens,
            prefill_ms=(time.perf_counter() - self.started) * 1e3,
            prompt_logprobs=values,
            prompt_top_logprobs=tops,
        )
        if out.logprobs:  # the first token's (sampling.logprobs / top_logprobs)
            done.first_token_logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
        return done

    # ---- the end ---------------------------------------------------------------------------------------
    def record_done(self, done: internal_pb2.PrefillDone) -> None:
        """The spans of a finished prefill (before PrefillDone is sent)."""
        pages = self.tx.pages
        kv = {"pdserve.kv.pages": pages.num_pages_shipped, "pdserve.kv.bytes": pages.bytes_shipped}
        if self.ship is not None:
            self.scope.end_child(self.ship, ok=True, attributes=kv)
        self.scope.first_token()
        self.scope.finish(
            1,
            "prefill_done",
            {
                **kv,
                "pdserve.cached_tokens": done.cached_tokens,
                "pdserve.first_token_id": done.first_token_id,
                **self.plan.fetch_attributes(),
            },
        )

    def end_spans(self) -> None:
        """The RPC ended: the ship span, if still open, ends with the RPC's status."""
        if self.ship is not None:
            self.scope.end_child(self.ship)

    def log_done(self, done: internal_pb2.PrefillDone) -> None:
        pages = self.tx.pages
        log.info(
            "prefill rid=%s prompt_tokens=%d cached_tokens=%d pages=%d bytes=%d kv=%s transport=%s layer_group=%d "
            "ms=%.1f",
            self.request_id,
            len(self.prompt),
            done.cached_tokens,
            pages.num_pages_shipped,
            pages.bytes_shipped,
            self.layout.dtype,
            self.tx.transport,
            self.tx.layer_group,
            done.prefill_ms,
        )
