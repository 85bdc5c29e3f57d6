"""Decode gRPC servicer: pulls KV pages from the chosen prefill instance, then joins the continuous batch."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc

from pdserve.decode.config import DecodeConfig
from pdserve.decode.token_stream import (
    ActiveCalls,
    CallerGone,
    EarlyFirst,
    PromptScores,
    StreamEnd,
    generate_call,
    relay,
)
from pdserve.decode.watchdog import Watchdog
from pdserve.engine.loop import EngineLoop
from pdserve.errors import CorruptPage, InvalidRequest
from pdserve.kv.transfer import KVReceiver, ReceiverPages, TransferError
from pdserve.kv.transfer.cuda_ipc import IpcBufferCache, IpcReceiver, copier_for
from pdserve.kv.transfer.grpc_transport import GrpcReceiver
from pdserve.kv.transfer.handshake import CUDA_IPC, GRPC, make_offer
from pdserve.kv.transfer.stats import TransferStats
from pdserve.kv.transfer.wire import BatchExpectation, parse_server_message
from pdserve.server.grpc_util import channel, remaining
from pdserve.server.instance_stats import instance_stats
from pdserve.server.proto_convert import sampling_from_proto
from pdserve.server.security import ChannelSecurity, ServiceSecurity
from pdserve.server.status import engine_error_code
from pdserve.telemetry.service import RequestScope, Telemetry
from pdserve.v1 import internal_pb2, internal_pb2_grpc, kv_pb2

log = logging.getLogger("pdserve.decode")

_END = object()


class PrefillChannels:
    """One channel per prefill target, created on first use and reused; `security`: this decode's internal identity
    (None: the environment's)."""

    def __init__(self, security: ChannelSecurity | None = None):
        self.security = security
        self._lock = threading.Lock()
        self._stubs: dict[str, internal_pb2_grpc.PrefillStub] = {}
        self._raw: dict[str, grpc.StreamStreamMultiCallable] = {}
        self._channels: list[grpc.Channel] = []

    def stub(self, target: str) -> internal_pb2_grpc.PrefillStub:
        with self._lock:
            if target not in self._stubs:
                ch = channel(target, self.security)
                self._channels.append(ch)
                self._stubs[target] = internal_pb2_grpc.PrefillStub(ch)
                # the Prefill stream with its responses left as bytes (KV batches are parsed without copies)
                self._raw[target] = ch.stream_stream(
                    "/pdserve.v1.Prefill/Prefill",
                    request_serializer=internal_pb2.PrefillClientMessage.SerializeToString,
                    response_deserializer=None,
                )
            return self._stubs[target]

    def prefill_stream(self, target: str) -> grpc.StreamStreamMultiCallable:
        self.stub(target)
        with self._lock:
            return self._raw[target]

    def close(self) -> None:
        for ch in self._channels:
            ch.close()


class DecodeServicer(internal_pb2_grpc.DecodeServicer):
    def __init__(self, cfg: DecodeConfig, loop: EngineLoop, telemetry: Telemetry | None = None):
        self.cfg = cfg
        self.loop = loop
        self.telemetry = telemetry or Telemetry.off("decode")
        engine = loop.engine
        mc = engine.model_config
        self.fingerprint: str = engine.fingerprint
        self.max_model_len: int = mc.max_position_embeddings
        self.layout = engine.pool_layout  # what this instance asks prefill instances to ship
        self.prefill = PrefillChannels(ServiceSecurity.of(cfg).channel())
        self.device = engine.runner.device
        self.transfer_stats = TransferStats()  # per transport: requests, pages, bytes, seconds, fallbacks
        self.kv_offer = make_offer(cfg.kv_transport, self.device)  # what this instance can receive
        self.ipc_buffers = IpcBufferCache(copier_for(self.device))  # prefill staging buffers, opened once each
        # arriving KV batches are checked and copied here while the stream's reader takes the next one
        self.kv_copy_pool = (
            ThreadPoolExecutor(cfg.kv_copy_threads, thread_name_prefix="kv-copy") if cfg.kv_copy_threads else None
        )
        self.active = ActiveCalls()

    def Generate(self, request: internal_pb2.DecodeRequest, context: grpc.ServicerContext):
        t0 = time.perf_counter()
        rid = request.request_id
        req = self.telemetry.request(
            "decode.request",
            context,
            {
                "pdserve.request_id": rid,
                "pdserve.prompt_tokens": len(request.prompt_token_ids),
                "pdserve.prefill": request.prefill_target,
            },
        )
        prompt = list(request.prompt_token_ids)
        # Wire-level checks only; the prompt, sampling and resume fields are the engine's to check (begin_import).
        if not request.prefill_target:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prefill_target is required")
        resumed = request.resumed_tokens  # a failover resume: the prompt ends with this many generated tokens
        if not resumed and request.resumed_text_chars:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"resumed_text_chars {request.resumed_text_chars} given without resumed_tokens",
            )
        if resumed:
            req.set({"pdserve.resumed_tokens": resumed})
        sampling = sampling_from_proto(request.sampling, self.max_model_len - (len(prompt) - resumed))

        outputs: queue.Queue = queue.Queue()
        try:
            self.loop.begin_import(rid, prompt, sampling, outputs.put, resumed, request.resumed_text_chars)
        except Exception as e:
            context.abort(engine_error_code(e), f"decode could not admit request: {e}")

        def summary(end: StreamEnd) -> None:
            fmt = "decode rid=%s prompt_tokens=%d completion_tokens=%d finish=%s ms=%.1f"
            log.info(fmt, rid, len(prompt), end.completion_tokens, end.finish, (time.perf_counter() - t0) * 1e3)

        deadline = time.monotonic() + (remaining(context) or self.cfg.request_timeout_s)
        with generate_call(self.loop, rid, self.active, summary) as end:
            early = EarlyFirst(outputs, context, deadline, req, end)
            try:
                first, cached, done = yield from self._receive_kv(request, prompt, context, req, early)
            except CallerGone:
                return
            try:
                self.loop.finish_import(rid, first)
            except InvalidRequest as e:  # the prompt was checked at begin_import: prefill's answer is at fault
                context.abort(grpc.StatusCode.DATA_LOSS, f"bad PrefillDone from {request.prefill_target}: {e}")
            if early.sent:  # the first token went out ahead of the pages (its logprob with it)
                if not end.finished:
                    yield from relay(outputs, context, deadline, "decode", req, cached, end)
                return
            # the first token's logprob and the prompt's came from prefill: they lead the first message
            lead = [done.first_token_logprob] if done.HasField("first_token_logprob") else []
            scores = PromptScores(list(done.prompt_logprobs), list(done.prompt_top_logprobs))
            yield from relay(outputs, context, deadline, "decode", req, cached, end, lead, scores)

    def _receive_kv(
        self,
        request: internal_pb2.DecodeRequest,
        prompt: list[int],
        context: grpc.ServicerContext,
        req: RequestScope,
        early: EarlyFirst,
    ) -> Generator[internal_pb2.DecodeResponse, None, tuple[int, int, internal_pb2.PrefillDone]]:
        """Open the Prefill stream, agree on the transport, store batches as they arrive and ack them; yields the
        first token's response when prefill sends it ahead of the pages (`early`). Returns (first token, cached
        tokens, PrefillDone)."""
        rid = request.request_id
        pages = ReceiverPages(rid, -(-len(prompt) // self.layout.page_size), free=lambda: self.loop.abort(rid))
        acks: queue.Queue = queue.Queue()
        first = internal_pb2.PrefillClientMessage(
            request=internal_pb2.PrefillRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling=request.sampling,
                kv_layout=self.layout.to_proto(),
                model_fingerprint=self.fingerprint,
                sampled_before=request.resumed_tokens,
                cache_scope=request.cache_scope,
                first_token_early=self.cfg.first_token_early,
                kv_transport=self.kv_offer,
            )
        )

        def client_messages():
            yield first
            while True:
                item = acks.get()
                if item is _END:
                    return
                yield item

        timeout = remaining(context) or self.cfg.request_timeout_s
        span = req.child(
            "decode.kv_receive", {"pdserve.prefill": request.prefill_target, "pdserve.kv.dtype": self.layout.dtype}
        )
        call = self.prefill.prefill_stream(request.prefill_target)(
            client_messages(), timeout=timeout, metadata=req.outgoing_metadata(span)
        )
        context.add_callback(call.cancel)  # our caller went away: stop prefill too
        watchdog = Watchdog(self.cfg.page_timeout_s, call.cancel, name=f"pages-{rid[:8]}")
        receiver: KVReceiver | None = None

        def fail(code: grpc.StatusCode, message: str):
            pages.fail()
            call.cancel()
            context.abort(code, message)

        pending: deque[Future] = deque()  # batches being checked and copied, in stream order

        def batch_done(f: Future) -> None:
            """A batch is in the pool's queue: acknowledge it now (cumulative acks: their order does not matter),
            so prefill may reuse what it held even while no message arrives here. A failed batch cancels the
            call, which wakes the reader below to report it."""
            if f.exception() is None:
                acks.put(internal_pb2.PrefillClientMessage(ack=internal_pb2.KVAck(seq_no=f.result())))
                pages.acked()
            else:
                call.cancel()

        def check_batches(block: bool) -> None:
            """Drop the leading finished batches (wait for all with `block`); raises the first one's error."""
            while pending and (block or pending[0].done()):
                pending.popleft().result(self.cfg.page_timeout_s)

        def batch_error() -> BaseException | None:
            return next((f.exception() for f in pending if f.done() and f.exception() is not None), None)

        try:
            for raw in call:
                watchdog.feed()
                try:
                    msg, header, payload = parse_server_message(raw)
                    if msg is not None and msg.HasField("transport"):
                        if receiver is not None:
                            raise TransferError("second transport choice on one stream")
                        receiver = self._open_receiver(msg.transport, pages, rid, acks, fail)
                        continue
                    if msg is not None and msg.HasField("done"):
                        break
                    if msg is not None and msg.HasField("first_token"):
                        if not self.cfg.first_token_early or early.sent:
                            raise TransferError("first token sent early unasked, or twice")
                        yield from early.send(self.loop, rid, msg.first_token)
                        continue
                    if receiver is None:
                        raise TransferError("KV batch before the transport choice")
                    if header is not None:
                        batch = receiver.receive_async(header, payload)
                    elif msg is not None and msg.HasField("ipc_batch"):
                        batch = receiver.receive_async(msg.ipc_batch.header, msg.ipc_batch)
                    else:
                        raise TransferError(
                            f"unexpected message from prefill: {msg.WhichOneof('msg') if msg else None}"
                        )
                    pending.append(batch)
                    batch.add_done_callback(batch_done)
                    check_batches(block=False)
                except (TransferError, CorruptPage, InvalidRequest) as e:  # damaged, out of order or not ours
                    fail(grpc.StatusCode.DATA_LOSS, f"bad KV batch from prefill: {e}")
            else:
                fail(grpc.StatusCode.UNAVAILABLE, f"prefill {request.prefill_target} ended without finishing")
            assert msg is not None  # the loop broke on PrefillDone
            done = msg.done
            if receiver is None:
                fail(grpc.StatusCode.DATA_LOSS, "PrefillDone before the transport choice")
                raise AssertionError("unreachable: abort raises")
            try:
                check_batches(block=True)  # every batch before PrefillDone: checked and in the pool's queue
            except (TransferError, CorruptPage, InvalidRequest) as e:
                fail(grpc.StatusCode.DATA_LOSS, f"bad KV batch from prefill: {e}")
            except TimeoutError:
                fail(grpc.StatusCode.DEADLINE_EXCEEDED, f"KV batches not stored within {self.cfg.page_timeout_s}s")
            try:
                receiver.finish(done.num_pages, self.cfg.page_timeout_s)
            except (TransferError, InvalidRequest) as e:
                fail(grpc.StatusCode.DATA_LOSS, str(e))
            self.telemetry.metrics.kv_bytes.inc(pages.bytes_received)
            req.end_child(
                span,
                ok=True,
                attributes={
                    "pdserve.kv.pages": done.num_pages,
                    "pdserve.kv.bytes": pages.bytes_received,
                    "pdserve.kv.transport": receiver.transport,
                    "pdserve.cached_tokens": done.cached_tokens,
                    "pdserve.first_token_id": done.first_token_id,
                },
            )
            return done.first_token_id, done.cached_tokens, done
        except grpc.RpcError as e:
            pages.fail()
            bad = batch_error()
            if bad is not None:  # a batch failed its checks and cancelled the call
                context.abort(grpc.StatusCode.DATA_LOSS, f"bad KV batch from prefill: {bad}")
            if not context.is_active():  # a cancellation, not an error: no traceback
                log.info(
                    "rid=%s caller went away during the KV transfer (%d pages received): %s",
                    rid,
                    pages.next_seq_no,
                    e.code(),
                )
                raise CallerGone from None
            if watchdog.expired:
                context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no KV page from prefill {request.prefill_target} "
                    f"within page_timeout_s={self.cfg.page_timeout_s}s ({pages.next_seq_no} pages received)",
                )
            code = e.code() if e.code() != grpc.StatusCode.CANCELLED else grpc.StatusCode.UNAVAILABLE
            context.abort(code, f"prefill {request.prefill_target}: {e.details()}")
            raise  # unreachable: abort raises
        finally:
            watchdog.stop()
            acks.put(_END)
            if receiver is not None and not pages.completed:
                receiver.fail()
            req.end_child(span)  # no-op after success; else the status the RPC ends with

    def _open_receiver(self, choice, pages: ReceiverPages, rid: str, acks: queue.Queue, fail) -> KVReceiver:
        """The receiver for prefill's choice. cuda-ipc: open its buffer (once per buffer) and answer
        KVTransportReady; if it cannot be opened, grpc for this request (counted, logged) unless forced."""
        layout = self.layout

        def import_rows(indexes: list[int], tokens: list[int], rows):
            return self.loop.submit(lambda e: e.import_batch(rid, indexes, tokens, rows, layout))

        args = (pages, BatchExpectation(layout, self.fingerprint, rid), self.transfer_stats, self.device, import_rows)
        if choice.transport == GRPC:
            return self._with_pool(GrpcReceiver(*args))
        if choice.transport != CUDA_IPC:
            raise TransferError(f"prefill chose unknown kv transport {choice.transport!r}")
        try:
            self.ipc_buffers.get(choice.ipc_buffer)
        except Exception as e:
            reason = f"cannot open prefill's {choice.ipc_buffer.kind} buffer: {e}"
            if self.cfg.kv_transport == CUDA_IPC:
                fail(grpc.StatusCode.FAILED_PRECONDITION, f"kv transport cuda-ipc forced but unusable: {reason}")
            self.transfer_stats.add(CUDA_IPC, fallbacks=1)
            log.warning("rid=%s kv transport: grpc instead of cuda-ipc (%s)", rid, reason)
            acks.put(
                internal_pb2.PrefillClientMessage(transport_ready=kv_pb2.KVTransportReady(ok=False, reason=reason))
            )
            return self._with_pool(GrpcReceiver(*args))
        acks.put(internal_pb2.PrefillClientMessage(transport_ready=kv_pb2.KVTransportReady(ok=True)))
        return self._with_pool(IpcReceiver(*args, buffers=self.ipc_buffers, buffer_id=choice.ipc_buffer.buffer_id))

    def _with_pool(self, receiver: KVReceiver) -> KVReceiver:
        receiver.pool = self.kv_copy_pool  # batches checked and copied while the stream's reader takes the next
        return receiver

    def Stats(self, request, context):
        return instance_stats(self.loop, self.active.count, self.transfer_stats)
