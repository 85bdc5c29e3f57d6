"""Router: the public Generation service. Tokenize, validate, score PCS, admit, queue by priority, pick P and D,
stream tokens back. An attempt that fails UNAVAILABLE is retried on another pair: before the first token from
scratch, after it as a resume (prompt + the tokens already streamed, which the new pair counts as completion), so
the caller sees one uninterrupted stream (transparent failover). `attempt.relay` runs one attempt,
`retry_policy.after_failure` decides what follows a failed one.

Several models behind one router: a request's `model` names the served model (`catalog.resolve`: none named is
the only one served, else INVALID_ARGUMENT; one not served is NOT_FOUND); its tokenizer, limits, defaults and
estimator are that model's (`catalog.ModelContext`) and it runs on that model's instances only."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import grpc

from pdserve.errors import InvalidRequest
from pdserve.models.generation_config import GenerationDefaults
from pdserve.router.admission import Rejected
from pdserve.router.attempt import AttemptHooks, Progress, relay
from pdserve.router.catalog import (
    AmbiguousModel,
    ModelCatalog,
    ModelContext,
    ModelUnavailable,
    UnknownModel,
    load_model_context,
    resolve,
)
from pdserve.router.choice_resume import choice_requests, start_choice_calls
from pdserve.router.choices import ChoiceShaping, RequestUsage, Shape, choice_counts, merge_choices, pipeline
from pdserve.router.config import RouterConfig
from pdserve.router.estimator import Features, OutputLengthEstimator, features
from pdserve.router.estimator_store import Persistence, open_store
from pdserve.router.head_start import HeadStarts
from pdserve.router.instances import DECODE, PREFILL, Instance
from pdserve.router.limits import DEFAULT_TENANT
from pdserve.router.membership import Membership
from pdserve.router.pcs import PCS, PCSWeights, count_special, fallback_output_len, leading_page_hash, score
from pdserve.router.priority import Priority
from pdserve.router.priority import resolve as resolve_priority
from pdserve.router.reasoning import ReasoningSplitter
from pdserve.router.registry import model_name_problem
from pdserve.router.retry_policy import Action, Decision, after_failure
from pdserve.router.scheduler import Cancelled, Job, Scheduler, Unavailable
from pdserve.router.shaping import ChunkShaper
from pdserve.router.tools.calling import ToolCalling
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
    model: ModelContext | None = None  # whose estimator learns from it (None: the default model's)


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
        model_name: str = "",
        load_model: Callable[[str, str], ModelContext] | None = None,
    ):
        """`tokenizer`, `max_model_len`, `vocab_size`, `model_id`, `generation_defaults`: those of the router's
        own --model (the default model), served as `model_name` (default: cfg.served_model_name, else the model
        directory's name); other models are loaded with `load_model(name, directory)` when a request first names
        them (default: `catalog.load_model_context`).
        `tenant_of(context)`: the authenticated caller's tenant (it may abort the RPC, e.g. UNAUTHENTICATED);
        None: every caller is tenant "default". The tenant scopes the prompt cache (docs/router.md).
        `generation_defaults`: the model's sampling defaults (its generation_config.json), filled into the sampling
        fields a request leaves unset."""
        self.cfg = cfg
        self.tenant_of = tenant_of
        self.telemetry = telemetry or Telemetry.off("router")
        name = model_name or cfg.served_model_name or (Path(cfg.model).name if cfg.model else "")
        estimator = OutputLengthEstimator(cfg.estimator_min_samples, cfg.estimator_max_error, model=model_id)
        persistence = Persistence(estimator, open_store(cfg.estimator_store, model_id), cfg.estimator_save_interval_s)
        default = ModelContext(
            name,
            tokenizer,
            max_model_len,
            vocab_size,
            generation_defaults or GenerationDefaults(),
            estimator,
            persistence,
            path=cfg.model,
        )

        def load(model: str, path: str) -> ModelContext:
            ctx = load_model_context(
                model,
                path,
                cfg.estimator_store,
                cfg.estimator_min_samples,
                cfg.estimator_max_error,
                cfg.estimator_save_interval_s,
            )
            ctx.start()
            return ctx

        self.catalog = ModelCatalog(default, load_model or load, cfg.max_models)
        self.weights = PCSWeights(cfg.pcs_w_in, cfg.pcs_w_out, cfg.pcs_w_special)
        self.multiplier = {
            Priority.HIGH: cfg.priority_high,
            Priority.NORMAL: cfg.priority_normal,
            Priority.LOW: cfg.priority_low,
        }
        self.scheduler = Scheduler(cfg, default_model=name)
        self.membership = Membership(cfg, self.scheduler)
        self.head_starts = HeadStarts()  # Prefill.Start beside each dispatch to decode (--prefill-head-start)
        self.estimator = estimator  # the default model's (ListInstances reports it)
        self.prefill = self.scheduler.view(PREFILL)  # .role/.snapshot() for the metrics gauges
        self.decode = self.scheduler.view(DECODE)

    def start(self) -> None:
        """Restore the estimator and start health checks / Stats polls / periodic saves."""
        self.catalog.default.start()
        self.membership.start()

    def close(self) -> None:
        self.membership.close()
        self.catalog.close()

    # ---- models -------------------------------------------------------------------------------------------
    def served_models(self) -> dict[str, str]:
        """Every model the router serves: its own --model and those its instances announced -> a directory."""
        return {self.catalog.default.name: self.cfg.model, **self.scheduler.models()}

    def _model(self, request: generate_pb2.GenerateRequest, context) -> ModelContext:
        """The model the request names (resolved as `catalog.resolve`), loaded."""
        problem = model_name_problem(request.model)
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem.replace("model_name", "model"))
        served = self.served_models()
        try:
            name = resolve(request.model, served)
            return self.catalog.get(name, served[name])
        except UnknownModel as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except AmbiguousModel as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ModelUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        raise AssertionError("context.abort raises")

    def ListModels(self, request: generate_pb2.ListModelsRequest, context) -> generate_pb2.ListModelsResponse:
        return generate_pb2.ListModelsResponse(
            models=[generate_pb2.ModelInfo(name=n) for n in sorted(self.served_models())]
        )

    # ---- validation ---------------------------------------------------------------------------------------
    def _prompt_ids(
        self, request: generate_pb2.GenerateRequest, context, m: ModelContext, tools: ToolCalling | None = None
    ) -> list[int]:
        which = request.WhichOneof("input")
        if request.messages:  # a conversation, rendered with the model's chat template
            from pdserve.router.chat import ChatLimits, chat_prompt_ids

            if which is not None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "set one of prompt, token_ids or messages")
            try:
                limits = ChatLimits(max_messages=self.cfg.max_messages, max_bytes=self.cfg.max_prompt_bytes)
                ids = chat_prompt_ids(m.tokenizer, request.messages, limits, tools.rendered if tools else None)
            except InvalidRequest as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        elif which == "prompt":
            if not request.prompt:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
            ids = list(m.tokenizer(request.prompt).input_ids)
        elif which == "token_ids":
            if len(request.token_ids.ids) >= m.max_model_len:  # before copying them
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"prompt has {len(request.token_ids.ids)} tokens; the model context is {m.max_model_len}",
                )
            ids = list(request.token_ids.ids)
            if ids and (min(ids) < 0 or max(ids) >= m.vocab_size):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"token_ids contain an id outside the vocabulary [0, {m.vocab_size})",
                )
        else:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "one of prompt, token_ids or messages is required")
        if not ids:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty (no tokens)")
        if len(ids) >= m.max_model_len:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt has {len(ids)} tokens; the model context is {m.max_model_len} tokens "
                f"(at least one must remain for the completion)",
            )
        return ids

    def _splitter(
        self, request: generate_pb2.GenerateRequest, ids: list[int], context, m: ModelContext
    ) -> ReasoningSplitter | None:
        """The request's reasoning split (GenerateRequest.split_reasoning, default: the model's think tags)."""
        if request.sampling.HasField("max_reasoning_tokens") and m.think_tags is None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "max_reasoning_tokens needs a reasoning model: this tokenizer has no <think>/</think> tokens",
            )
        split = request.split_reasoning if request.HasField("split_reasoning") else m.split_tags is not None
        if not split:
            return None
        tags = m.split_tags
        if tags is None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "split_reasoning: this model's tokenizer has no <think>/</think> tokens",
            )
            return None  # not reached: abort raises
        return ReasoningSplitter(inside=tags.inside_after(ids))

    def _max_tokens(
        self, s: generate_pb2.SamplingParams, num_prompt_tokens: int, context, m: ModelContext, chat: bool = False
    ) -> int:
        """The request's max_tokens, clamped to the context left. Unset: SamplingParams' default (16) for a prompt,
        the whole context left for a chat (OpenAI's defaults for the two API shapes). Every sampling field is
        checked here (SamplingParams.validate), where the request enters."""
        if chat and not s.HasField("max_tokens"):
            copy = generate_pb2.SamplingParams()
            copy.CopyFrom(s)
            copy.max_tokens = m.max_model_len - num_prompt_tokens
            s = copy
        params = sampling_from_proto(s, m.max_model_len - num_prompt_tokens)
        try:
            params.validate(m.max_model_len, m.vocab_size)
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return params.max_tokens

    # ---- the decision --------------------------------------------------------------------------------------
    def plan(
        self,
        rid: str,
        ids: list[int],
        max_tokens: int,
        priority: Priority,
        page_size: int,
        model: ModelContext | None = None,
        sequences: int = 1,
    ) -> Plan:
        """Score the request (PCS with the learned or the fallback output estimate of `model`, default: the
        router's own) and build its queue job; `page_size`: the model's KV page size (Scheduler.page_size_of)."""
        m = model or self.catalog.default
        n_special = count_special(ids, m.special_ids)
        f = features(ids, m.special_ids, n_special)
        predicted = m.estimator.predict(f, max_tokens)
        mode = m.estimator.mode(self.cfg.pcs_fallback_mode)
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
            need_pages=-(-(len(ids) + est * sequences) // page_size),  # n / best_of: the prompt's pages once
            page_hash=leading_page_hash(ids, page_size),
            model=m.name,
        )
        return Plan(job, pcs, priority, f, predicted, mode, m)

    @staticmethod
    def _reject(context: grpc.ServicerContext, e: Rejected) -> None:
        ms = str(max(1, round(e.retry_after_s * 1e3)))
        context.set_trailing_metadata(((RETRY_AFTER_KEY, ms), (RETRY_PUSHBACK_KEY, ms)))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e.reason}; retry after {e.retry_after_s:.2f}s")

    # ---- RPCs -------------------------------------------------------------------------------------------
    def GenerateStream(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext):
        return self._generate(request, context, stream=True)

    def _generate(
        self,
        request: generate_pb2.GenerateRequest,
        context: grpc.ServicerContext,
        stream: bool,
        progress: Progress | None = None,
    ):
        """GenerateStream's chunks (`stream` False: for Generate, which allows best_of > n). `progress`: where the
        caller's output stands (Generate reads the unreturned best_of candidates' tokens from it)."""
        progress = progress or Progress(time.perf_counter())
        # The id on every internal hop and in every engine: unique per request, whatever the caller sends. The
        # caller's request_id is only a label echoed back (reusing one in flight is allowed and touches nothing).
        rid = uuid.uuid4().hex
        req = self.telemetry.request("router.generate", context, {"pdserve.request_id": rid})
        if isinstance(request, MalformedMessage):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        tenant = self.tenant_of(context) if self.tenant_of is not None else DEFAULT_TENANT
        try:
            self.cfg.check_request(request)  # sizes, before any tokenizing
            n, best_of = choice_counts(request, stream)
            priority = resolve_priority(request.priority, context.invocation_metadata())
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
        m = self._model(request, context)
        req.set({"pdserve.model": m.name})
        try:  # tools: rendered by the template, an enforced choice's grammar, calls parsed out of the output
            tools = ToolCalling.of(request, m.tokenizer, self.cfg.tool_call_parser, self.cfg.max_prompt_bytes)
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ids = self._prompt_ids(request, context, m, tools)
        sampling = with_model_defaults(request.sampling, m.generation_defaults)  # unset fields: the model's
        if tools is not None:
            try:
                tools.constrain(sampling)
            except InvalidRequest as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        max_tokens = self._max_tokens(sampling, len(ids), context, m, chat=bool(request.messages))

        def new_shaping() -> Shape:
            if n > 1:  # each choice its own shaper and tool-call parse (choices.py)
                return ChoiceShaping(lambda: self._stages(request, ids, context, m, tools)).shape
            return pipeline(self._stages(request, ids, context, m, tools))

        shape = new_shaping()  # checks the reasoning split now (n = 1), before the request is queued
        usage = RequestUsage(n)
        # best_of > n (Generate only): the candidates' outputs come at the attempt's end and reach the caller after
        # it; a failed attempt is retried from scratch (its candidates cannot be resumed: none was seen)
        buffered = best_of > n
        page_size = self.scheduler.page_size_of(m.name)
        if page_size is None:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"no instance of model {m.name!r} has reported its KV page size yet (Stats): none is up",
            )
        assert page_size is not None  # context.abort raised otherwise
        plan = self.plan(rid, ids, max_tokens, priority, page_size, m, sequences=best_of)
        req.event("planned")  # the stages before the first hop, as span events (span_breakdown's rows)
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
            request_id=rid,
            prompt_token_ids=ids,
            sampling=sampling,
            cache_scope=self.cfg.cache_scope(tenant),
            n=n if n > 1 else 0,
            best_of=best_of if best_of > n else 0,
        )
        metadata = req.outgoing_metadata()  # decode.request continues this trace

        try:
            self.scheduler.submit(job)
        except Rejected as e:
            req.set({"pdserve.admission": "rejected"})
            self._reject(context, e)
        except Unavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        p = d = None
        per_choice: dict[int, internal_pb2.DecodeRequest] | None = None  # n > 1 resumed: a request per open choice
        hooks = self._hooks(job, plan, req, n)
        if not context.add_callback(lambda: self.scheduler.cancel(job)):  # the caller went away while queued
            self.scheduler.cancel(job)  # ... already, before the callback was in place (it would never run)
        try:
            for attempt in range(self.cfg.max_attempts):
                pair = self._dispatched(job, deadline, context)
                if pair is None:  # cancelled while queued
                    return
                p, d = pair
                req.event("dispatched")
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
                stub, timeout_s = self.membership.decode_stub(d.address), max(0.001, deadline - time.monotonic())
                decode_req.prefill_start_key = b""
                if (
                    self.cfg.prefill_head_start
                    and p is not d
                    and per_choice is None
                    and self.head_starts.wants(p.address, decode_req)
                ):  # prefill starts now, beside decode's call (decode's stream takes it over with this key)
                    prefill = self.membership.prefill_stub(p.address)
                    decode_req.prefill_start_key = self.head_starts.start(p.address, prefill, decode_req, metadata)
                if per_choice is None:
                    call = stub.Generate(decode_req, timeout=timeout_s, metadata=metadata)
                else:  # n > 1 after a failover: each unfinished choice on its own (choice_resume.py)
                    for index, choice_req in per_choice.items():
                        choice_req.prefill_target = decode_req.prefill_target
                        choice_req.request_id = f"{decode_req.request_id}.c{index}"
                    call = start_choice_calls(per_choice, partial(stub.Generate, timeout=timeout_s, metadata=metadata))
                if not context.add_callback(call.cancel):  # the RPC already ended
                    call.cancel()
                if buffered and attempt:  # a retry from scratch shapes and counts afresh
                    shape, hooks = new_shaping(), self._hooks(job, plan, req, n)
                try:
                    chunks = shape(relay(call, label, progress, hooks))
                    chunks = usage.shape(chunks) if n > 1 and stream else chunks
                    if buffered:
                        chunks = iter(list(chunks))
                    yield from running_usage(chunks, len(ids), progress) if request.stream_usage else chunks
                    return
                except grpc.RpcError as e:
                    call.cancel()  # n > 1 resumed: the other choices' calls too
                    if buffered:
                        progress.forget()
                    decision = after_failure(
                        e.code(),
                        e.details(),
                        attempt=attempt,
                        max_attempts=self.cfg.max_attempts,
                        streamed_tokens=len(progress.tokens) or int(progress.delivered()),
                        caller_active=context.is_active(),
                        time_left_s=deadline - time.monotonic(),
                    )
                    if decision.action is Action.DROP:
                        return
                    if decision.action is Action.FAIL:
                        context.abort(decision.code, decision.details)
                    if decision.action is Action.RESUME and n > 1:
                        per_choice = choice_requests(decode_req, n, progress)
                        if not per_choice:  # every choice ended before the call failed: nothing is missing
                            return
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

    def _stages(self, request: generate_pb2.GenerateRequest, ids: list[int], context, m: ModelContext, tools):
        """A choice's shaping stages (n > 1; n = 1: the stream's): its own ChunkShaper and tool-call stream."""
        stages = [ChunkShaper(m.tokenizer, ids, self._splitter(request, ids, context, m)).shape]
        call_stream = tools.stream() if tools is not None else None
        return stages + ([call_stream.shape] if call_stream is not None else [])

    def _hooks(self, job: Job, plan: Plan, req, choices: int = 1) -> AttemptHooks:
        ended: list[int] = []  # completion tokens of the choices that finished (n > 1: the hook runs after the last)

        def finished(msg: internal_pb2.DecodeResponse) -> None:
            ended.append(msg.usage.completion_tokens)
            if len(ended) < choices:
                return
            total = sum(ended)
            reason = generate_pb2.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
            req.finish(total, reason)
            (plan.model or self.catalog.default).estimator.observe(plan.features, total // choices, plan.predicted)
            self.scheduler.finish(job, completed=True, completion_tokens=total)

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
        if decision.action is Action.RESUME and not decode_req.n:  # mid-stream: continue where the caller is
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
        n = 1 if isinstance(request, MalformedMessage) else request.n or 1  # malformed: `_generate` aborts, saying why
        progress = Progress(time.perf_counter())
        chunks = self._generate(request, context, stream=False, progress=progress)
        return merge_choices(chunks, n, lambda: progress.unreturned_tokens)


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
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            request_deserializer=generate_pb2.ListModelsRequest.FromString,
            response_serializer=generate_pb2.ListModelsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.Generation", handlers),))
