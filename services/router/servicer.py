"""Router: the public Generation service. Tokenize, validate, score PCS, pick P and D, stream tokens back."""
from __future__ import annotations

import logging
import threading
import time
import uuid

import grpc

from pdserve.grpc_util import channel
from pdserve.router.config import RouterConfig
from pdserve.router.instances import InstancePool
from pdserve.router.pcs import PCSWeights, score
from pdserve.sampling_proto import DEFAULT_MAX_TOKENS
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2, generate_pb2_grpc, internal_pb2, internal_pb2_grpc

log = logging.getLogger("pdserve.router")

MAX_ATTEMPTS = 2  # a request that fails UNAVAILABLE before its first token is retried once elsewhere


class RouterServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, cfg: RouterConfig, tokenizer, max_model_len: int, vocab_size: int,
                 telemetry: Telemetry | None = None):
        self.cfg = cfg
        self.telemetry = telemetry or Telemetry.off("router")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.special_ids = frozenset(tokenizer.all_special_ids) | frozenset(
            getattr(tokenizer, "added_tokens_decoder", {}).keys())
        self.weights = PCSWeights(cfg.pcs_w_in, cfg.pcs_w_out, cfg.pcs_w_special)
        self.prefill = InstancePool("prefill", cfg.prefill)
        self.decode = InstancePool("decode", cfg.decode)
        self._stubs: dict[str, internal_pb2_grpc.DecodeStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def _decode_stub(self, address: str) -> internal_pb2_grpc.DecodeStub:
        with self._lock:
            if address not in self._stubs:
                ch = channel(address)
                self._channels.append(ch)
                self._stubs[address] = internal_pb2_grpc.DecodeStub(ch)
            return self._stubs[address]

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    # ---- validation ---------------------------------------------------------------------------------------
    def _prompt_ids(self, request: generate_pb2.GenerateRequest, context) -> list[int]:
        which = request.WhichOneof("input")
        if which == "prompt":
            if not request.prompt:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
            ids = list(self.tokenizer(request.prompt).input_ids)
        elif which == "token_ids":
            ids = list(request.token_ids.ids)
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"token_ids contain an id outside the vocabulary [0, {self.vocab_size})")
        else:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "one of prompt or token_ids is required")
        if not ids:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty (no tokens)")
        if len(ids) >= self.max_model_len:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt has {len(ids)} tokens; the model context is {self.max_model_len} tokens "
                          f"(at least one must remain for the completion)")
        return ids

    @staticmethod
    def _check_sampling(s: generate_pb2.SamplingParams, context) -> int:
        max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        problems = []
        if max_tokens <= 0:
            problems.append(f"max_tokens must be > 0, got {max_tokens}")
        if s.HasField("temperature") and not s.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {s.temperature}")
        if s.HasField("top_p") and not 0 < s.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {s.top_p}")
        if s.HasField("top_k") and s.top_k < 0:
            problems.append(f"top_k must be >= 0, got {s.top_k}")
        if any(not stop for stop in s.stop):
            problems.append("stop strings must be non-empty")
        if problems:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
        return max_tokens

    # ---- RPCs -------------------------------------------------------------------------------------------
    def GenerateStream(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext):
        t0 = time.perf_counter()
        rid = request.request_id or uuid.uuid4().hex
        req = self.telemetry.request("router.generate", context, {
            "pdserve.request_id": rid, "pdserve.priority": generate_pb2.Priority.Name(request.priority)})
        ids = self._prompt_ids(request, context)
        max_tokens = self._check_sampling(request.sampling, context)
        pcs = score(ids, self.special_ids, max_tokens, self.weights)
        req.set({"pdserve.prompt_tokens": len(ids), "pdserve.pcs.score": pcs.score, "pdserve.pcs.input_len":
                 pcs.input_len, "pdserve.pcs.est_output_len": pcs.est_output_len,
                 "pdserve.pcs.num_special": pcs.num_special})
        timeout = context.time_remaining()
        timeout = self.cfg.default_timeout_s if timeout is None or timeout > 1e8 else timeout
        sampling = generate_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_tokens = min(max_tokens, self.max_model_len - len(ids))
        decode_req = internal_pb2.DecodeRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling)
        metadata = req.outgoing_metadata()  # decode.request continues this trace

        tried_p: set[str] = set()
        tried_d: set[str] = set()
        ttft_ms = None
        n_tokens = 0
        finish = "abort"
        for attempt in range(MAX_ATTEMPTS):
            p = self.prefill.acquire(pcs.score, frozenset(tried_p))
            d = self.decode.acquire(pcs.score, frozenset(tried_d))
            decode_req.prefill_target = p.address
            req.set({"pdserve.prefill": p.address, "pdserve.decode": d.address, "pdserve.attempt": attempt + 1,
                     "pdserve.admission": "admitted"})
            call = self._decode_stub(d.address).Generate(decode_req, timeout=timeout, metadata=metadata)
            context.add_callback(call.cancel)
            try:
                for msg in call:
                    out = generate_pb2.GenerateStreamResponse(request_id=rid, token_ids=msg.token_ids, text=msg.text)
                    now_ms = (time.perf_counter() - t0) * 1e3
                    if ttft_ms is None:
                        ttft_ms = now_ms
                        req.first_token()
                        out.timing.ttft_ms = ttft_ms
                    n_tokens += len(msg.token_ids)
                    if msg.finish_reason:
                        finish = generate_pb2.FinishReason.Name(msg.finish_reason)
                        out.finish_reason = msg.finish_reason
                        out.stop_reason = msg.stop_reason
                        out.usage.CopyFrom(msg.usage)
                        out.timing.ttft_ms = ttft_ms
                        out.timing.total_ms = now_ms
                        req.finish(msg.usage.completion_tokens, finish.removeprefix("FINISH_REASON_").lower())
                    yield out
                break
            except grpc.RpcError as e:
                retry = (e.code() == grpc.StatusCode.UNAVAILABLE and ttft_ms is None
                         and attempt + 1 < MAX_ATTEMPTS and context.is_active())
                if not retry:
                    if context.is_active():
                        context.abort(e.code(), e.details() or "decode failed")
                    return
                log.warning("rid=%s retrying after UNAVAILABLE from %s/%s: %s", rid, p.address, d.address,
                            e.details())
                req.event("retry", {"pdserve.prefill": p.address, "pdserve.decode": d.address,
                                    "pdserve.error": e.details()})
                tried_p.add(p.address)
                tried_d.add(d.address)
            finally:
                self.prefill.release(p, pcs.score)
                self.decode.release(d, pcs.score)
                log.info("router rid=%s prompt_tokens=%d completion_tokens=%d pcs=%.1f prefill=%s decode=%s "
                         "finish=%s ttft_ms=%s total_ms=%.1f", rid, len(ids), n_tokens, pcs.score, p.address,
                         d.address, finish, f"{ttft_ms:.1f}" if ttft_ms is not None else "-",
                         (time.perf_counter() - t0) * 1e3)

    def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext):
        resp = generate_pb2.GenerateResponse()
        text = []
        for chunk in self.GenerateStream(request, context):
            resp.request_id = chunk.request_id
            resp.token_ids.extend(chunk.token_ids)
            text.append(chunk.text)
            if chunk.finish_reason:
                resp.finish_reason = chunk.finish_reason
                resp.stop_reason = chunk.stop_reason
                resp.usage.CopyFrom(chunk.usage)
                resp.timing.CopyFrom(chunk.timing)
        resp.text = "".join(text)
        return resp
