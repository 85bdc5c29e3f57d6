"""Prefill gRPC servicer, RPC glue: check the request, decide where its prefix comes from (`PrefixPolicy`), open its
KV transfer to decode (`pdserve.kv.transfer.for_prefill`), queue it in the engine and stream what `PrefillCall`
makes of its outputs: pages shipped while later chunks compute, PrefillDone last."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial

import grpc

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.prefix_policy import PrefixPlan, PrefixPolicy
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.write_behind import WriteBehind
from pdserve.engine.loop import EngineLoop
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.tp.layout import make_layout
from pdserve.errors import InvalidRequest, TransportUnusable
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer import OutgoingTransfer, for_prefill
from pdserve.kv.transfer.handshake import ShardLayout
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.head_start import DecodeShape, HeadStart, HeadStarts
from pdserve.prefill.kv_format import ShipFormatCheck
from pdserve.prefill.prefill_call import PrefillCall
from pdserve.server.instance_stats import instance_stats
from pdserve.server.proto_convert import sampling_from_proto
from pdserve.server.status import engine_error_code
from pdserve.telemetry.metrics import watch_kv_shipper
from pdserve.telemetry.rates import WorkRate
from pdserve.telemetry.service import RequestScope, RpcSpan, Telemetry
from pdserve.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger("pdserve.prefill")


class PrefillServicer(internal_pb2_grpc.PrefillServicer):
    def __init__(
        self, cfg: PrefillConfig, loop: EngineLoop, telemetry: Telemetry | None = None, cache: PromptCache | None = None
    ):
        self.cfg = cfg
        self.loop = loop
        self.cache = cache  # prompt cache (None: off); counters: cache.hits, .misses, .local_hits, .corrupt, ...
        self.telemetry = telemetry or Telemetry.off("prefill")
        engine = loop.engine
        self.fingerprint: str = engine.fingerprint
        self.model_config = engine.model_config
        self.page_size: int = engine.page_size
        self.max_model_len: int = engine.model_config.max_position_embeddings
        self._lock = threading.Lock()
        self._active = 0
        self._arriving = 0  # RPCs (Prefill, Start) not admitted to the engine yet: their lookups count as busy
        self._prompt_tokens = self._cached_tokens = 0  # of finished prefills (the cache hit ratio gauge)
        if cache is None:  # with a cache, its own page hit ratio (pdserve.telemetry.metrics.watch_prompt_cache)
            self.telemetry.metrics.gauge(
                "cache_hit_ratio",
                "Cached / prompt tokens of finished prefills",
                lambda: self._cached_tokens / max(1, self._prompt_tokens),
            )
        # a finished request's pages go to the cache from a WriteBehind, while this instance computes and ships nothing
        write_behind = (
            None
            if cache is None
            else WriteBehind(
                self._busy,
                int(cfg.cache_write_behind_mb * (1 << 20)),
                cfg.cache_write_wait_s,
                on_drop=lambda pages: cache.stats.add(write_drops=pages),
            )
        )
        # the store's pages race the compute: the engine loads those that land before it reaches them
        race = cfg.fetch_race_device(engine.runner.device)
        arena = cfg.fetch_process_arena(race)
        if cache is not None and arena is not None:  # their reads and MAC checks outside this process's GIL
            cache.use_fetch_process(*arena)
        chunk = engine.scheduler.chunk_size
        self.prefix = PrefixPolicy(cache, self.page_size, cfg.prefix_reuse, write_behind, race, chunk)
        self.shards = ShardLayout.of(engine.runner)  # its KV heads over its TP ranks (the choice tells decode)
        self.kv = for_prefill(cfg, engine.runner.device, self.fingerprint, release=loop.release, shards=self.shards)
        if self.kv.shipper is not None:
            watch_kv_shipper(self.telemetry.metrics, self.kv.shipper)
        self.prefill_rate = WorkRate()  # prompt tokens per busy second of the engine (Stats; cache decisions)
        self.ship_format = ShipFormatCheck(cfg.engine.kv_dtype, cfg.engine.batch_invariant)
        # requests the router started here (Start) until decode's stream takes them over
        self.head_starts = HeadStarts(cfg.head_start_wait_s, cfg.head_start_limit, self._drop_start)
        for name in ("started", "taken", "mismatched", "expired", "refused"):
            self.telemetry.metrics.counter(
                f"head_starts_{name}",
                f"Router head starts {name} (Prefill.Start; pdserve.prefill.head_start)",
                partial(getattr, self.head_starts, name),
            )

    # ---- RPC ------------------------------------------------------------------------------------------
    def Prefill(self, request_iterator: Iterator[internal_pb2.PrefillClientMessage], context: grpc.ServicerContext):
        t0 = time.perf_counter()
        scope = self.telemetry.request("prefill.request", context)
        with self._arrival():
            call, tx, ns, prompt = self._arrive(request_iterator, context, scope, t0)
        # Only once admitted is the request id this call's in the engine: a rejected duplicate id must never free the
        # engine request of the same id that another call holds.
        if not context.add_callback(tx.abort):  # RPC ended for any reason (cancel, deadline, error, success)
            tx.abort()  # ... already
        tx.listen(request_iterator)
        try:
            # Inside the try: a stream cancelled at its first message still gives back its `_active` count.
            yield tx.choice
            yield from self._stream(call, ns, len(prompt), context)
        except Exception as e:  # the transfer's and the engine's errors, through the one status table
            context.abort(engine_error_code(e), str(e))
        finally:
            with self._lock:
                self._active -= 1
            call.end_spans()  # no-op after PrefillDone; else the status the RPC ends with
            # Pages stay allocated until decode acks them all or the RPC ends (tx.abort above).

    def _arrive(
        self, request_iterator, context: grpc.ServicerContext, scope: RequestScope, t0: float
    ) -> tuple[PrefillCall, OutgoingTransfer, CacheNamespace, list[int]]:
        """A Prefill stream up to its admission: its request checked, its transfer open, its head start taken or its
        prefix planned and the request queued in the engine (counted active)."""
        req = self._request(request_iterator, context)
        scope.event("read")  # the stages before the engine has the request, as span events (span_breakdown's rows)
        layout = self._check_peer(req, context)  # the prompt, sampling and sampled_before: the engine checks them
        self.ship_format.check(layout)  # another format than --kv-dtype prepared for: served, logged once
        sampling = sampling_from_proto(req.sampling, self.max_model_len - len(req.prompt_token_ids))
        prompt = list(req.prompt_token_ids)
        tx = self._open_transfer(req, len(prompt), layout, context)  # the transport agreed with this decode
        scope.event("transfer_open")
        scope.set(
            {
                "pdserve.request_id": req.request_id,
                "pdserve.prompt_tokens": len(prompt),
                "pdserve.kv.dtype": layout.dtype,
                "pdserve.kv.tp": f"{self.shards.tp_size}->{self._decode_tp(req)}",  # prefill's TP -> decode's
            }
        )
        ns = CacheNamespace(self.fingerprint, layout, req.cache_scope)  # the router's scope: tenant or shared
        # prompt logprobs lead decode's first response and come with PrefillDone: no early first token then
        early_first = req.first_token_early and not sampling.prompt_logprobs
        shape = DecodeShape(layout, tx.layer_group, tx.device_to_device)
        self.head_starts.shape = shape  # what the next head start assumes
        call = self._take_start(req, prompt, shape, tx, scope, early_first) if req.start_key else None
        if call is None:
            plan = self._plan(scope, ns, prompt, sampling)
            call = PrefillCall(
                self.loop, req.request_id, prompt, layout, plan, early_first, self.prefill_rate, t0,
                layer_group=tx.layer_group, device_to_device=tx.device_to_device, tx=tx, scope=scope,
            )  # fmt: skip
            self._admit(call, req, prompt, sampling, context)
        scope.event("admitted")
        return call, tx, ns, prompt

    def Start(self, request: internal_pb2.PrefillStart, context: grpc.ServicerContext) -> internal_pb2.PrefillStarted:
        """The router's head start (`pdserve.prefill.head_start`): the request enters the engine now and waits for
        decode's stream to take it over. Not started (the reply says why): off, no stream served yet (what decode
        asks for is unknown), full, its stream came first, or the request could not be made; decode's stream then
        computes it as usual. The engine's own admission is asynchronous: its refusal reaches the stream instead."""
        t0 = time.perf_counter()
        if len(request.start_key) != 16 or not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a head start needs a request_id and a 16-byte start_key")
        shape = self.head_starts.shape
        if not self.cfg.head_start or shape is None:
            why = "head starts are off here" if not self.cfg.head_start else "no decode stream served yet"
            return internal_pb2.PrefillStarted(started=False, reason=why)
        with self._arrival():
            return self._start(request, context, shape, t0)

    def _start(
        self, request: internal_pb2.PrefillStart, context: grpc.ServicerContext, shape: DecodeShape, t0: float
    ) -> internal_pb2.PrefillStarted:
        """A head start reserved, its prefix planned and its engine admission submitted (or why not)."""
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        span = self.telemetry.rpc_span("prefill.start", context, {"pdserve.request_id": rid})
        sampling_bytes = request.sampling.SerializeToString(deterministic=True)
        expires = time.monotonic() + self.cfg.head_start_wait_s
        start = HeadStart(rid, request.start_key, prompt, sampling_bytes, request.cache_scope, shape, expires)
        why = self.head_starts.reserve(start)  # before the lookup: a stream arriving meanwhile waits for this start
        if not why:
            try:
                sampling = sampling_from_proto(request.sampling, self.max_model_len - len(prompt))
                ns = CacheNamespace(self.fingerprint, shape.layout, request.cache_scope)
                plan = self._plan(span, ns, prompt, sampling)
                call = PrefillCall(self.loop, rid, prompt, shape.layout, plan, True, self.prefill_rate, t0,
                                   layer_group=shape.layer_group, device_to_device=shape.device_to_device)  # fmt: skip
                self.head_starts.admit(start, call, lambda: self._engine_request(call, rid, prompt, sampling, 0))
            except Exception as e:  # a request the stream will refuse with its status (e.g. an empty prompt)
                self.head_starts.abandon(start, e)
                why = f"not started: {e}"
        span.end({"pdserve.head_start.started": not why, "pdserve.head_start.reason": why or None})
        return internal_pb2.PrefillStarted(started=not why, reason=why)

    def _take_start(
        self,
        req: internal_pb2.PrefillRequest,
        prompt: list[int],
        shape: DecodeShape,
        tx: OutgoingTransfer,
        scope: RequestScope,
        early_first: bool,
    ) -> PrefillCall | None:
        """The head start this stream's request names, attached to it; None if there is none or it differs from
        what this stream asks (then dropped: the stream computes the request anew)."""
        start = self.head_starts.take(req.request_id, req.start_key)
        if start is None:
            return None
        error = start.admitted.exception()  # waits for the admission (a start taken while its lookup runs)
        why, call = "", start.call  # set before the admission was submitted
        if error is not None or call is None:
            why = f"its admission failed: {error}"
        elif start.prompt != prompt or req.sampled_before:
            why = "decode's prompt differs"
        elif start.sampling != req.sampling.SerializeToString(deterministic=True):
            why = "decode's sampling differs"
        elif start.cache_scope != req.cache_scope:
            why = "decode's cache scope differs"
        elif not start.shape.serves(shape, bool(call.plan.hit.pages)):
            why = f"decode asks for {shape}, the start assumed {start.shape}"
        if why or call is None:
            self.head_starts.mismatch(start, why)
            return None
        call.attach(tx, scope, early_first)
        ahead_ms = (time.perf_counter() - call.started) * 1e3  # since the router's Start reached this instance
        scope.event("head_start_taken", {"pdserve.head_start.ms": round(ahead_ms, 3)})
        return call

    def _drop_start(self, start: HeadStart) -> None:
        """A head start no stream will take (expired, differing, shutdown): its pages and engine request freed."""
        self.loop.release(start.request_id)
        with self._lock:
            self._active -= 1

    def _stream(self, call: PrefillCall, ns: CacheNamespace, prompt_tokens: int, context: grpc.ServicerContext):
        """The call's messages, PrefillDone, then the wait for decode's last acks and the prompt cache write-back."""
        deadline = time.monotonic() + self.cfg.request_timeout_s
        ack_timeout = self.cfg.ack_timeout_s
        done = yield from call.messages(deadline, ack_timeout, context.is_active)
        if done is None:  # the caller went away
            return
        self._record_done(call, prompt_tokens, done)
        # Decode reads the stream in order: every batch before PrefillDone is fetched and acked before decode acts on
        # it. So PrefillDone goes now, and the RPC stays open until what the sender still holds for decode is acked
        # (cuda-ipc: staging regions; grpc: nothing).
        yield internal_pb2.PrefillServerMessage(done=done)
        call.tx.finish(max(0.0, min(ack_timeout, deadline - time.monotonic())))
        self.prefix.write_back(ns, call.plan, call.prefix_pages, call.shipped, call.layout)
        call.log_done(done)

    # ---- steps of a call ----------------------------------------------------------------------------------
    @staticmethod
    def _request(request_iterator, context: grpc.ServicerContext) -> internal_pb2.PrefillRequest:
        first = next(request_iterator, None)
        if first is None or not first.HasField("request"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first message must be a PrefillRequest")
        assert first is not None  # context.abort raised otherwise
        return first.request

    def _check_peer(self, req: internal_pb2.PrefillRequest, context: grpc.ServicerContext) -> KVLayoutSpec:
        mc = self.model_config
        if req.model_fingerprint != self.fingerprint:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model fingerprint mismatch: decode has {req.model_fingerprint}, prefill has {self.fingerprint}",
            )
        try:
            layout = KVLayoutSpec.from_proto(req.kv_layout)
            layout.validate()
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"unsupported KV layout: {e}")
        expect = (self.page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim)
        got = (layout.page_size, layout.num_layers, layout.num_kv_heads, layout.head_dim)
        if got != expect:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV layout mismatch: decode wants (page, layers, kv_heads, head_dim)={got}, prefill has {expect}",
            )
        why = self._split_problem(req)
        if why:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"decode's tensor-parallel KV layout: {why}")
        return layout

    def _split_problem(self, req: internal_pb2.PrefillRequest) -> str:
        """Why decode's split of the KV heads over its ranks is not this model's at its TP size ("" when it is,
        or when decode predates tensor parallelism). Pages ship with every head whatever the split: a wrong one
        means another model or a broken peer, never a layout to convert."""
        if not (req.HasField("kv_transport") and req.kv_transport.HasField("shards")):
            return ""
        kvh = self.model_config.num_kv_heads
        peer = ShardLayout.from_proto(req.kv_transport.shards, kvh)
        why = peer.problem(kvh)
        if why:
            return why
        try:
            want = make_layout(self.model_config, peer.tp_size).kv_per_rank
        except ValueError as e:
            return f"decode runs {peer}, which this model cannot be split into ({e})"
        return "" if want == peer.kv_heads_per_rank else f"decode runs {peer}, this model splits into {want} per rank"

    @staticmethod
    def _decode_tp(req: internal_pb2.PrefillRequest) -> int:
        """Decode's TP size, from its offer (1 for a decode that predates tensor parallelism)."""
        return req.kv_transport.shards.tensor_parallel_size or 1

    def _open_transfer(
        self, req: internal_pb2.PrefillRequest, prompt_tokens: int, layout: KVLayoutSpec, context
    ) -> OutgoingTransfer:
        offer = req.kv_transport if req.HasField("kv_transport") else None
        try:
            pages = -(-prompt_tokens // self.page_size)
            return self.kv.open(req.request_id, pages, layout, offer, req.kv_layer_groups)  # groups: if decode takes
        except TransportUnusable as e:
            context.abort(engine_error_code(e), str(e))
            raise  # unreachable: abort raises

    def _plan(
        self, scope: RequestScope | RpcSpan, ns: CacheNamespace, prompt: list[int], sampling: SamplingParams
    ) -> PrefixPlan:
        """The prefix decision; prompt_logprobs score every prompt token: nothing may come from the pool or cache."""
        lookup_ns = time.time_ns()
        held = self.loop.engine.prefix_pages_held
        plan = self.prefix.plan(ns, prompt, bool(sampling.prompt_logprobs), self.prefill_rate.rate(), held)
        scope.record("prefill.cache_lookup", lookup_ns, plan.attributes(self.cache is not None))
        return plan

    def _admit(self, call: PrefillCall, req, prompt: list[int], sampling: SamplingParams, context) -> None:
        """Queue the request in the engine, counted active; an engine refusal aborts with its status."""
        try:
            self._engine_request(call, req.request_id, prompt, sampling, req.sampled_before).result()
        except Exception as e:
            context.abort(engine_error_code(e), f"prefill could not admit request: {e}")

    def _engine_request(
        self, call: PrefillCall, request_id: str, prompt: list[int], sampling: SamplingParams, sampled_before: int
    ) -> Future:
        """Submit the request to the engine, counted active; the Future holds the engine's answer (a refusal is
        not counted)."""
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            prefill_only=True,
            cached_pages=call.plan.cached_pages,
            sampled_before=sampled_before,
            keep_cached_upload=call.upload_pending,
            prefix_keys=call.plan.prefix_keys,
            layer_stream=call.layer_stream,  # pages leave layer group by layer group during the forward
            prefix_fetch=call.plan.fetch,  # the store's pages, loaded where they land before the compute
        )
        with self._lock:
            self._active += 1

        def refused(admission: Future) -> None:
            if admission.cancelled() or admission.exception() is not None:
                with self._lock:
                    self._active -= 1

        try:
            admission = self.loop.submit_request(request, call.on_output)
        except Exception:
            with self._lock:
                self._active -= 1
            raise
        admission.add_done_callback(refused)
        return admission

    def _record_done(self, call: PrefillCall, prompt_tokens: int, done: internal_pb2.PrefillDone) -> None:
        """Metrics and spans of a finished prefill (before PrefillDone is sent)."""
        self.telemetry.metrics.kv_bytes.inc(call.tx.pages.bytes_shipped)
        with self._lock:
            self._prompt_tokens += prompt_tokens
            self._cached_tokens += done.cached_tokens
        call.record_done(done)

    @contextmanager
    def _arrival(self) -> Iterator[None]:
        """An RPC's way to its engine admission (the read, the prefix lookup): busy already (`_busy`), so that a
        write-back's page copies wait for its end instead of sharing this process's GIL with it."""
        with self._lock:
            self._arriving += 1
        try:
            yield
        finally:
            with self._lock:
                self._arriving -= 1

    def _busy(self) -> bool:
        """Whether this instance computes or ships anything now, or a request is on its way to the engine (any
        thread; the write-behind waits it out)."""
        with self._lock:
            active = self._active + self._arriving
        return active > 0 or self.loop.engine.has_unfinished_requests()

    def close(self) -> None:
        """Service shutdown: the head starts, the write-behind, the staging buffer (its shared-memory file on CPU), the
        builders."""
        self.head_starts.close()
        self.prefix.close()
        self.kv.close()

    def Stats(self, request, context):
        with self._lock:
            active = self._active
        rate = self.prefill_rate.rate() or 0.0
        return instance_stats(self.loop, active, self.kv.stats, prefill_tokens_per_s=rate)


def _serialize_server_message(msg) -> bytes:
    """Batches are yielded pre-serialized (`pdserve.kv.transfer.wire`); everything else is a message."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def add_prefill_servicer(servicer: PrefillServicer, server: grpc.Server) -> None:
    """Register the Prefill service like the generated helper, but let the stream carry pre-serialized bytes."""
    handlers = {
        "Prefill": grpc.stream_stream_rpc_method_handler(
            servicer.Prefill,
            request_deserializer=internal_pb2.PrefillClientMessage.FromString,
            response_serializer=_serialize_server_message,
        ),
        "Stats": grpc.unary_unary_rpc_method_handler(
            servicer.Stats,
            request_deserializer=internal_pb2.StatsRequest.FromString,
            response_serializer=internal_pb2.InstanceStats.SerializeToString,
        ),
    }
    if hasattr(servicer, "Start"):  # (scripted stand-ins for a prefill serve the stream and Stats only: UNIMPLEMENTED)
        handlers["Start"] = grpc.unary_unary_rpc_method_handler(
            servicer.Start,
            request_deserializer=internal_pb2.PrefillStart.FromString,
            response_serializer=internal_pb2.PrefillStarted.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.Prefill", handlers),))
