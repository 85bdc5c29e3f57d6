"""Router: the public Generation service. Tokenize, validate, score PCS, admit, queue by priority, pick P and D,
stream tokens back. An attempt that fails UNAVAILABLE is retried on another pair: before the first token from
scratch, after it as a resume (prompt + the tokens already streamed, which the new pair counts as completion), so
the caller sees one uninterrupted stream (transparent failover). `attempt.relay` runs one attempt,
`retry_policy.after_failure` decides what follows a failed one."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from pdserve.engine.reasoning_budget import ThinkTags
from pdserve.errors import InvalidRequest
from pdserve.models.generation_config import GenerationDefaults
from pdserve.router.admission import Rejected
from pdserve.router.attempt import AttemptHooks, Progress, relay
from pdserve.router.config import RouterConfig
from pdserve.router.estimator import Features, OutputLengthEstimator, features
from pdserve.router.estimator_store import Persistence, open_store
from pdserve.router.instances import DECODE, PREFILL, Instance
from pdserve.router.limits import DEFAULT_TENANT
from pdserve.router.membership import Membership
from pdserve.router.pcs import (
    PCS,
    PCSWeights,
    count_special,
    fallback_output_len,
    leading_page_hash,
    score,
    special_token_ids,
)
from pdserve.router.priority import Priority, resolve
from pdserve.router.reasoning import ReasoningSplitter, reasoning_tags
from pdserve.router.retry_policy import Action, Decision, after_failure
from pdserve.router.scheduler import Cancelled, Job, Scheduler, Unavailable
from pdserve.router.shaping import ChunkShaper, merge_chunks
from pdserve.router.trailers import RETRY_AFTER_KEY, RETRY_PUSHBACK_KEY
from pdserve.server.proto_convert import MalformedMessage, lenient_parser, sampling_from_proto, with_model_defaults
from pdserve.telemetry.service import Telemetry
from pdserve.v1 import generate_pb2, generate_pb2_grpc, internal_pb2

log = logging.getLogger("pdserve.router")


@dataclass
class Plan:
    """What the router decided about a request before it runs."""

    job: Job
    pcs: PCS
    priority: Priority
    features: Features
    predicted: int | None  # the learned estimate (kept to measure the estimator, also while it is not used)
    mode: str  # learned | length_only | max_tokens


class RouterServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        cfg: RouterConfig,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        telemetry: Telemetry | None = None,
        model_id: str = "",
        tenant_of: Callable[[grpc.ServicerContext], str] | None = None,
        generation_defaults: GenerationDefaults | None = None,
    ):
        """`tenant_of(context)`: the authenticated caller's tenant (it may abort the RPC, e.g. UNAUTHENTICATED);
        None: every caller is tenant "default". The tenant scopes the prompt cache (docs/router.md).
        `generation_defaults`: the model's sampling defaults (its generation_config.json), filled into the sampling
        fields a request leaves unset."""
        self.cfg = cfg
        self.generation_defaults = generation_defaults or GenerationDefaults()
        self.tenant_of = tenant_of
        self.telemetry = telemetry or Telemetry.off("router")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.special_ids = special_token_ids(tokenizer)
        self.think_tags = ThinkTags.from_tokenizer(tokenizer)  # max_reasoning_tokens needs them
        self.split_tags = reasoning_tags(tokenizer)  # the reasoning split's default: on when the tags show in text
        self.weights = PCSWeights(cfg.pcs_w_in, cfg.pcs_w_out, cfg.pcs_w_special)
        self.multiplier = {
            Priority.HIGH: cfg.priority_high,
            Priority.NORMAL: cfg.priority_normal,
            Priority.LOW: cfg.priority_low,
        }
        self.scheduler = Scheduler(cfg)
        self.membership = Membership(cfg, self.scheduler)
        self.estimator = OutputLengthEstimator(cfg.estimator_min_samples, cfg.estimator_max_error, model=model_id)
        self.persistence = Persistence(
            self.estimator, open_store(cfg.estimator_store, model_id), cfg.estimator_save_interval_s
        )
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
        if request.messages:  # a conversation, rendered with the model's chat template
            from pdserve.router.chat import ChatLimits, chat_prompt_ids

            if which is not None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "set one of prompt, token_ids or messages")
            try:
                limits = ChatLimits(max_messages=self.cfg.max_messages, max_bytes=self.cfg.max_prompt_bytes)
                ids = chat_prompt_ids(self.tokenizer, request.messages, limits)
            except InvalidRequest as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        elif which == "prompt":
            if not request.prompt:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
            ids = list(self.tokenizer(request.prompt).input_ids)
        elif which == "token_ids":
            if len(request.token_ids.ids) >= self.max_model_len:  # before copying them
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"prompt has {len(request.token_ids.ids)} tokens; the model context is {self.max_model_len}",
                )
            ids = list(request.token_ids.ids)
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"token_ids contain an id outside the vocabulary [0, {self.vocab_size})",
                )
        else:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "one of prompt, token_ids or messages is required")
        if not ids:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty (no tokens)")
        if len(ids) >= self.max_model_len:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt has {len(ids)} tokens; the model context is {self.max_model_len} tokens "
                f"(at least one must remain for the completion)",
            )
        return ids

    def _splitter(self, request: generate_pb2.GenerateRequest, ids: list[int], context) -> ReasoningSplitter | None:
        """The request's reasoning split (GenerateRequest.split_reasoning, default: the model's think tags)."""
        if request.sampling.HasField("max_reasoning_tokens") and self.think_tags is None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "max_reasoning_tokens needs a reasoning model: this tokenizer has no <think>/</think> tokens",
            )
        split = request.split_reasoning if request.HasField("split_reasoning") else self.split_tags is not None
        if not split:
            return None
        tags = self.split_tags
        if tags is None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "split_reasoning: this model's tokenizer has no <think>/</think> tokens",
            )
            return None  # not reached: abort raises
        return ReasoningSplitter(inside=tags.inside_after(ids))

    def _max_tokens(self, s: generate_pb2.SamplingParams, num_prompt_tokens: int, context, chat: bool = False) -> int:
        """The request's max_tokens, clamped to the context left. Unset: SamplingParams' default (16) for a prompt,
        the whole context left for a chat (OpenAI's defaults for the two API shapes). Every sampling field is
        checked here (SamplingParams.validate), where the request enters."""
        if chat and not s.HasField("max_tokens"):
            copy = generate_pb2.SamplingParams()
            copy.CopyFrom(s)
            copy.max_tokens = self.max_model_len - num_prompt_tokens
            s = copy
        params = sampling_from_proto(s, self.max_model_len - num_prompt_tokens)
        try:
            params.validate(self.max_model_len, self.vocab_size)
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return params.max_tokens

    # ---- the decision --------------------------------------------------------------------------------------
    def plan(self, rid: str, ids: list[int], max_tokens: int, priority: Priority, page_size: int) -> Plan:
        """Score the request (PCS with the learned or the fallback output estimate) and build its queue job;
        `page_size`: the instances' KV page size (Scheduler.page_size)."""
        n_special = count_special(ids, self.special_ids)
        f = features(ids, self.special_ids, n_special)
        predicted = self.estimator.predict(f, max_tokens)
        mode = self.estimator.mode(self.cfg.pcs_fallback_mode)
        est = (
            predicted
            if mode == "learned" and predicted is not None
            else fallback_output_len(max_tokens, len(ids), self.cfg.pcs_fallback_mode)
        )
        pcs = score(len(ids), n_special, est, self.weights)
        job = Job(
            rid,
            pcs.score,
            pcs.score / self.multiplier[priority],
            len(ids),
            need_pages=-(-(len(ids) + est) // page_size),
            page_hash=leading_page_hash(ids, page_size),
        )
        return Plan(job, pcs, priority, f, predicted, mode)

    @staticmethod
    def _reject(context: grpc.ServicerContext, e: Rejected) -> None:
        ms = str(max(1, round(e.retry_after_s * 1e3)))
        context.set_trailing_metadata(((RETRY_AFTER_KEY, ms), (RETRY_PUSHBACK_KEY, ms)))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e.reason}; retry after {e.retry_after_s:.2f}s")

    # ---- RPCs -------------------------------------------------------------------------------------------
    def GenerateStream(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext):
        t0 = time.perf_counter()
        # The id on every internal hop and in every engine: unique per request, whatever the caller sends. The
        # caller's request_id is only a label echoed back (reusing one in flight is allowed and touches nothing).
        rid = uuid.uuid4().hex
        req = self.telemetry.request("router.generate", context, {"pdserve.request_id": rid})
        if isinstance(request, MalformedMessage):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        tenant = self.tenant_of(context) if self.tenant_of is not None else DEFAULT_TENANT
        try:
            self.cfg.check_request(request)  # sizes, before any tokenizing
            priority = resolve(request.priority, context.invocation_metadata())
        except (InvalidRequest, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        label = request.request_id or rid
        req.set(
            {
                "pdserve.request_label": label,
                "pdserve.tenant": tenant,
                "pdserve.priority": generate_pb2.Priority.Name(request.priority),  # a valid value by now
            }
        )
        ids = self._prompt_ids(request, context)
        sampling = with_model_defaults(request.sampling, self.generation_defaults)  # unset fields: the model's
        max_tokens = self._max_tokens(sampling, len(ids), context, chat=bool(request.messages))
        shaper = ChunkShaper(self.tokenizer, ids, self._splitter(request, ids, context))
        page_size = self.scheduler.page_size
        if page_size is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no instance has reported its KV page size yet (Stats)")
        assert page_size is not None  # context.abort raised otherwise
        plan = self.plan(rid, ids, max_tokens, priority, page_size)
        job, pcs = plan.job, plan.pcs
        req.set(
            {
                "pdserve.prompt_tokens": len(ids),
                "pdserve.pcs.score": pcs.score,
                "pdserve.pcs.input_len": pcs.input_len,
                "pdserve.pcs.est_output_len": pcs.est_output_len,
                "pdserve.pcs.num_special": pcs.num_special,
                "pdserve.pcs.estimate": plan.mode,
                "pdserve.priority.effective": priority.value,
            }
        )  # field or x-priority metadata, resolved
        timeout = context.time_remaining()
        timeout = self.cfg.default_timeout_s if timeout is None or timeout > 1e8 else timeout
        deadline = time.monotonic() + timeout
        sampling.max_tokens = max_tokens
        decode_req = internal_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=ids, sampling=sampling, cache_scope=self.cfg.cache_scope(tenant)
        )
        metadata = req.outgoing_metadata()  # decode.request continues this trace

        try:
            self.scheduler.submit(job)
        except Rejected as e:
            req.set({"pdserve.admission": "rejected"})
            self._reject(context, e)
        except Unavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        progress = Progress(t0)
        p = d = None
        context.add_callback(lambda: self.scheduler.cancel(job))  # the caller went away while queued
        try:
            for attempt in range(self.cfg.max_attempts):
                pair = self._dispatched(job, deadline, context)
                if pair is None:  # cancelled while queued
                    return
                p, d = pair
                decode_req.prefill_target = "" if p is d else p.address  # a colocated instance prefills itself
                # Each attempt has its own internal id: the cleanup of a failed attempt on an instance can never
                # touch the retry of the same request on that instance.
                decode_req.request_id = rid if attempt == 0 else f"{rid}.{attempt}"
                req.set(
                    {
                        "pdserve.prefill": p.address,
                        "pdserve.decode": d.address,
                        "pdserve.attempt": attempt + 1,
                        "pdserve.admission": "admitted",
                    }
                )
                call = self.membership.decode_stub(d.address).Generate(
                    decode_req, timeout=max(0.001, deadline - time.monotonic()), metadata=metadata
                )
                if not context.add_callback(call.cancel):  # the RPC already ended
                    call.cancel()
                try:
                    chunks = shaper.shape(relay(call, label, progress, self._hooks(job, plan, req)))
                    yield from running_usage(chunks, len(ids), progress) if request.stream_usage else chunks
                    return
                except grpc.RpcError as e:
                    decision = after_failure(
                        e.code(),
                        e.details(),
                        attempt=attempt,
                        max_attempts=self.cfg.max_attempts,
                        streamed_tokens=len(progress.tokens),
                        caller_active=context.is_active(),
                        time_left_s=deadline - time.monotonic(),
                    )
                    if decision.action is Action.DROP:
                        return
                    if decision.action is Action.FAIL:
                        context.abort(decision.code, decision.details)
                    self._next_attempt(decision, job, p, d, decode_req, ids, progress, req, e)
        finally:
            self.scheduler.finish(job)
            ttft_ms = progress.ttft_ms
            log.info(
                "router rid=%s tenant=%s label=%r prompt_tokens=%d completion_tokens=%d pcs=%.1f est_out=%d (%s) "
                "priority=%s prefill=%s decode=%s finish=%s ttft_ms=%s total_ms=%.1f",
                rid,
                tenant,
                label,
                len(ids),
                len(progress.tokens),
                pcs.score,
                pcs.est_output_len,
                plan.mode,
                priority.value,
                p.address if p else "-",
                d.address if d else "-",
                progress.finish,
                f"{ttft_ms:.1f}" if ttft_ms is not None else "-",
                progress.elapsed_ms(),
            )

    def _dispatched(self, job: Job, deadline: float, context: grpc.ServicerContext):
        """Wait in the queue for a (prefill, decode) pair; None when the caller went away. Aborts the RPC when
        no pair comes in time (RESOURCE_EXHAUSTED with retry-after, or DEADLINE_EXCEEDED) or none is healthy."""
        try:
            return self.scheduler.wait(job, min(deadline - time.monotonic(), self.cfg.max_queue_wait_s))
        except Cancelled:
            return None
        except Rejected as e:
            if time.monotonic() >= deadline:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while queued")
            self._reject(context, e)
        except Unavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    def _hooks(self, job: Job, plan: Plan, req) -> AttemptHooks:
        def finished(msg: internal_pb2.DecodeResponse) -> None:
            reason = generate_pb2.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
            req.finish(msg.usage.completion_tokens, reason)
            self.estimator.observe(plan.features, msg.usage.completion_tokens, plan.predicted)
            self.scheduler.finish(job, completed=True, completion_tokens=msg.usage.completion_tokens)

        return AttemptHooks(
            attempt_first_token=lambda: self.scheduler.first_token(job), first_token=req.first_token, finished=finished
        )

    def _next_attempt(
        self,
        decision: Decision,
        job: Job,
        p: Instance,
        d: Instance,
        decode_req: internal_pb2.DecodeRequest,
        ids: list[int],
        progress: Progress,
        req,
        err: grpc.RpcError,
    ) -> None:
        """Requeue `job` for a retry or resume on another pair (rewriting `decode_req` for a resume)."""
        rid = decode_req.request_id
        if not decision.blame:  # the pair could not admit it (pool full): healthy, just not these two
            log.info(
                "rid=%s retrying on another pair: %s/%s out of KV pages: %s", rid, p.address, d.address, err.details()
            )
            req.event(
                "retry", {"pdserve.prefill": p.address, "pdserve.decode": d.address, "pdserve.error": err.details()}
            )
            self.scheduler.retry(job, [p, d])
            return
        generated = progress.tokens
        if decision.action is Action.RESUME:  # mid-stream: continue where the caller is (transparent failover)
            del decode_req.prompt_token_ids[:]
            decode_req.prompt_token_ids.extend(ids + generated)
            decode_req.resumed_tokens = len(generated)
            decode_req.sampling.prompt_logprobs = False  # the caller has them (first chunk); the prompt grew
            decode_req.resumed_text_chars = progress.chars
        what = f"resuming after {len(generated)} tokens" if generated else "retrying"
        log.warning("rid=%s %s after UNAVAILABLE from %s/%s: %s", rid, what, p.address, d.address, err.details())
        req.event(
            decision.action.value,
            {
                "pdserve.prefill": p.address,
                "pdserve.decode": d.address,
                "pdserve.error": err.details(),
                "pdserve.resumed_tokens": len(generated),
            },
        )
        self.scheduler.retry(job, self.membership.blame(p, d))

    def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext):
        return merge_chunks(self.GenerateStream(request, context))


def running_usage(
    chunks: Iterator[generate_pb2.GenerateStreamResponse], prompt_tokens: int, progress: Progress
) -> Iterator[generate_pb2.GenerateStreamResponse]:
    """`stream_usage`: the running usage on every chunk before the last (which carries the engine's own)."""
    for chunk in chunks:
        if not chunk.finish_reason:
            chunk.usage.prompt_tokens = prompt_tokens
            chunk.usage.completion_tokens = len(progress.tokens)  # the caller's count, across failover attempts
        yield chunk


def add_generation_servicer(servicer: RouterServicer, server: grpc.Server) -> None:
    """Register the Generation service like the generated helper, but with a request parser that hands the servicer
    unparseable bytes (e.g. invalid UTF-8 in a string) as a `MalformedMessage`: INVALID_ARGUMENT, not INTERNAL."""
    parse = lenient_parser(generate_pb2.GenerateRequest)
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate,
            request_deserializer=parse,
            response_serializer=generate_pb2.GenerateResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream,
            request_deserializer=parse,
            response_serializer=generate_pb2.GenerateStreamResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.Generation", handlers),))
