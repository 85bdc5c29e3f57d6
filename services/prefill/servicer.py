"""Prefill gRPC servicer: chunked prefill, pages shipped to decode over the stream while later chunks compute."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.prompt_cache import CacheLookup, PromptCache
from pdserve.cache.serving import lookup_prefix, pages_to_write, write_back
from pdserve.cache.write_behind import WriteBehind
from pdserve.engine.loop import EngineLoop
from pdserve.engine.sampling import TokenLogprob
from pdserve.errors import InvalidRequest
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer import ExportedPages, SenderPages, TransferError
from pdserve.kv.transfer.cuda_ipc import IpcSender, IpcStaging, copier_for
from pdserve.kv.transfer.grpc_transport import GrpcSender
from pdserve.kv.transfer.handshake import CUDA_IPC, GRPC, choose, host_id
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.stats import TransferStats
from pdserve.prefill.ack_clock import AckClock
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.kv_link import SendLink
from pdserve.server.instance_stats import instance_stats
from pdserve.server.proto_convert import logprob_to_proto, prompt_logprobs_to_proto, sampling_from_proto
from pdserve.server.status import engine_error_code
from pdserve.telemetry.rates import WorkRate
from pdserve.telemetry.service import RequestScope, Telemetry
from pdserve.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger("pdserve.prefill")

_DONE = object()
_FIRST = object()  # outbox: the first token, streamed ahead of the last chunk's pages (first_token_early)


def _first_token_message(out, cached_tokens: int) -> internal_pb2.PrefillServerMessage:
    """PrefillFirstToken of the prompt's last StepOutput (its one sampled token)."""
    ft = internal_pb2.PrefillFirstToken(token_id=out.new_token_ids[0], cached_tokens=cached_tokens)
    if out.logprobs:
        ft.logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
    return internal_pb2.PrefillServerMessage(first_token=ft)


class PrefillServicer(internal_pb2_grpc.PrefillServicer):
    def __init__(
        self, cfg: PrefillConfig, loop: EngineLoop, telemetry: Telemetry | None = None, cache: PromptCache | None = None
    ):
        self.cfg = cfg
        self.loop = loop
        self.cache = cache  # prompt cache (None: off); counters: cache.hits, .misses, .local_hits, .corrupt, ...
        # a finished request's pages go to the cache from here, while this instance computes and ships nothing
        self.write_behind = (
            None
            if cache is None
            else WriteBehind(
                self._busy,
                int(cfg.cache_write_behind_mb * (1 << 20)),
                cfg.cache_write_wait_s,
                on_drop=lambda pages: cache.stats.add(write_drops=pages),
            )
        )
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
        self.device = engine.runner.device
        self.transfer_stats = TransferStats()  # per transport: requests, pages, bytes, seconds, fallbacks
        self._host_id = host_id()
        self._staging: IpcStaging | None = None  # cuda-ipc: registered on the first request that may use it
        self._staging_error = ""
        # grpc transport: batch messages built ahead of the stream writer (GrpcSender)
        self.kv_build_pool = (
            ThreadPoolExecutor(cfg.kv_copy_threads, thread_name_prefix="kv-build") if cfg.kv_copy_threads else None
        )
        self.prefill_rate = WorkRate()  # prompt tokens per busy second of the engine (Stats; cache decisions)

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
        assert first is not None  # context.abort raised otherwise
        req = first.request
        layout = self._check_peer(req, context)  # the prompt, sampling and sampled_before: the engine checks them
        sampling = sampling_from_proto(req.sampling, self.max_model_len - len(req.prompt_token_ids))
        rid = req.request_id
        prompt = list(req.prompt_token_ids)
        num_pages = -(-len(prompt) // self.page_size)
        link = self._open_link(req, context, rid, num_pages, layout)  # the transport agreed with this decode
        pages = link.pages
        outbox: queue.Queue = queue.Queue()
        released = threading.Event()
        kv_dtype = layout.dtype
        scope.set({"pdserve.request_id": rid, "pdserve.prompt_tokens": len(prompt), "pdserve.kv.dtype": kv_dtype})
        ns = CacheNamespace(self.fingerprint, layout, req.cache_scope)  # the router's scope: tenant or shared
        lookup_ns = time.time_ns()
        # prompt_logprobs score every prompt token: nothing may come from the pool's prefixes or the cache
        reuse = self.cfg.prefix_reuse and not sampling.prompt_logprobs
        prefix_keys = ns.page_keys(prompt) if reuse else []
        max_reuse = (len(prompt) - 1) // self.page_size  # the last prompt token is always computed
        in_pool = self.loop.engine.prefix_pages_held(prefix_keys[:max_reuse]) if prefix_keys else 0
        hit = (
            CacheLookup([], [])
            if sampling.prompt_logprobs or (in_pool and in_pool == max_reuse)  # the pool holds all it may serve
            else lookup_prefix(self.cache, ns, prompt, self.page_size, self.prefill_rate.rate(), prefix_keys or None)
        )
        pool_pages = in_pool if in_pool and in_pool >= hit.num_pages else 0  # beats a copy of the same prefix
        if pool_pages:
            hit = CacheLookup(hit.keys, [], 0, hit.decision)
        computed_from = [0]  # engine thread: the first prompt token this request computed (the rest was reused)
        prompt_lps: list[TokenLogprob] = []  # sampling.prompt_logprobs, gathered chunk by chunk (engine thread)
        scope.record(
            "prefill.cache_lookup",
            lookup_ns,
            {
                "pdserve.cache.enabled": self.cache is not None,
                "pdserve.cache.pages_hit": hit.num_pages,  # from the prompt cache's tiers
                "pdserve.cache.pool_pages": pool_pages,  # the pool's own prefix (admission may find fewer)
                "pdserve.cache.pages_miss": max(0, max_reuse - hit.num_pages - pool_pages),
                "pdserve.cache.local_hits": hit.local_hits,
                **(hit.decision.attributes() if hit.decision is not None else {}),
            },
        )
        # The cached prefix ships as stored: the exact cached bytes (the pool may hold them at another precision).
        # A host transport sends the host copies now, beside the compute. A device-to-device one sends the device
        # copy the engine's import makes (one host pass in all), with the first chunk.
        upload_first = bool(hit.pages) and link.sender.device_to_device
        if hit.pages and not upload_first:
            rows = PageFormat(layout).rows_from_payloads(hit.pages)
            outbox.put(ExportedPages(list(range(hit.num_pages)), [p.num_tokens for p in hit.pages], rows))
        upload_pending = [True] if upload_first else []  # engine thread: the upload is still to be shipped
        # prompt logprobs lead decode's first response and come with PrefillDone: no early first token then
        early_first = req.first_token_early and not sampling.prompt_logprobs
        first_ready: list = []  # engine thread -> writer: the prompt's last output, once (early_first)
        first_sent = [False]

        def first_token_now() -> Iterator[internal_pb2.PrefillServerMessage]:
            """Writer: the early first token, if it is ready and not sent yet."""
            if first_ready and not first_sent[0]:
                first_sent[0] = True
                yield _first_token_message(first_ready[0], max(0, computed_from[0]))

        def on_output(out) -> None:  # engine thread: export finished pages right after their chunk
            if isinstance(out, BaseException):
                outbox.put(out)
                return
            try:
                if out.finish_reason == "abort":
                    outbox.put(RuntimeError("prefill aborted"))
                    return
                prompt_lps.extend(out.prompt_logprobs)
                if out.token_range and not computed_from[0]:
                    computed_from[0] = out.token_range[0] or -1  # -1: computed from the start
                if out.token_range:  # step start .. now (its outputs are dispatched right after it)
                    start = self.loop.step_started_ns
                    n = out.token_range[1] - out.token_range[0]
                    self.prefill_rate.add_to_step(start, n, start / 1e9, time.time_ns() / 1e9)
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
                if upload_pending and out.token_range:  # the step that imported the prefix ran its first chunk
                    upload_pending.clear()
                    if out.token_range[0] > 0:  # else preempted before the import: recomputed, in ready_pages
                        outbox.put(self._cached_batch(rid, hit, layout))
                if out.finished and early_first:  # decode streams it while the pages below are on their way
                    first_ready.append(out)  # the writer takes it between an earlier chunk's messages too
                    outbox.put((_FIRST, out))
                if out.ready_pages:  # one device gather per chunk; the writer ships it
                    outbox.put(self.loop.engine.export_batch(rid, out.ready_pages, layout))
                if out.finished:
                    outbox.put((_DONE, out))
            except Exception as e:
                outbox.put(e)

        def release() -> None:  # pages not all acknowledged by now are abandoned: freed here
            if not released.is_set():
                released.set()
                link.sender.close()

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
                keep_cached_upload=upload_first,
                prefix_keys=prefix_keys or None,
            )
        except Exception as e:
            with self._lock:
                self._active -= 1
            context.abort(engine_error_code(e), f"prefill could not admit request: {e}")
        # Only once admitted is `rid` this call's in the engine: a rejected duplicate id must never free the engine
        # request of the same id that another call holds.
        if not context.add_callback(release):  # RPC ended for any reason (cancel, deadline, error, success)
            release()  # ... already

        clock = AckClock()
        acks = threading.Thread(
            target=self._read_acks, args=(request_iterator, link, clock), daemon=True, name=f"acks-{rid[:8]}"
        )
        acks.start()
        deadline = time.monotonic() + self.cfg.request_timeout_s
        ack_timeout = self.cfg.ack_timeout_s
        ship = None  # prefill.kv_ship span: first page shipped → PrefillDone
        to_cache: list[ExportedPages] = []  # shipped batches, written to the prompt cache after PrefillDone
        try:
            # Inside the try: a stream cancelled at its first message still gives back its `_active` count.
            yield internal_pb2.PrefillServerMessage(transport=link.choice)
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
                if isinstance(item, tuple) and item[0] is _FIRST:
                    yield from first_token_now()  # unless it went out between an earlier chunk's batches
                    continue
                if isinstance(item, tuple) and item[0] is _DONE:
                    out = item[1]
                    prompt_values, prompt_tops = prompt_logprobs_to_proto(prompt_lps)
                    done = internal_pb2.PrefillDone(
                        first_token_id=out.new_token_ids[0],
                        num_pages=pages.num_shipped,
                        cached_tokens=max(0, computed_from[0]),  # from the prompt cache or the pool
                        prefill_ms=(time.perf_counter() - t0) * 1e3,
                        prompt_logprobs=prompt_values,
                        prompt_top_logprobs=prompt_tops,
                    )
                    if out.logprobs:  # the first token's (sampling.logprobs / top_logprobs)
                        done.first_token_logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
                    self._record_done(scope, ship, pages, len(prompt), done)
                    # Decode reads the stream in order: every batch before PrefillDone is fetched and acked before
                    # decode acts on it. So PrefillDone goes now, and the RPC stays open until what the sender still
                    # holds for decode is acked (cuda-ipc: staging regions; grpc: nothing).
                    yield internal_pb2.PrefillServerMessage(done=done)
                    try:
                        link.sender.drain(max(0.0, min(ack_timeout, deadline - time.monotonic())))
                    except TimeoutError as e:
                        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"decode did not acknowledge KV: {e}")
                    if self.write_behind is not None:  # off the first token's path: decode has every page already
                        keys = hit.keys or prefix_keys  # hit.keys: none when the pool made the lookup moot
                        self._write_behind(ns, keys, max(0, computed_from[0]) // self.page_size, to_cache, layout)
                    log.info(
                        "prefill rid=%s prompt_tokens=%d cached_tokens=%d pages=%d bytes=%d kv=%s transport=%s ms=%.1f",
                        rid,
                        len(prompt),
                        done.cached_tokens,
                        pages.num_shipped,
                        pages.bytes_shipped,
                        kv_dtype,
                        link.sender.transport,
                        done.prefill_ms,
                    )
                    return
                if ship is None:
                    self._await_transport(link, context, layout)  # cuda-ipc: decode opened the buffer (or grpc)
                    ship = scope.child(
                        "prefill.kv_ship", {"pdserve.kv.dtype": kv_dtype, "pdserve.kv.transport": link.sender.transport}
                    )
                try:
                    msgs = link.sender.send(item)
                except TimeoutError as e:
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"KV transfer stalled: {e}")
                except (InvalidRequest, TransferError, ValueError, RuntimeError) as e:
                    context.abort(grpc.StatusCode.INTERNAL, f"KV transfer failed ({link.sender.transport}): {e}")
                for _ in item.page_indexes:
                    clock.shipped()
                for m in msgs:  # an earlier chunk's batches: the first token overtakes the rest of them
                    yield m
                    yield from first_token_now()
                to_cache.append(item)
        finally:
            with self._lock:
                self._active -= 1
            if ship is not None:
                scope.end_child(ship)  # no-op after PrefillDone; else the status the RPC ends with
            # Pages stay allocated until decode acks them all or the RPC ends (callback above).

    def _cached_batch(self, rid: str, hit: CacheLookup, layout: KVLayoutSpec) -> ExportedPages:
        """Engine thread, after the prefix's import: the cached prefix as one batch, packed on the device from the
        engine's upload (host rows if the import kept none: pages of mixed formats)."""
        engine, fmt = self.loop.engine, PageFormat(layout)
        up = engine.take_cached_upload(rid)
        indexes, num_tokens = list(range(hit.num_pages)), [p.num_tokens for p in hit.pages]
        if up is None:
            return ExportedPages(indexes, num_tokens, fmt.rows_from_payloads(hit.pages))
        rows = fmt.pack(up.data, up.scales, up.zeros)  # uint8 [N, page_bytes] on the device
        return ExportedPages(indexes, num_tokens, rows, engine.runner.record_event())

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

    def _read_acks(self, request_iterator, link: SendLink, clock: AckClock) -> None:
        """Decode's messages after the request: acks (the last one frees the pages) and transport readiness."""
        try:
            for msg in request_iterator:
                if msg.HasField("ack"):
                    clock.acked(msg.ack.seq_no)
                    link.sender.ack(msg.ack.seq_no)
                elif msg.HasField("transport_ready"):
                    link.set_ready(msg.transport_ready)
        except (grpc.RpcError, TransferError) as e:
            log.debug("ack stream ended: %s", e)
        except Exception:
            log.exception("ack reader failed")
        finally:
            link.set_ready(None)  # a writer still waiting for readiness stops waiting
            link.sender.acks_ended()  # ... and one draining stops waiting for acks

    # ---- KV transport -----------------------------------------------------------------------------------
    def _staging_unavailable(self) -> str:
        """Register the cuda-ipc staging buffer once; "" when it serves, else why not."""
        with self._lock:
            if self._staging is None and not self._staging_error:
                try:
                    nbytes = int(self.cfg.kv_ipc_staging_mb * 2**20)
                    self._staging = IpcStaging(copier_for(self.device), nbytes)
                    log.info("cuda-ipc staging buffer: %d MiB on %s", nbytes >> 20, self.device)
                except Exception as e:
                    self._staging_error = f"staging buffer registration failed: {e}"
                    log.warning("cuda-ipc unusable: %s", self._staging_error)
            return self._staging_error

    def _open_link(self, req, context, rid: str, num_pages: int, layout: KVLayoutSpec) -> SendLink:
        """Pick the transport for this request (decode's offer, --kv-transport) and make its sender."""
        offer = req.kv_transport if req.HasField("kv_transport") else None
        mode = self.cfg.kv_transport
        may_ipc = mode == CUDA_IPC or (
            mode == "auto" and offer is not None and CUDA_IPC in offer.transports and offer.host_id == self._host_id
        )
        choice = choose(offer, mode, self._host_id, self.device.type, self._staging_unavailable() if may_ipc else "")
        if choice.error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, choice.error)
        if choice.fallback:
            self.transfer_stats.add(CUDA_IPC, fallbacks=1)
            log.warning("rid=%s kv transport: grpc instead of cuda-ipc (%s)", rid, choice.reason)
        forced = mode == CUDA_IPC or (offer is not None and offer.forced and list(offer.transports) == [CUDA_IPC])
        pages = SenderPages(rid, num_pages, free=lambda: self.loop.release(rid))
        link = SendLink(choice, pages, forced, self._staging if choice.transport == CUDA_IPC else None)
        link.sender = self._new_sender(choice.transport, pages, layout)
        return link

    def _new_sender(self, transport: str, pages: SenderPages, layout: KVLayoutSpec):
        args = (pages, layout, self.fingerprint, self.transfer_stats)
        if transport == CUDA_IPC:
            assert self._staging is not None
            return IpcSender(
                *args,
                max_batch_bytes=self._staging.nbytes,
                staging=self._staging,
                reserve_timeout=self.cfg.ack_timeout_s,
            )
        return GrpcSender(
            *args,
            max_batch_bytes=int(self.cfg.kv_batch_mb * 2**20),
            pool=self.kv_build_pool,
            lookahead=self.cfg.kv_copy_threads,
        )

    def _await_transport(self, link: SendLink, context, layout: KVLayoutSpec) -> None:
        """Before the first batch on cuda-ipc: decode must have opened the buffer; if it could not, this request
        ships over grpc (counted, logged), unless cuda-ipc was forced (FAILED_PRECONDITION)."""
        if link.sender.transport != CUDA_IPC:
            return
        ready = link.wait_ready(self.cfg.ack_timeout_s)
        if ready is not None and ready.ok:
            return
        if ready is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "decode did not confirm the cuda-ipc buffer")
            return
        if link.forced:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"kv transport cuda-ipc forced but decode cannot use it: {ready.reason}",
            )
        self.transfer_stats.add(CUDA_IPC, fallbacks=1)
        log.warning("rid=%s kv transport: grpc instead of cuda-ipc (decode: %s)", link.pages.request_id, ready.reason)
        link.sender = self._new_sender(GRPC, link.pages, layout)

    def _busy(self) -> bool:
        """Whether this instance computes or ships anything now (any thread; the write-behind waits it out)."""
        with self._lock:
            active = self._active
        return active > 0 or self.loop.engine.has_unfinished_requests()

    def _write_behind(
        self, ns: CacheNamespace, keys: list[bytes], first_page: int, batches: list[ExportedPages], layout
    ) -> None:
        """Queue the request's write-back. Its batches' device rows stay held until it ran (counted against
        --cache-write-behind-mb); their pinned host copies (grpc) are let go now, so the next request's send reuses
        that pinned memory instead of pinning more (the job copies the rows to the host again, when idle)."""
        assert self.cache is not None and self.write_behind is not None
        cache = self.cache
        for b in batches:
            if b.rows.device.type == "cuda":
                b.host = None
        pages, nbytes = pages_to_write(keys, first_page, batches)
        if pages:
            self.write_behind.submit(
                lambda wait_idle: write_back(cache, ns, keys, first_page, batches, layout, wait_idle), pages, nbytes
            )

    def close(self) -> None:
        """Service shutdown: release the staging buffer (its shared-memory file on CPU)."""
        if self.write_behind is not None:
            self.write_behind.close()
        if self._staging is not None:
            self._staging.close()
        if self.kv_build_pool is not None:
            self.kv_build_pool.shutdown(wait=False, cancel_futures=True)

    def Stats(self, request, context):
        with self._lock:
            active = self._active
        rate = self.prefill_rate.rate() or 0.0
        return instance_stats(self.loop, active, self.transfer_stats, prefill_tokens_per_s=rate)


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
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.Prefill", handlers),))
