"""Router: the public Generation service. Tokenize, validate, score PCS, admit, queue by priority, pick P and D,
stream tokens back. An attempt that fails UNAVAILABLE is retried on another pair: before the first token from
scratch, after it as a resume (prompt + the tokens already streamed, which the new pair counts as completion), so
the caller sees one uninterrupted stream (transparent failover)."""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from pdserve.router.admission import Rejected
from pdserve.router.config import RouterConfig
from pdserve.router.estimator import Features, OutputLengthEstimator, features
from pdserve.router.estimator_store import Persistence, open_store
from pdserve.router.instances import DECODE, PREFILL
from pdserve.router.membership import Membership
from pdserve.router.pcs import PCS, PCSWeights, count_special, fallback_output_len, leading_page_hash, score, \
    special_token_ids
from pdserve.router.priority import Priority, resolve
from pdserve.router.scheduler import Cancelled, Job, Scheduler, Unavailable
from pdserve.server.proto_convert import DEFAULT_MAX_TOKENS
from pdserve.telemetry.service import Telemetry
from pdserve.v1 import generate_pb2, generate_pb2_grpc, internal_pb2

log = logging.getLogger("pdserve.router")

RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of RESOURCE_EXHAUSTED: when to try again


@dataclass
class Plan:
    """What the router decided about a request before it runs."""
    job: Job
    pcs: PCS
    priority: Priority
    features: Features
    predicted: int | None  # the learned estimate (kept to measure the estimator, also while it is not used)
    mode: str              # learned | length_only | max_tokens


class RouterServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, cfg: RouterConfig, tokenizer, max_model_len: int, vocab_size: int,
                 telemetry: Telemetry | None = None, model_id: str = ""):
        self.cfg = cfg
        self.telemetry = telemetry or Telemetry.off("router")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.special_ids = special_token_ids(tokenizer)
        self.weights = PCSWeights(cfg.pcs_w_in, cfg.pcs_w_out, cfg.pcs_w_special)
        self.multiplier = {Priority.HIGH: cfg.priority_high, Priority.NORMAL: cfg.priority_normal,
                           Priority.LOW: cfg.priority_low}
        self.scheduler = Scheduler(cfg)
        self.membership = Membership(cfg, self.scheduler)
        self.estimator = OutputLengthEstimator(cfg.estimator_min_samples, cfg.estimator_max_error, model=model_id)
        self.persistence = Persistence(self.estimator, open_store(cfg.estimator_store, model_id),
                                       cfg.estimator_save_interval_s)
        self.prefill = self.scheduler.view(PREFILL)  # .role/.snapshot() for the metrics gauges
        self.decode = self.scheduler.view(DECODE)

    def start(self) -> None:
        """Restore the estimator and start health checks / Stats polls / periodic saves."""
        self.persistence.load()
        self.persistence.start()
        self.membership.start()

    def close(self) -> None:
        self.membership.close()
        self.persistence.close()

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

    # ---- the decision --------------------------------------------------------------------------------------
    def plan(self, rid: str, ids: list[int], max_tokens: int, priority: Priority) -> Plan:
        """Score the request (PCS with the learned or the fallback output estimate) and build its queue job."""
        n_special = count_special(ids, self.special_ids)
        f = features(ids, self.special_ids, n_special)
        predicted = self.estimator.predict(f, max_tokens)
        mode = self.estimator.mode(self.cfg.pcs_fallback_mode)
        est = predicted if mode == "learned" and predicted is not None else \
            fallback_output_len(max_tokens, len(ids), self.cfg.pcs_fallback_mode)
        pcs = score(len(ids), n_special, est, self.weights)
        job = Job(rid, pcs.score, pcs.score / self.multiplier[priority], len(ids),
                  need_pages=-(-(len(ids) + est) // self.cfg.page_size),
                  page_hash=leading_page_hash(ids, self.cfg.page_size))
        return Plan(job, pcs, priority, f, predicted, mode)

    @staticmethod
    def _reject(context: grpc.ServicerContext, e: Rejected) -> None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(max(1, round(e.retry_after_s * 1e3)))),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e.reason}; retry after {e.retry_after_s:.2f}s")

    # ---- RPCs -------------------------------------------------------------------------------------------
    def GenerateStream(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext):
        t0 = time.perf_counter()
        rid = request.request_id or uuid.uuid4().hex
        req = self.telemetry.request("router.generate", context, {
            "pdserve.request_id": rid, "pdserve.priority": generate_pb2.Priority.Name(request.priority)})
        ids = self._prompt_ids(request, context)
        max_tokens = min(self._check_sampling(request.sampling, context), self.max_model_len - len(ids))
        try:
            priority = resolve(request.priority, context.invocation_metadata())
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        plan = self.plan(rid, ids, max_tokens, priority)
        job, pcs = plan.job, plan.pcs
        req.set({"pdserve.prompt_tokens": len(ids), "pdserve.pcs.score": pcs.score, "pdserve.pcs.input_len":
                 pcs.input_len, "pdserve.pcs.est_output_len": pcs.est_output_len,
                 "pdserve.pcs.num_special": pcs.num_special, "pdserve.pcs.estimate": plan.mode,
                 "pdserve.priority.effective": priority.value})  # field or x-priority metadata, resolved
        timeout = context.time_remaining()
        timeout = self.cfg.default_timeout_s if timeout is None or timeout > 1e8 else timeout
        deadline = time.monotonic() + timeout
        sampling = generate_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_tokens = max_tokens
        decode_req = internal_pb2.DecodeRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling)
        metadata = req.outgoing_metadata()  # decode.request continues this trace

        try:
            self.scheduler.submit(job)
        except Rejected as e:
            req.set({"pdserve.admission": "rejected"})
            self._reject(context, e)
        except Unavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        ttft_ms = None
        n_tokens = 0
        generated: list[int] = []  # token ids streamed to the caller (a resume re-sends them as prompt)
        emitted_chars = 0          # characters of text streamed to the caller
        finish = "abort"
        p = d = None
        context.add_callback(lambda: self.scheduler.cancel(job))  # the caller went away while queued
        try:
            for attempt in range(self.cfg.max_attempts):
                try:
                    p, d = self.scheduler.wait(job, min(deadline - time.monotonic(), self.cfg.max_queue_wait_s))
                except Cancelled:
                    return
                except Rejected as e:
                    if time.monotonic() >= deadline:
                        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while queued")
                    self._reject(context, e)
                except Unavailable as e:
                    context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                decode_req.prefill_target = p.address
                req.set({"pdserve.prefill": p.address, "pdserve.decode": d.address, "pdserve.attempt": attempt + 1,
                         "pdserve.admission": "admitted"})
                call = self.membership.decode_stub(d.address).Generate(
                    decode_req, timeout=max(0.001, deadline - time.monotonic()), metadata=metadata)
                if not context.add_callback(call.cancel):  # the RPC already ended
                    call.cancel()
                first_of_attempt = True
                try:
                    for msg in call:
                        out = generate_pb2.GenerateStreamResponse(request_id=rid, token_ids=msg.token_ids,
                                                                  text=msg.text)
                        now_ms = (time.perf_counter() - t0) * 1e3
                        if first_of_attempt:  # this attempt's prefill is done (a resume has one too)
                            first_of_attempt = False
                            self.scheduler.first_token(job)
                        if ttft_ms is None:
                            ttft_ms = now_ms
                            req.first_token()
                            out.timing.ttft_ms = ttft_ms
                        n_tokens += len(msg.token_ids)
                        generated.extend(msg.token_ids)
                        emitted_chars += len(msg.text)
                        if msg.finish_reason:
                            finish = generate_pb2.FinishReason.Name(msg.finish_reason)
                            out.finish_reason = msg.finish_reason
                            out.stop_reason = msg.stop_reason
                            out.usage.CopyFrom(msg.usage)
                            out.timing.ttft_ms = ttft_ms
                            out.timing.total_ms = now_ms
                            req.finish(msg.usage.completion_tokens, finish.removeprefix("FINISH_REASON_").lower())
                            self.estimator.observe(plan.features, msg.usage.completion_tokens, plan.predicted)
                            self.scheduler.finish(job, completed=True)
                        yield out
                    break
                except grpc.RpcError as e:
                    # a pool that could not admit the request (before any token): try another pair, healthy as
                    # they are; an instance that went away: retry or resume (below) without the blamed ones
                    full = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not generated
                    retry = ((e.code() == grpc.StatusCode.UNAVAILABLE or full) and attempt + 1 < self.cfg.max_attempts
                             and context.is_active() and time.monotonic() < deadline)
                    if not retry:
                        if context.is_active():
                            context.abort(e.code(), e.details() or "decode failed")
                        return
                    if full:
                        log.info("rid=%s retrying on another pair: %s/%s out of KV pages: %s", rid, p.address,
                                 d.address, e.details())
                        req.event("retry", {"pdserve.prefill": p.address, "pdserve.decode": d.address,
                                            "pdserve.error": e.details()})
                        self.scheduler.retry(job, [p, d])
                        continue
                    if generated:  # mid-stream: continue where the caller is (transparent failover)
                        del decode_req.prompt_token_ids[:]
                        decode_req.prompt_token_ids.extend(ids + generated)
                        decode_req.resumed_tokens = len(generated)
                        decode_req.resumed_text_chars = emitted_chars
                    what = f"resuming after {len(generated)} tokens" if generated else "retrying"
                    log.warning("rid=%s %s after UNAVAILABLE from %s/%s: %s", rid, what, p.address, d.address,
                                e.details())
                    req.event("resume" if generated else "retry", {
                        "pdserve.prefill": p.address, "pdserve.decode": d.address, "pdserve.error": e.details(),
                        "pdserve.resumed_tokens": len(generated)})
                    self.scheduler.retry(job, self.membership.blame(p, d))
        finally:
            self.scheduler.finish(job)
            log.info("router rid=%s prompt_tokens=%d completion_tokens=%d pcs=%.1f est_out=%d (%s) priority=%s "
                     "prefill=%s decode=%s finish=%s ttft_ms=%s total_ms=%.1f", rid, len(ids), n_tokens, pcs.score,
                     pcs.est_output_len, plan.mode, priority.value, p.address if p else "-",
                     d.address if d else "-", finish, f"{ttft_ms:.1f}" if ttft_ms is not None else "-",
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
