"""Colocated mode: one engine that prefills and decodes, behind the same router and API (`pdserve serve colocated`).

It serves the Decode service: `Decode.Generate` without a prefill target. Instead of importing KV pages from a
prefill instance, the engine computes the prompt itself, in the same steps as it decodes (`pdserve.engine.scheduler`:
every step decodes each running sequence and prefills chunks of one or more prompts within `--step-token-budget`
tokens; a long prompt delays the others' next token by about one such step, and a short prompt arriving beside a
long one is prefilled in the next step). The step sizes default to auto (`pdserve.decode.step_budget`): on a GPU
chosen at start-up from the engine's measured mixed-step times, on CPU `--chunk-size`. The prompt cache works as on
a prefill instance: the longest cached prefix of full pages is loaded instead of computed, and the newly computed
full pages are written back after the first token. `Stats` reports the KV pool and the prefill capacity of those
mixed steps (`PrefillRateMeter`: measured online, the start-up measurement until then), which the router's
admission uses to predict a request's TTFT. A failover resume (`resumed_tokens`) re-prefills prompt + generated
tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time

import grpc

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.prefix_policy import PrefixPlan, PrefixPolicy
from pdserve.cache.prompt_cache import PromptCache
from pdserve.decode.colocated_config import ColocatedConfig
from pdserve.decode.step_budget import AUTO, resolve_step_budget
from pdserve.decode.token_stream import ActiveCalls, StreamEnd, generate_call, relay
from pdserve.engine.engine import LLMEngine
from pdserve.engine.loop import EngineLoop
from pdserve.engine.request import EngineRequest
from pdserve.kv.transfer import ExportedPages
from pdserve.server.grpc_util import remaining
from pdserve.server.instance_stats import instance_stats
from pdserve.server.proto_convert import sampling_from_proto
from pdserve.server.status import engine_error_code
from pdserve.telemetry.rates import WorkRate
from pdserve.telemetry.service import Telemetry
from pdserve.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger("pdserve.colocated")


class PrefillRateMeter:
    """Prompt tokens per second the engine prefills while it also decodes (a step listener on the engine thread):
    prefill tokens over the whole time of the steps that prefilled, their decode rows included (the price of
    prefilling beside the running batch). The capacity is what steps that used at least half their prefill budget
    achieve (`full`): a lightly loaded instance prefills small prompts in small steps, whose rate (`any`) understates
    what it could do, so that one counts only until a full step was measured. On CUDA a step without a sampled
    token returns before the device finished it; the meter waits for the device after a step that prefilled, so
    the time counted is that step's and not the next one's. `prior`: the capacity measured at start-up
    (`pdserve.decode.step_budget`), reported until a full step was measured (it stands above the small steps' rate,
    which understates capacity)."""

    def __init__(self, engine: LLMEngine, prior: float | None = None):
        self.full = WorkRate()  # steps whose prefill rows took >= half the step's prefill budget
        self.any = WorkRate()  # every step that prefilled
        self.prior = prior
        self._device = engine.runner.device

    def __call__(self, engine: LLMEngine, start_ns: int, end_ns: int) -> None:
        n = engine.last_step_prefill_tokens
        if not n:
            return
        if self._device.type == "cuda":
            import torch

            torch.cuda.current_stream(self._device).synchronize()
            end_ns = time.time_ns()
        seconds = (end_ns - start_ns) / 1e9
        self.any.add(n, seconds)
        if 2 * n >= engine.last_step_prefill_budget:
            self.full.add(n, seconds)

    def rate(self) -> float | None:
        """Prompt tokens per second of prefill capacity beside decoding (None until measured)."""
        return self.full.rate() or self.prior or self.any.rate()


class ColocatedServicer(internal_pb2_grpc.DecodeServicer):
    def __init__(
        self,
        cfg: ColocatedConfig,
        loop: EngineLoop,
        telemetry: Telemetry | None = None,
        cache: PromptCache | None = None,
        prior_tokens_per_s: float | None = None,
    ):
        """`prior_tokens_per_s`: the prefill capacity beside decoding measured at start-up (None: not measured)."""
        self.cfg = cfg
        self.loop = loop
        self.cache = cache
        self.telemetry = telemetry or Telemetry.off("colocated")
        engine = loop.engine
        self.fingerprint: str = engine.fingerprint
        self.max_model_len: int = engine.model_config.max_position_embeddings
        self.page_size: int = engine.page_size
        self.layout = engine.pool_layout  # what the prompt cache stores and serves here
        self.namespace = CacheNamespace(self.fingerprint, self.layout)
        # the prompt cache's prefixes, as on a prefill instance (the pool keeps no prefixes of its own here)
        self.prefix = PrefixPolicy(cache, self.page_size, pool_reuse=False)
        self.meter = PrefillRateMeter(engine, prior_tokens_per_s)
        loop.step_listener = self.meter
        self.active = ActiveCalls()

    # ---- RPC ------------------------------------------------------------------------------------------
    def Generate(self, request: internal_pb2.DecodeRequest, context: grpc.ServicerContext):
        t0 = time.perf_counter()
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        req = self.telemetry.request(
            "colocated.request", context, {"pdserve.request_id": rid, "pdserve.prompt_tokens": len(prompt)}
        )
        if request.prefill_target:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this instance is colocated (it prefills itself); got prefill_target {request.prefill_target!r}",
            )
        resumed = request.resumed_tokens
        if resumed:
            req.set({"pdserve.resumed_tokens": resumed})
        sampling = sampling_from_proto(request.sampling, self.max_model_len - (len(prompt) - resumed))
        # prompt_logprobs score every prompt token, and a resume recomputes: neither takes pages from the cache
        ns = dataclasses.replace(self.namespace, scope=request.cache_scope)  # the router's scope: tenant or shared
        plan = self.prefix.plan(ns, prompt, bool(sampling.prompt_logprobs or resumed), self.meter.rate())
        cached = plan.hit.num_pages * self.page_size
        outputs: queue.Queue = queue.Queue()
        to_cache: list[ExportedPages] = []  # filled on the engine thread before the first token's output is queued
        admitted_ns = time.time_ns()

        def on_output(out) -> None:  # engine thread
            first = not isinstance(out, BaseException) and bool(out.new_token_ids) and out.index == 0
            if first and out.num_completion_tokens == resumed + 1:  # choice 0's first token (n > 1: pages once)
                req.record("colocated.prefill", admitted_ns, {"pdserve.cached_tokens": cached})
                if not out.finished:  # its pages are still held: copy the new full pages out for the cache
                    try:
                        exported = self._export_for_cache(rid, plan)
                        if exported is not None:
                            to_cache.append(exported)
                    except Exception as e:  # the cache is an optimisation: never fail the request over it
                        log.warning("rid=%s prompt cache write-back skipped: %s", rid, e)
            outputs.put(out)

        try:
            self.loop.add_request(
                EngineRequest(
                    rid,
                    prompt,
                    sampling,
                    cached_pages=plan.cached_pages,
                    resumed_tokens=resumed,
                    resumed_text_chars=request.resumed_text_chars,
                    n=request.n or 1,
                    best_of=request.best_of,
                ),
                on_output,
            )
        except Exception as e:
            context.abort(engine_error_code(e), f"colocated instance could not admit request: {e}")

        def summary(end: StreamEnd) -> None:
            fmt = "colocated rid=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d finish=%s ms=%.1f"
            ms = (time.perf_counter() - t0) * 1e3
            log.info(fmt, rid, len(prompt), cached, end.completion_tokens, end.finish, ms)

        with generate_call(self.loop, rid, self.active, summary, context) as end:
            deadline = time.monotonic() + (remaining(context) or self.cfg.request_timeout_s)
            for msg in relay(outputs, context, deadline, "colocated request", req, cached, end):
                yield msg
                if to_cache:  # after the first token went out: off its path
                    self.prefix.write_back(ns, plan, plan.hit.num_pages, [to_cache.pop()], self.layout)

    # ---- prompt cache ---------------------------------------------------------------------------------
    def _export_for_cache(self, rid: str, plan: PrefixPlan) -> ExportedPages | None:
        """Engine thread, right after the prompt's last chunk: the full prompt pages not from the cache, gathered
        on the device in the pool's format (None: nothing to write)."""
        pages = plan.new_pages()
        if self.cache is None or not pages:
            return None
        return self.loop.engine.export_batch(rid, pages, self.layout)

    def Stats(self, request, context):
        rate = self.meter.rate() or 0.0
        return instance_stats(self.loop, self.active.count, prefill_tokens_per_s=rate)


def serve(cfg: ColocatedConfig) -> None:
    """`pdserve serve colocated`: one colocated instance (Decode service; registers as role colocated)."""
    from pdserve.cache.prompt_cache import build_prompt_cache
    from pdserve.server.runner import build_engine, run_service
    from pdserve.telemetry.metrics import watch_engine, watch_prompt_cache

    service = internal_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
    loop = build_engine(cfg)  # its pool stores --kv-dtype (the prompt cache pages' format too)
    prior = None
    if cfg.engine.step_token_budget == AUTO:  # after the warm-up: the timed steps compile nothing but their shapes
        prior = loop.call(lambda e: resolve_step_budget(e, measure=cfg.warmup)).prior_tokens_per_s
    cache = build_prompt_cache(cfg)

    def register(server, telemetry):
        watch_engine(telemetry.metrics, loop)
        if cache is not None:
            watch_prompt_cache(telemetry.metrics, cache)
        servicer = ColocatedServicer(cfg, loop, telemetry, cache, prior)
        internal_pb2_grpc.add_DecodeServicer_to_server(servicer, server)

        def cleanup() -> None:
            loop.stop()
            if cache is not None:
                cache.close()

        return cleanup

    run_service("colocated", cfg, [service], register)
