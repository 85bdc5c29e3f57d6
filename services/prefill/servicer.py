"""Prefill gRPC servicer: chunked prefill, pages shipped to decode over the stream while later chunks compute."""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.prompt_cache import CacheLookup, PromptCache
from pdserve.engine.loop import EngineLoop
from pdserve.errors import InvalidRequest
from pdserve.kv.codec import KVLayoutSpec, encode_page
from pdserve.kv.transfer import SenderPages, TransferError
from pdserve.prefill.ack_clock import AckClock
from pdserve.prefill.config import PrefillConfig
from pdserve.server.proto_convert import logprob_to_proto, sampling_from_proto
from pdserve.server.status import engine_error_code
from pdserve.telemetry.service import RequestScope, Telemetry
from pdserve.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger("pdserve.prefill")

_DONE = object()


class PrefillServicer(internal_pb2_grpc.PrefillServicer):
    def __init__(
        self, cfg: PrefillConfig, loop: EngineLoop, telemetry: Telemetry | None = None, cache: PromptCache | None = None
    ):
        self.cfg = cfg
        self.loop = loop
        self.cache = cache  # prompt cache (None: off); counters: cache.hits, .misses, .local_hits, .corrupt, ...
        self.telemetry = telemetry or Telemetry.off("prefill")
        self._tokens = [0, 0]  # prompt tokens, cached prompt tokens (for the cache hit ratio gauge)
        if cache is None:  # with a cache, its own page hit ratio (pdserve.telemetry.metrics.watch_prompt_cache)
            self.telemetry.metrics.gauge(
                "cache_hit_ratio",
                "Cached / prompt tokens of finished prefills",
                lambda: self._tokens[1] / max(1, self._tokens[0]),
            )
        engine = loop.engine
        self.fingerprint: str = engine.fingerprint
        self.model_config = engine.model_config
        self.page_size: int = engine.page_size
        self.max_model_len: int = engine.model_config.max_position_embeddings
        self._active = 0
        self._lock = threading.Lock()

    # ---- validation -------------------------------------------------------------------------------------
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
        return layout

    # ---- RPC ------------------------------------------------------------------------------------------
    def Prefill(self, request_iterator, context: grpc.ServicerContext):
        t0 = time.perf_counter()
        scope = self.telemetry.request("prefill.request", context)
        first = next(request_iterator, None)
        if first is None or not first.HasField("request"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first message must be a PrefillRequest")
        req = first.request
        layout = self._check_peer(req, context)  # the prompt, sampling and sampled_before: the engine checks them
        sampling = sampling_from_proto(req.sampling, self.max_model_len - len(req.prompt_token_ids))
        rid = req.request_id
        prompt = list(req.prompt_token_ids)
        num_pages = -(-len(prompt) // self.page_size)
        pages = SenderPages(rid, num_pages)
        outbox: queue.Queue = queue.Queue()
        released = threading.Event()
        kv_dtype = layout.dtype
        group_size = layout.group_size or None
        scope.set({"pdserve.request_id": rid, "pdserve.prompt_tokens": len(prompt), "pdserve.kv.dtype": kv_dtype})
        ns = CacheNamespace(self.fingerprint, layout)
        lookup_ns = time.time_ns()
        # prompt_logprobs score every prompt token: nothing may come from the cache
        hit = CacheLookup([], []) if sampling.prompt_logprobs else self._cache_lookup(ns, prompt)
        prompt_lps: list[float] = []  # sampling.prompt_logprobs, gathered chunk by chunk (engine thread)
        scope.record(
            "prefill.cache_lookup",
            lookup_ns,
            {
                "pdserve.cache.enabled": self.cache is not None,
                "pdserve.cache.pages_hit": hit.num_pages,
                "pdserve.cache.pages_miss": max(0, (len(prompt) - 1) // self.page_size - hit.num_pages),
                "pdserve.cache.local_hits": hit.local_hits,
            },
        )
        for p in hit.pages:  # shipped first, as stored (already in the layout decode asked for)
            outbox.put(p)

        def on_output(out) -> None:  # engine thread: export finished pages right after their chunk
            if isinstance(out, BaseException):
                outbox.put(out)
                return
            try:
                if out.finish_reason == "abort":
                    outbox.put(RuntimeError("prefill aborted"))
                    return
                prompt_lps.extend(out.prompt_logprobs)
                if scope.recording and out.token_range:  # this step computed one chunk of the prompt
                    scope.record(
                        "prefill.chunk",
                        self.loop.step_started_ns,
                        {
                            "pdserve.chunk.start": out.token_range[0],
                            "pdserve.chunk.end": out.token_range[1],
                            "pdserve.chunk.ready_pages": len(out.ready_pages),
                        },
                    )
                if out.ready_pages:
                    payloads = self.loop.engine.export_pages(
                        rid, out.ready_pages, kv_dtype, group_size=group_size, asymmetric=layout.asymmetric
                    )
                    for p in payloads:
                        outbox.put(p)
                        if self.cache is not None and p.page_index < len(hit.keys):  # a full page: share it
                            self.cache.put(ns, hit.keys[p.page_index], p)
                if out.finished:
                    outbox.put((_DONE, out))
            except Exception as e:
                outbox.put(e)

        def release() -> None:
            if not released.is_set():
                released.set()
                pages.free()
                self.loop.release(rid)

        context.add_callback(release)  # RPC ended for any reason (cancel, deadline, error, success)
        with self._lock:
            self._active += 1
        try:
            self.loop.add_request(
                rid,
                prompt,
                sampling,
                on_output,
                prefill_only=True,
                cached_pages=hit.pages or None,
                sampled_before=req.sampled_before,
            )
        except Exception as e:
            with self._lock:
                self._active -= 1
            context.abort(engine_error_code(e), f"prefill could not admit request: {e}")

        clock = AckClock()
        acks = threading.Thread(
            target=self._read_acks, args=(request_iterator, pages, clock, release), daemon=True, name=f"acks-{rid[:8]}"
        )
        acks.start()
        deadline = time.monotonic() + self.cfg.request_timeout_s
        ack_timeout = self.cfg.ack_timeout_s
        ship = None  # prefill.kv_ship span: first page shipped → PrefillDone
        try:
            while True:
                try:
                    item = outbox.get(timeout=max(0.01, min(1.0, ack_timeout, deadline - time.monotonic())))
                except queue.Empty:
                    item = None
                if clock.oldest_unacked_age() > ack_timeout:  # decode stopped storing pages: give them back
                    context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"decode acknowledged {clock.num_acked} of {clock.num_shipped} KV pages; page "
                        f"{clock.num_acked} unacknowledged after ack_timeout_s={ack_timeout}s",
                    )
                if item is None:
                    if not context.is_active():
                        return
                    if time.monotonic() > deadline:
                        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill exceeded request_timeout_s")
                    continue
                if isinstance(item, Exception):
                    context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {item}")
                if isinstance(item, tuple) and item[0] is _DONE:
                    out = item[1]
                    done = internal_pb2.PrefillDone(
                        first_token_id=out.new_token_ids[0],
                        num_pages=pages.num_shipped,
                        cached_tokens=hit.num_pages * self.page_size,
                        prefill_ms=(time.perf_counter() - t0) * 1e3,
                        prompt_logprobs=prompt_lps,
                    )
                    if out.logprobs:  # the first token's (sampling.logprobs / top_logprobs)
                        done.first_token_logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
                    self._record_done(scope, ship, pages, len(prompt), done)
                    yield internal_pb2.PrefillServerMessage(done=done)
                    log.info(
                        "prefill rid=%s prompt_tokens=%d cached_tokens=%d pages=%d bytes=%d kv=%s ms=%.1f",
                        rid,
                        len(prompt),
                        done.cached_tokens,
                        pages.num_shipped,
                        pages.bytes_shipped,
                        kv_dtype,
                        done.prefill_ms,
                    )
                    return
                if ship is None:
                    ship = scope.child("prefill.kv_ship", {"pdserve.kv.dtype": kv_dtype})
                try:
                    msg = encode_page(
                        item, request_id=rid, seq_no=pages.num_shipped, layout=layout, fingerprint=self.fingerprint
                    )
                    pages.ship(item.page_index, item.nbytes)
                    clock.shipped()
                except (InvalidRequest, TransferError) as e:
                    context.abort(grpc.StatusCode.INTERNAL, f"KV export failed: {e}")
                yield internal_pb2.PrefillServerMessage(page=msg)
        finally:
            with self._lock:
                self._active -= 1
            if ship is not None:
                scope.end_child(ship)  # no-op after PrefillDone; else the status the RPC ends with
            # Pages stay allocated until decode acks them all or the RPC ends (callback above).

    def _record_done(
        self, scope: RequestScope, ship, pages: SenderPages, prompt_tokens: int, done: internal_pb2.PrefillDone
    ) -> None:
        """Metrics and spans of a finished prefill (before PrefillDone is sent)."""
        self.telemetry.metrics.kv_bytes.inc(pages.bytes_shipped)
        with self._lock:
            self._tokens[0] += prompt_tokens
            self._tokens[1] += done.cached_tokens
        kv = {"pdserve.kv.pages": pages.num_shipped, "pdserve.kv.bytes": pages.bytes_shipped}
        if ship is not None:
            scope.end_child(ship, ok=True, attributes=kv)
        scope.first_token()
        scope.finish(
            1,
            "prefill_done",
            {**kv, "pdserve.cached_tokens": done.cached_tokens, "pdserve.first_token_id": done.first_token_id},
        )

    def _cache_lookup(self, ns: CacheNamespace, prompt: list[int]) -> CacheLookup:
        """Longest cached prefix of full pages, leaving at least the last prompt token to compute (it samples the
        first token). Store trouble is a miss, never an error."""
        if self.cache is None:
            return CacheLookup([], [])
        return self.cache.lookup(ns, prompt, max_pages=(len(prompt) - 1) // self.page_size)

    def _read_acks(self, request_iterator, pages: SenderPages, clock: AckClock, release) -> None:
        try:
            for msg in request_iterator:
                if msg.HasField("ack"):
                    pages.ack(msg.ack.seq_no)
                    clock.acked(msg.ack.seq_no)
                    if pages.all_acked():
                        release()
        except (grpc.RpcError, TransferError) as e:
            log.debug("ack stream ended: %s", e)
        except Exception:
            pass

    def Stats(self, request, context):
        used, total = self.loop.allocator.num_used, self.loop.allocator.num_pages
        with self._lock:
            active = self._active
        return internal_pb2.InstanceStats(
            kv_pages_total=total,
            kv_pages_free=total - used,
            active_requests=active,
            model_fingerprint=self.fingerprint,
            kv_dtype="auto",
            page_size=self.page_size,
        )
