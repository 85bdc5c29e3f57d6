"""Decode gRPC servicer, RPC glue: check the request, reserve its pages in the engine (`begin_import`), pull its KV
from the chosen prefill instance through its transfer (`pdserve.kv.transfer.for_decode`), then join the continuous
batch and relay the tokens (`token_stream`)."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator
from concurrent import futures
from concurrent.futures import Future

import grpc
import torch

from pdserve.decode.config import DecodeConfig
from pdserve.decode.prefill_channels import PrefillChannels
from pdserve.decode.token_stream import (
    ActiveCalls,
    CallerGone,
    EarlyFirst,
    PromptScores,
    StreamEnd,
    generate_call,
    relay,
)
from pdserve.engine.loop import EngineLoop
from pdserve.engine.sampling import SamplingParams
from pdserve.errors import InvalidRequest, PdserveError, PeerUnavailable, TransferError
from pdserve.kv.transfer import IncomingTransfer, for_decode
from pdserve.kv.transfer.handshake import ShardLayout
from pdserve.kv.transfer.layers import LayerRange
from pdserve.server.grpc_util import remaining
from pdserve.server.instance_stats import instance_stats
from pdserve.server.proto_convert import sampling_from_proto
from pdserve.server.security import ServiceSecurity
from pdserve.server.status import engine_error_code
from pdserve.telemetry.metrics import watch_kv_shipper
from pdserve.telemetry.service import RequestScope, Telemetry
from pdserve.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger("pdserve.decode")


def finish_stream(call, rid: str) -> None:
    """After PrefillDone: read the Prefill stream to its end on a thread. Prefill finishes its side after PrefillDone
    (decode's last acks, then its prompt-cache write-back); a call object dropped unread would be cancelled when
    collected, ending the RPC before that write-back."""

    def drain() -> None:
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass

    threading.Thread(target=drain, name=f"prefill-end-{rid[:8]}", daemon=True).start()


ReceiveKV = Generator[internal_pb2.DecodeResponse, None, internal_pb2.PrefillDone]
Mark = Callable[[str], None]  # a span event of the request (RequestScope.event)


class _Rest:
    """Between `_beside_first` and its reader thread: whether the early first token joined the request (the import
    finishes only after it), and the reader's outcome (PrefillDone, or what broke the stream)."""

    def __init__(self) -> None:
        self.done: Future = Future()
        self._decided = threading.Event()
        self._joined = False

    def emitted(self) -> None:
        self._joined = True
        self._decided.set()

    def abandoned(self) -> None:
        self._decided.set()

    def wait_emitted(self) -> bool:
        self._decided.wait()
        return self._joined


class _Reservation:
    """A Generate call's engine request: `submit` queues its page reservation (`begin_import`) once, `future` holds
    its outcome from then on (None before). Only a reservation this call made and the engine took is this call's
    to abort: a refused one's id (a duplicate) may be another call's."""

    def __init__(self, loop: EngineLoop, request_id: str, begin_import: Callable[[], Future]) -> None:
        self.loop, self.request_id, self._begin_import = loop, request_id, begin_import
        self.future: Future | None = None

    def submit(self) -> Future:
        if self.future is None:
            self.future = self._begin_import()
        return self.future

    def abort(self) -> None:
        """Abort its engine request, unless never submitted or refused (`EngineLoop.abort_admitted`)."""
        if self.future is not None:
            self.loop.abort_admitted(self.request_id, self.future)


class DecodeServicer(internal_pb2_grpc.DecodeServicer):
    def __init__(self, cfg: DecodeConfig, loop: EngineLoop, telemetry: Telemetry | None = None):
        self.cfg = cfg
        self.loop = loop
        self.telemetry = telemetry or Telemetry.off("decode")
        engine = loop.engine
        self.fingerprint: str = engine.fingerprint
        self.max_model_len: int = engine.model_config.max_position_embeddings
        self.layout = engine.pool_layout  # what this instance asks prefill instances to ship
        self.prefill = PrefillChannels(ServiceSecurity.of(cfg).channel())
        self.kv = for_decode(cfg, engine.runner.device, self.layout, self.fingerprint, ShardLayout.of(engine.runner))
        if self.kv.shipper is not None:
            watch_kv_shipper(self.telemetry.metrics, self.kv.shipper)
        self.active = ActiveCalls()
        # readers of Prefill streams after an early first token (`_beside_first`), one per call at most: threads kept
        # between requests, because Thread.start waits until the new thread runs, which it does only once it gets
        # the GIL, on the first token's way out
        self._readers = futures.ThreadPoolExecutor(max_workers=cfg.stream_limit(), thread_name_prefix="kv-rest")

    def Generate(self, request: internal_pb2.DecodeRequest, context: grpc.ServicerContext):
        t0 = time.perf_counter()
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        req = self.telemetry.request(
            "decode.request",
            context,
            {
                "pdserve.request_id": rid,
                "pdserve.prompt_tokens": len(prompt),
                "pdserve.prefill": request.prefill_target,
            },
        )
        self._check(request, context, req)
        resumed = request.resumed_tokens  # a failover resume: the prompt ends with this many generated tokens
        sampling = sampling_from_proto(request.sampling, self.max_model_len - (len(prompt) - resumed))
        outputs: queue.Queue = queue.Queue()
        reservation = _Reservation(
            self.loop, rid, functools.partial(self._begin_import, request, prompt, sampling, outputs, context)
        )
        if -(-len(prompt) // self.layout.page_size) > self.loop.allocator.num_free:
            # the pool lacks the pages now (read without a round trip): wait for the engine here, so that a full
            # pool answers RESOURCE_EXHAUSTED before any prefill work; else the Prefill stream opens first
            self._admitted(reservation.submit(), context)
        deadline = time.monotonic() + (remaining(context) or self.cfg.request_timeout_s)
        summary = functools.partial(self._summary, rid, len(prompt), t0)
        with generate_call(self.loop, rid, self.active, summary, context, reservation.abort) as end:
            early = EarlyFirst(outputs, context, deadline, req, end)
            early.forks = request.n > 1 or request.best_of > 1
            try:
                done = yield from self._receive_kv(request, prompt, context, req, early, reservation)
            except CallerGone:
                return
            except PdserveError as e:  # the transfer's errors, through the one status table
                context.abort(engine_error_code(e), str(e))
            if early.sent:  # the first token went out ahead of the pages (its logprob with it)
                if not end.finished:
                    yield from relay(outputs, context, deadline, "decode", req, done.cached_tokens, end)
                return
            # the first token's logprob and the prompt's came from prefill: they lead the first message (n > 1: the
            # forks sample their own first tokens here, prefill's is not used)
            forks = request.n > 1 or request.best_of > 1
            lead = [done.first_token_logprob] if done.HasField("first_token_logprob") and not forks else []
            scores = PromptScores(list(done.prompt_logprobs), list(done.prompt_top_logprobs))
            yield from relay(outputs, context, deadline, "decode", req, done.cached_tokens, end, lead, scores)

    def _begin_import(
        self,
        request: internal_pb2.DecodeRequest,
        prompt: list[int],
        sampling: SamplingParams,
        outputs: queue.Queue,
        context: grpc.ServicerContext,
    ) -> Future:
        """The request's page reservation, submitted to the engine loop, which runs it between decode steps or during
        a step's GPU wait; its Future."""
        try:
            return self.loop.begin_import(request.request_id, prompt, sampling, outputs.put, request.resumed_tokens,
                                          request.resumed_text_chars, request.n or 1, request.best_of)  # fmt: skip
        except Exception as e:
            context.abort(engine_error_code(e), f"decode could not admit request: {e}")
            raise  # unreachable: abort raises

    @staticmethod
    def _admitted(admitted: Future, context: grpc.ServicerContext) -> None:
        """Wait for the reservation; the engine's refusal ends the call with its status."""
        try:
            admitted.result()
        except Exception as e:
            context.abort(engine_error_code(e), f"decode could not admit request: {e}")

    @staticmethod
    def _check(request: internal_pb2.DecodeRequest, context: grpc.ServicerContext, req: RequestScope) -> None:
        """Wire-level checks only; the prompt, sampling and resume fields are the engine's to check (begin_import)."""
        if not request.prefill_target:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prefill_target is required")
        if not request.resumed_tokens and request.resumed_text_chars:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"resumed_text_chars {request.resumed_text_chars} given without resumed_tokens",
            )
        if request.resumed_tokens:
            req.set({"pdserve.resumed_tokens": request.resumed_tokens})

    @staticmethod
    def _summary(rid: str, prompt_tokens: int, t0: float, end: StreamEnd) -> None:
        fmt = "decode rid=%s prompt_tokens=%d completion_tokens=%d finish=%s ms=%.1f"
        log.info(fmt, rid, prompt_tokens, end.completion_tokens, end.finish, (time.perf_counter() - t0) * 1e3)

    # ---- the KV transfer ----------------------------------------------------------------------------------
    def _receive_kv(
        self,
        request: internal_pb2.DecodeRequest,
        prompt: list[int],
        context: grpc.ServicerContext,
        req: RequestScope,
        early: EarlyFirst,
        reservation: _Reservation,
    ) -> ReceiveKV:
        """Open the Prefill stream and hand its messages to the transfer; yields the first token's response when
        prefill sends it ahead of the pages (`early`). Returns PrefillDone, every page in the pool and the request's
        import finished (it joins the next decode step). `reservation`: submitted once the stream is open, so that
        the engine thread's work on it does not hold the GIL while the stream starts (its request-writer thread);
        its outcome is taken before the stream's first message: where it failed the stream is cancelled and the call
        ends with its status."""
        rid, target = request.request_id, request.prefill_target
        num_pages = -(-len(prompt) // self.layout.page_size)
        import_rows = functools.partial(self._import_rows, rid)
        rx = self.kv.open(rid, num_pages, reservation.abort, import_rows, target)
        span = req.child("decode.kv_receive", {"pdserve.prefill": target, "pdserve.kv.dtype": self.layout.dtype})
        ask = internal_pb2.PrefillRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=request.sampling,
            sampled_before=request.resumed_tokens,
            cache_scope=request.cache_scope,
            start_key=request.prefill_start_key,  # the router's head start there, taken over by this stream
        )
        timeout = remaining(context) or self.cfg.request_timeout_s
        call = self.prefill.prefill_stream(target)(
            rx.messages(ask), timeout=timeout, metadata=req.outgoing_metadata(span)
        )
        req.event("prefill_called")
        # our caller went away: stop prefill too, unless every page is in (prefill then ends its side: last acks,
        # the prompt-cache write-back after PrefillDone)
        if not context.add_callback(lambda: rx.pages.completed or call.cancel()):
            call.cancel()  # the caller went away before the callback was in place: it would never run
        rx.attach(call.cancel)
        try:
            # abort raises: the finally below closes the transfer (cancelling the call)
            self._admitted(reservation.submit(), context)
            req.event("admitted")
            done = yield from self._take(rx, call, early, target, req.event)
            finish_stream(call, rid)
            self.telemetry.metrics.kv_bytes.inc(rx.pages.bytes_received)
            pages = rx.pages.pages_claimed  # done.num_pages counts shipments: layer groups too
            attrs: dict[str, int | str] = {"pdserve.kv.pages": pages, "pdserve.kv.transport": rx.transport}
            attrs |= {"pdserve.kv.bytes": rx.pages.bytes_received, "pdserve.cached_tokens": done.cached_tokens}
            req.end_child(span, ok=True, attributes={**attrs, "pdserve.first_token_id": done.first_token_id})
            return done
        except grpc.RpcError as e:
            raise self._broken(e, rx, context) from None
        finally:
            rx.close()  # unless it completed: the pages freed, the stream ended
            req.end_child(span)  # no-op after success; else the status the RPC ends with

    def _take(self, rx: IncomingTransfer, call, early: EarlyFirst, target: str, mark: Mark) -> ReceiveKV:
        """The stream's messages up to PrefillDone, then the import finished (`_finish`); returns PrefillDone. A first
        token that comes ahead goes to the caller while a thread reads the rest (`_beside_first`). `mark`: the request
        span's events (prefill_done_read, import_finished, first_token_read)."""
        for raw in call:
            msg = rx.receive(raw)
            if msg is None:  # the transport choice or a batch: the transfer's
                continue
            if msg.HasField("done"):
                return self._finish(rx, msg.done, target, mark)
            if early.forks:  # n > 1: prefill's first token is not used (the forks sample their own)
                continue
            mark("first_token_read")
            return (yield from self._beside_first(rx, call, early, msg.first_token, target, mark))
        raise PeerUnavailable(f"prefill {rx.peer} ended without finishing")

    def _finish(
        self, rx: IncomingTransfer, done: internal_pb2.PrefillDone, target: str, mark: Mark
    ) -> internal_pb2.PrefillDone:
        """PrefillDone: every page checked in the pool (`rx.finish`), then the request joins the decode batch (after
        an early first token it joined as its last page landed: its token is only checked, also if it ended since)."""
        mark("prefill_done_read")
        rx.finish(done)
        try:
            self.loop.finish_import(rx.pages.request_id, done.first_token_id)
        except InvalidRequest as e:  # the prompt was checked at begin_import: prefill's answer is at fault
            raise TransferError(f"bad PrefillDone from {target}: {e}") from e
        mark("import_finished")
        return done

    def _beside_first(
        self,
        rx: IncomingTransfer,
        call,
        early: EarlyFirst,
        first: internal_pb2.PrefillFirstToken,
        target: str,
        mark: Mark,
    ) -> ReceiveKV:
        """A first token ahead of the pages: yielded to the caller while a thread reads the rest of the stream and
        finishes the import (`_rest`) as soon as PrefillDone is in and the token is in the engine. Prefill sends
        PrefillDone right after a last chunk's first token: read here, it would wait for that token's send to the
        router, and the first decode step with it."""
        rest = _Rest()
        self._readers.submit(self._rest, rx, call, target, rest, mark)
        try:
            try:
                yield from early.send(self.loop, rx.pages.request_id, first, on_emitted=rest.emitted)
            except InvalidRequest as e:  # outside the vocabulary, or the request cannot take it
                raise TransferError(f"bad first token from prefill: {e}") from e
        except BaseException:  # the caller left, or the token was refused: the reader stops and no import finishes
            call.cancel()
            rest.abandoned()
            futures.wait([rest.done], timeout=self.cfg.page_timeout_s)  # before the transfer closes under it
            raise
        return rest.done.result()

    def _rest(self, rx: IncomingTransfer, call, target: str, rest: _Rest, mark: Mark) -> None:
        """`_beside_first`'s thread: the stream's messages after the first token, to PrefillDone and `_finish`."""
        if not rest.done.set_running_or_notify_cancel():
            return
        try:
            for raw in call:
                msg = rx.receive(raw)
                if msg is None:
                    continue
                if not rest.wait_emitted():  # the first token never joined the request: nothing to finish
                    rest.done.set_result(None)
                    return
                if msg.HasField("done"):
                    rest.done.set_result(self._finish(rx, msg.done, target, mark))
                    return
                try:  # a second first token: the engine refuses it, as it would refuse a first one twice
                    self.loop.emit_first_token(rx.pages.request_id, msg.first_token.token_id)
                except InvalidRequest as e:
                    raise TransferError(f"bad first token from prefill: {e}") from e
            raise PeerUnavailable(f"prefill {rx.peer} ended without finishing")
        except BaseException as e:
            rest.done.set_exception(e)

    def _broken(self, e: grpc.RpcError, rx: IncomingTransfer, context: grpc.ServicerContext) -> Exception:
        """The Prefill stream failed: this end's reason (a bad batch, the page timeout), the caller gone (a
        cancellation, logged without a traceback), or else prefill's status relayed."""
        ours = rx.failure()
        if isinstance(ours, TransferError):  # a batch failed its checks and cancelled the call
            return ours
        if not context.is_active():
            n = rx.pages.next_seq_no
            log.info(
                "rid=%s caller went away during the KV transfer (%d pages received): %s",
                rx.pages.request_id,
                n,
                e.code(),
            )
            return CallerGone()
        if ours is not None:
            return ours
        code = e.code() if e.code() != grpc.StatusCode.CANCELLED else grpc.StatusCode.UNAVAILABLE
        context.abort(code, f"prefill {rx.peer}: {e.details()}")
        raise AssertionError("unreachable: abort raises")

    def _import_rows(
        self, rid: str, indexes: list[int], tokens: list[int], rows: torch.Tensor, layers: LayerRange | None
    ) -> Future:
        """A checked batch (all layers, or a layer group's) into the pool, on the engine thread (`ImportRows`)."""
        return self.loop.submit(lambda e: e.import_batch(rid, indexes, tokens, rows, self.layout, layers))

    def close(self) -> None:
        """Service shutdown: the channels to prefill instances, the copy threads, the stream readers (those still
        reading end with their streams)."""
        self.prefill.close()
        self.kv.close()
        self._readers.shutdown(wait=False)

    def Stats(self, request, context):
        return instance_stats(self.loop, self.active.count, self.kv.stats)
