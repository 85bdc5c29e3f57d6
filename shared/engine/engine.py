"""LLMEngine: requests in, StepOutputs out; one forward pass per `step()`. Single-threaded by design (services
drive it from one thread, see `pdserve.engine.loop.EngineLoop`).

Roles: a plain engine prefills and decodes. A prefill instance adds requests with `prefill_only=True` and ships
pages (`export_batch`) as `ready_pages` reports them; a decode instance imports them (`begin_import`,
`import_batch`, `finish_import`) and decodes. Those export and import methods call `self.handoff`
(kv_handoff.py's `KVHandoff`, an object the engine owns).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import uuid
from dataclasses import dataclass
from typing import cast

import torch

from pdserve.engine.config import EngineConfig, dtype_name
from pdserve.engine.forks import ChoicePlan, ForkGroup, fork_id, fork_sampling
from pdserve.engine.kv_handoff import KVHandoff
from pdserve.engine.loader import load_tokenizer, model_fingerprint, parse_model_config
from pdserve.engine.model_runner import DecodeLaunch, ModelRunner
from pdserve.engine.page_table import PageAllocator
from pdserve.engine.prefix_fetch import load_landed
from pdserve.engine.reasoning_budget import ReasoningBudget, ThinkTags
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams, TokenLogprob
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import IncrementalDetokenizer, Sequence, SequenceStatus
from pdserve.engine.step_output import StepOutput
from pdserve.engine.structured import StructuredCompiler
from pdserve.errors import DuplicateRequest, InvalidRequest, OutOfPages
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.payload import CachedUpload, PagePayload
from pdserve.kv.transfer.base import ExportedPages
from pdserve.kv.transfer.layers import LayerRange

log = logging.getLogger("pdserve.engine")

__all__ = ["LLMEngine", "StepOutput"]


@dataclass
class _InflightDecode:
    """A greedy decode step launched (overlap_decode) whose tokens the host has not processed yet."""

    seqs: list[Sequence]
    launch: DecodeLaunch


class LLMEngine:
    """Sequences, the scheduler and page bookkeeping in integers; every tensor lives in `self.runner`."""

    def __init__(self, cfg: EngineConfig):
        cfg.validate()
        self.cfg = cfg
        self.model_config = mc = parse_model_config(cfg.model_dir)
        self.max_model_len = mc.max_position_embeddings
        self.page_size = cfg.page_size
        self.tokenizer = load_tokenizer(cfg.model_dir)
        self.fingerprint = model_fingerprint(cfg.model_dir, cfg.quantization, cfg.load_format)
        self.think_tags = ThinkTags.from_tokenizer(self.tokenizer)  # reasoning models: max_reasoning_tokens
        self.runner = ModelRunner(cfg, mc)
        self.allocator = PageAllocator(self.runner.num_pages)
        self.scheduler = Scheduler(
            self.allocator, cfg.page_size, cfg.chunk_size, cfg.max_num_seqs, cfg.step_token_budget
        )

        self._seqs: dict[str, Sequence] = {}  # live requests, incl. finished prefill-only ones holding pages
        self._groups: dict[str, ForkGroup] = {}  # forked requests (n / best_of > 1) until their last output
        self._pending: list[StepOutput] = []  # outputs produced between steps (abort, finish_import)
        self._arrival = itertools.count()
        self._structured: StructuredCompiler | None = None  # built on the first structured-output request
        self._inflight: _InflightDecode | None = None  # overlap_decode: a launched decode step not processed yet
        mode = cfg.overlap_decode
        self._overlap = mode == "on" or (mode == "auto" and self.runner.graph_runner is not None)
        self.last_step_scheduled = False  # whether the last step() ran a forward pass
        self.last_step_prefill_tokens = 0  # tokens the last step prefilled (0: a decode step or none)
        self.last_step_decode_rows = 0  # sequences the last step decoded beside them
        self.last_step_prefill_budget = 0  # prefill tokens the last step could have taken (its full size)
        self.handoff = KVHandoff(
            self.runner,
            self.allocator,
            self.scheduler,
            mc,
            cfg.page_size,
            self._seqs,
            admit=self._admit,
            drop=self._drop,
            emit=lambda seq, new_ids, text: self._pending.append(self._output(seq, new_ids, text)),
        )
        log.info(
            "engine ready: arch=%s dtype=%s device=%s pages=%d page_size=%d chunk_size=%d step_token_budget=%d "
            "max_num_seqs=%d kv=%s backend=%s",
            mc.arch,
            dtype_name(self.runner.dtype),
            self.runner.device,
            self.allocator.num_pages,
            cfg.page_size,
            cfg.chunk_size,
            self.scheduler.step_token_budget,
            cfg.max_num_seqs,
            self.runner.kv_description(),
            self.runner.backend.name,
        )

    @property
    def overlap_decode(self) -> bool:
        """Whether greedy decode steps are launched one ahead (EngineConfig.overlap_decode resolved)."""
        return self._overlap

    @property
    def kv_storage_dtype_name(self) -> str:
        """Name of the dense KV dtype (the model dtype): 'float32' | 'bfloat16' | 'float16'."""
        return dtype_name(self.runner.dtype)

    @property
    def pool_layout(self) -> KVLayoutSpec:
        """The page format of this engine's pool: what a decode instance asks prefill to ship and what the prompt
        cache stores for it (int8/fp8 with the pool's group size, else the model dtype)."""
        mc, quantized = self.model_config, self.runner.kv_quantized
        return KVLayoutSpec(
            dtype=self.cfg.kv_dtype if quantized else self.kv_storage_dtype_name,
            page_size=self.page_size,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            group_size=self.kv_group_size if quantized else 0,
            asymmetric=self.kv_asymmetric,  # False unless the pool is int8
        )

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (`EngineRequest` says what each option does). Raises ValueError (bad input, duplicate
        id) or OutOfPages (prompt larger than the whole pool). Cached pages never appear in `ready_pages` (the
        caller already has them); a prefill-only request with `prefix_keys` reports the pool pages it started on in
        its first `ready_pages`."""
        seq = self._admit(request)
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def _admit(self, request: EngineRequest) -> Sequence:
        """A new Sequence for `request`, every option checked and applied; not live yet (the caller registers it).
        On error nothing of it stays."""
        r = request
        seq = self._new_sequence(
            r.request_id,
            r.prompt_token_ids,
            r.sampling,
            prefill_only=r.prefill_only,
            forced_token_ids=list(r.forced_token_ids) if r.forced_token_ids is not None else None,
        )
        try:
            if r.sampled_before < 0 or r.sampled_before >= seq.num_prompt_tokens:
                raise InvalidRequest(f"sampled_before {r.sampled_before} outside [0, {seq.num_prompt_tokens})")
            self.runner.skip_draws(r.request_id, r.sampled_before)
            seq.num_prior_output_tokens = r.sampled_before
            if r.resumed_tokens:
                if r.sampled_before or r.cached_pages or r.prefill_only:
                    raise InvalidRequest("resumed_tokens excludes sampled_before, cached_pages and prefill_only")
                self._resume(seq, r.resumed_tokens, r.resumed_text_chars)
            elif r.resumed_text_chars:
                raise InvalidRequest(f"resumed_text_chars {r.resumed_text_chars} given without resumed_tokens")
            if r.cached_pages:
                if r.sampling.prompt_logprobs:
                    raise InvalidRequest("prompt_logprobs needs every prompt token computed: no cached pages")
                self._check_cached_pages(seq.num_prompt_tokens, r.cached_pages)
            if r.prefix_keys:
                if r.sampling.prompt_logprobs or r.resumed_tokens:
                    raise InvalidRequest("prefix_keys excludes prompt_logprobs and resumed_tokens")
                if len(r.prefix_keys) > seq.num_prompt_tokens // self.page_size or not all(
                    isinstance(k, bytes) and k for k in r.prefix_keys
                ):
                    raise InvalidRequest(
                        f"prefix_keys: at most one non-empty key per full prompt page, got {len(r.prefix_keys)}"
                    )
                seq.prefix_keys = list(r.prefix_keys)
            if r.layer_stream is not None and not r.prefill_only:
                raise InvalidRequest("layer_stream is for prefill_only requests")
            seq.layer_stream = r.layer_stream  # its chunks' pages leave layer group by layer group (kv_handoff)
            plan = ChoicePlan.of(r.n, r.best_of)
            if plan.forks:
                if r.prefill_only or r.resumed_tokens or r.sampled_before or r.forced_token_ids is not None:
                    raise InvalidRequest("n / best_of > 1 excludes prefill_only, forced_token_ids and a resume")
                self._plan_forks(seq, plan)
            if seq.grammar is not None:  # a resume continues the structured output where it was
                seq.grammar.replay(seq.output_token_ids())
        except Exception:
            self.runner.drop_request(r.request_id)
            raise
        if r.cached_pages:
            seq.num_imported_pages = len(r.cached_pages)
            seq.cached_pages = list(r.cached_pages)
            seq.keep_cached_upload = r.keep_cached_upload
            seq.num_computed_tokens = len(r.cached_pages) * self.page_size
        seq.prefix_fetch = r.prefix_fetch  # cached pages racing the compute: prefix_fetch.load_landed
        if r.prefix_fetch is not None:  # the compute stops where the fetch starts (PrefixFetch.split_page)
            seq.prefill_stop = r.prefix_fetch.start_page * self.page_size
        return seq

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, **kw) -> Sequence:
        if request_id in self._seqs:
            raise DuplicateRequest(f"duplicate request id {request_id!r}")
        sampling.validate(self.max_model_len, self.model_config.vocab_size)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise InvalidRequest("prompt_token_ids is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; the model context is {self.max_model_len}")
        if min(ids) < 0 or max(ids) >= self.model_config.vocab_size:
            raise InvalidRequest(f"token id outside the vocabulary [0, {self.model_config.vocab_size})")
        need = -(-(len(ids) + 1) // self.page_size)
        if need > self.allocator.num_pages:
            raise OutOfPages(f"prompt needs {need} KV pages but the pool only has {self.allocator.num_pages}")
        reasoning = None
        if sampling.max_reasoning_tokens is not None:
            if self.think_tags is None:
                raise InvalidRequest(
                    "max_reasoning_tokens needs a reasoning model: this tokenizer has no <think>/</think> tokens"
                )
            reasoning = ReasoningBudget.for_prompt(self.think_tags, sampling.max_reasoning_tokens, ids)
        grammar = None
        if sampling.structured is not None:
            if self._structured is None:
                mc = self.model_config
                self._structured = StructuredCompiler(self.tokenizer, mc.vocab_size, mc.eos_token_ids)
            grammar = self._structured.matcher(sampling.structured)
        self.runner.add_request(request_id, sampling)
        return Sequence(
            request_id,
            ids,
            sampling,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids),
            arrival=next(self._arrival),
            max_model_len=self.max_model_len,
            reasoning=reasoning,
            grammar=grammar,
            **kw,
        )

    def _check_cached_pages(self, num_prompt_tokens: int, pages: list[PagePayload]) -> None:
        if len(pages) * self.page_size >= num_prompt_tokens:
            raise InvalidRequest(
                f"{len(pages)} cached pages cover all {num_prompt_tokens} prompt tokens; at least the "
                "last token must be computed"
            )
        for i, p in enumerate(pages):
            if (
                p.page_index != i
                or p.num_tokens != self.page_size
                or p.layer_start != 0
                or p.layer_count != self.model_config.num_layers
            ):
                raise InvalidRequest(
                    f"cached page {i}: got page_index {p.page_index}, {p.num_tokens} tokens, layers "
                    f"[{p.layer_start}, {p.layer_start + p.layer_count}); want full pages 0..N-1 of "
                    f"all {self.model_config.num_layers} layers"
                )
            self.runner.check_payload(p)

    def _load_cached_pages(self, seq: Sequence) -> None:
        """Write a request's cached prefix into its (just allocated) pages, on its first scheduled step."""
        pages, seq.cached_pages = seq.cached_pages, None
        assert pages is not None  # the caller checked
        if seq.num_computed_tokens < len(pages) * self.page_size:  # preempted before it ran: recomputed instead
            seq.num_imported_pages = 0
            return
        # _check_cached_pages: full pages 0..N-1 of all layers, each checked against the pool
        upload = self.runner.import_full_pages([seq.page_table[p.page_index] for p in pages], pages)
        if seq.keep_cached_upload:
            seq.cached_upload = upload

    def take_cached_upload(self, request_id: str) -> CachedUpload | None:
        """The device copy of a request's cached prefix (`keep_cached_upload`), once it was imported; None if it
        was not kept or not imported yet (or preempted first: recomputed instead). Taking it releases it."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        up, seq.cached_upload = seq.cached_upload, None
        return up

    def abort(self, request_id: str) -> bool:
        """Drop a request in any state and free its pages. If it had not finished, the next `step()` returns a
        final StepOutput with finish_reason "abort" (a forked request: one per choice still running). Returns
        False for unknown ids."""
        self.handoff.abandon(request_id)  # also when it ended already: a join on landing's finish_import won't come
        group = self._groups.pop(request_id, None)
        if group is not None:
            self._abort_forks(group)
            return True
        seq = self._drop(request_id)
        if seq is None:
            return False
        if not seq.finished and not seq.early_finished:  # an early-finished one's final output went out already
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            self._pending.append(self._output(seq, [], ""))
        return True

    def release(self, request_id: str) -> bool:
        """Free the pages of a request (normally a finished prefill-only one whose pages were shipped). Works in
        any state like `abort`, but never produces an output. Returns False for unknown ids."""
        self.handoff.abandon(request_id)
        group = self._groups.pop(request_id, None)
        if group is not None:
            for m in group.members:
                self._drop(m.request_id)
            return True
        return self._drop(request_id) is not None

    # ---- n / best_of > 1 (forks.py) ------------------------------------------------------------------------
    def _plan_forks(self, seq: Sequence, plan: ChoicePlan) -> None:
        """`seq` forks into `plan.best_of` sequences once its prompt's KV is complete."""
        seq.choices = dataclasses.replace(plan, keep_logprobs=seq.sampling.wants_logprobs)
        if plan.buffered:  # the candidates are ranked by their tokens' logprobs
            seq.sampling = dataclasses.replace(seq.sampling, logprobs=True)

    def _fork(self, seq: Sequence) -> None:
        """The prompt's KV of `seq` is complete (its token sampled after it, if any, is discarded): fork it. Every
        fork computes the last prompt position again as a decode row (its first token); the full pages before it
        are shared, the page holding it is copied for each new fork (copy-on-write). New forks wait in the queue
        (decode-ready); `seq` itself is left where it is for the caller."""
        plan, seq.choices = seq.choices, None
        assert plan is not None  # the caller checked
        rid = seq.request_id
        last_pos = seq.num_tokens - 1  # the prompt's last token (no completion yet: forks exclude a resume)
        seq.num_computed_tokens = last_pos
        last = last_pos // self.page_size
        shared, own = seq.page_table[:last], seq.page_table[last]
        group = ForkGroup(rid, plan, [seq])
        seq.group, seq.index = group, 0
        if seq.sampling.seed is not None:  # fork 0 draws as n = 1 would (a failover resumes a choice as one: router)
            self.runner.drop_request(rid)
            self.runner.add_request(rid, seq.sampling)
        for i in range(1, plan.best_of):
            child = self._new_sequence(fork_id(rid, i), seq.prompt_token_ids, fork_sampling(seq.sampling, i))
            child.group, child.index = group, i
            if self.allocator.num_free:  # else it computes the prompt itself when the pool has room
                (copy,) = self.allocator.allocate(1)
                self.allocator.hold(shared)
                self.runner.kv_cache.copy_pages([own], [copy])
                child.page_table = [*shared, copy]
                child.num_computed_tokens = last_pos
            group.members.append(child)
            self._seqs[child.request_id] = child
            self.scheduler.add(child)
        self._groups[rid] = group

    def _abort_forks(self, group: ForkGroup) -> None:
        """Abort every fork of a request: an "abort" output per choice still running (best_of > n: n of them)."""
        live = [cast(Sequence, m) for m in group.members if not m.finished]  # the engine's members are Sequences
        for m in group.members:
            self._drop(m.request_id)
        if group.plan.buffered:
            if live:
                self._pending.extend(group.collect(self._aborted(m) for m in live))
            return
        for m in live:
            self._pending.append(self._aborted(m))

    def _aborted(self, seq: Sequence) -> StepOutput:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        return self._output(seq, [], "")

    def _released(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """A step's outputs as the caller gets them: best_of > n candidates' held until the best are known; a
        forked request forgotten after its last output."""
        result = []
        for o in outputs:
            group = self._groups.get(o.request_id)
            if group is None:
                result.append(o)
                continue
            result.extend(group.collect([o]) if group.plan.buffered else [o])
            if o.request_done:
                del self._groups[o.request_id]
        return result

    def prefix_pages_held(self, prefix_keys: list[bytes]) -> int:
        """How many leading pages of `prefix_keys` the pool holds now (any thread; a later admission may find
        fewer if they are evicted meanwhile)."""
        return len(self.allocator.held_prefix(prefix_keys))

    def _register_prefix(self, seq: Sequence) -> None:
        """Register the full prompt pages `seq` computed here (not the imported ones) under their keys."""
        keys = seq.prefix_keys
        if not keys:
            return
        n = min(len(keys), seq.num_computed_tokens // self.page_size, len(seq.page_table))
        for i in range(seq.num_imported_pages, n):
            self.allocator.register(seq.page_table[i], keys[i])

    def _drop(self, request_id: str) -> Sequence | None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.handoff.forget(request_id)
            self.scheduler.remove(seq)
            self._register_prefix(seq)
            self.scheduler.free_pages(seq)
            seq.cached_pages = seq.cached_upload = None
            self.runner.drop_request(request_id)
        return seq

    # ---- disaggregated handoff: `self.handoff` (kv_handoff.py) -----------------------------------------------
    @property
    def kv_group_size(self) -> int:
        """int8 group size of this engine's pool and of its int8 exports by default."""
        return self.handoff.kv_group_size

    @property
    def kv_asymmetric(self) -> bool:
        return self.handoff.kv_asymmetric

    def export_batch(self, request_id: str, page_indexes: list[int], layout: KVLayoutSpec) -> ExportedPages:
        """`KVHandoff.export_batch`: computed pages of a request as one buffer in `layout`."""
        return self.handoff.export_batch(request_id, page_indexes, layout)

    def begin_import(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        resumed_tokens: int = 0,
        resumed_text_chars: int = 0,
        n: int = 1,
        best_of: int = 0,
    ) -> None:
        """`KVHandoff.begin_import`: reserve pages for a prompt whose KV comes from a prefill instance. `n`,
        `best_of` as EngineRequest's: the request forks at `finish_import` (prefill's first token is not used)."""
        plan = ChoicePlan.of(n, best_of)
        if plan.forks and resumed_tokens:
            raise InvalidRequest("n / best_of > 1 excludes a failover resume")
        self.handoff.begin_import(request_id, prompt_token_ids, sampling, resumed_tokens, resumed_text_chars)
        if plan.forks:
            self._plan_forks(self._seqs[request_id], plan)

    def import_batch(
        self,
        request_id: str,
        page_indexes: list[int],
        num_tokens: list[int],
        rows: torch.Tensor,
        layout: KVLayoutSpec,
        layers: LayerRange | None = None,
    ) -> None:
        """`KVHandoff.import_batch`: write received pages (all layers, or a layer group's) in one scatter."""
        self.handoff.import_batch(request_id, page_indexes, num_tokens, rows, layout, layers)

    def emit_first_token(self, request_id: str, first_token_id: int) -> bool:
        """`KVHandoff.emit_first_token`: stream the first token before the pages are in (the request joins the batch
        as soon as they are)."""
        seq = self._seqs.get(request_id)
        if seq is not None and seq.choices is not None:
            raise InvalidRequest(f"request {request_id!r} forks (n / best_of > 1): its first tokens are sampled here")
        return self.handoff.emit_first_token(request_id, first_token_id)

    def import_forks(self, request_id: str) -> bool:
        """Whether `finish_import` of this request forks it (n / best_of > 1: copies a page on the device)."""
        seq = self._seqs.get(request_id)
        return seq is not None and seq.choices is not None

    def finish_import(self, request_id: str, first_token_id: int) -> None:
        """`KVHandoff.finish_import`: all pages are in, the request joins the running batch (a forking one forks;
        one that joined as its last page landed is only checked, also once it ended)."""
        seq = self._seqs.get(request_id)
        if self.handoff.joined(request_id) or seq is None or seq.choices is None:
            self.handoff.finish_import(request_id, first_token_id)
            return
        if seq.status != SequenceStatus.IMPORTING or seq.pages_imported is None:
            raise InvalidRequest(f"request {request_id!r} is not importing")
        missing = [i for i, n in enumerate(seq.pages_imported) if n != self.model_config.num_layers]
        if missing:
            raise InvalidRequest(f"request {request_id!r}: pages {missing} not imported")
        seq.pages_imported = None
        self.handoff.forget(request_id)
        self._fork(seq)
        self.scheduler.add(seq)  # decode-ready: its next step computes its first token

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or self._inflight is not None

    def request_ids(self) -> list[str]:
        """Ids of live requests (queued, running, importing, or finished prefill-only holding pages)."""
        return list(self._seqs)

    def _resume(self, seq: Sequence, k: int, emitted_chars: int) -> None:
        ids = seq.prompt_token_ids
        if not 0 < k < len(ids) or k >= seq.sampling.max_tokens:
            raise InvalidRequest(f"resumed_tokens {k} must be in [1, min(prompt length, max_tokens))")
        seq.prompt_token_ids, seq.completion_token_ids = ids[:-k], ids[-k:]
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        seq.text = "".join(seq.detokenizer.add(t) for t in seq.completion_token_ids)
        if not 0 <= emitted_chars <= len(seq.text):
            raise InvalidRequest(
                f"resumed_text_chars {emitted_chars} outside [0, {len(seq.text)}] (the resumed tokens' text)"
            )
        seq.num_emitted_chars = emitted_chars
        self.runner.skip_draws(seq.request_id, k)

    # ---- stepping ------------------------------------------------------------------------------------------
    def take_pending(self) -> list[StepOutput]:
        """Outputs produced outside a step (first token of an import, aborts), without running a step: lets the
        caller stream a decode request's first token before the next batch computes."""
        pending, self._pending = self._pending, []
        return self._released(pending)

    def step(self, return_logits: bool = False) -> list[StepOutput]:
        """Run one step (scheduler.py: a decode row for every running sequence and prefill chunks within the step's
        token budget, in one forward); return outputs (at most one per request).

        overlap_decode: a greedy decode batch is launched and its tokens are processed by the next call, which
        first launches the following step of the same batch (its inputs are the launched step's tokens, still on
        the device) when nothing else waits to be scheduled: the host's per-token work runs beside the GPU's next
        step. A sequence that finished meanwhile drops its row of that step (its KV write landed in its own pages,
        freed after it in stream order)."""
        outputs: dict[tuple[str, int], StepOutput] = {}
        for o in self._pending:
            self._merge(outputs, o)
        self._pending = []
        if self._inflight is not None:
            done, self._inflight = self._inflight, None
            self._inflight = self._chain(done)
            for o in self._finish_decode(done):
                self._merge(outputs, o)
            if self._inflight is not None:  # structured output: its masks fill while the launched step computes
                self._inflight.launch.start_masks()
            self.last_step_scheduled, self.last_step_prefill_tokens = True, 0
            self.last_step_decode_rows, self.last_step_prefill_budget = len(done.seqs), 0
            return self._released(list(outputs.values()))
        load_landed(self)  # prefix pages fetched before the compute reached them (prefix_fetch.py)
        batch = self.scheduler.schedule()
        self.last_step_scheduled = batch is not None
        self.last_step_prefill_tokens = batch.num_prefill_tokens if batch is not None else 0
        self.last_step_decode_rows = batch.num_decode if batch is not None else 0
        self.last_step_prefill_budget = batch.prefill_budget if batch is not None else 0
        if batch is not None and not return_logits and self._overlappable(batch):
            self._load_cached(batch.seqs)  # a decode-ready request's first row: its prefix is all cached pages
            positions = [s.num_computed_tokens for s in batch.seqs]
            self._inflight = _InflightDecode(batch.seqs, self.runner.launch_decode(batch.seqs, positions, None))
        elif batch is not None:
            for o in self._run(batch, return_logits):
                self._merge(outputs, o)
        return self._released(list(outputs.values()))

    # ---- overlapped greedy decode (EngineConfig.overlap_decode) ---------------------------------------------
    def _overlappable(self, batch: ScheduledBatch) -> bool:
        """A decode batch whose every token is a plain greedy draw: no logprobs, forced tokens or reasoning budget
        (those need the host between steps), and room for one more position in every sequence."""
        if not self._overlap or not batch.is_decode:
            return False
        limit = self.max_model_len - 2  # the chained step computes position num_computed_tokens + 1
        for s in batch.seqs:
            sp = s.sampling
            if (
                not sp.greedy
                or sp.wants_logprobs
                or sp.needs_host_logits  # a structured output alone: the decode graph draws among its tokens
                or s.forced_token_ids is not None
                or s.reasoning is not None
                or s.choices is not None  # forks after this token (`_fork` resets it)
                or s.num_computed_tokens > limit
            ):
                return False
        return self.runner.can_chain(len(batch.seqs), max(s.num_computed_tokens for s in batch.seqs) + 1)

    def _chain(self, done: _InflightDecode) -> _InflightDecode | None:
        """Launch the next step of `done`'s batch before its tokens are processed, if the scheduler would run
        exactly that batch again: nothing to admit or prefill, no sequence gone, pages for one more token each, and
        no import whose pages all just landed (its `finish_import`, an anytime command of the EngineLoop, runs while
        `done` computes: chained, the step after would leave it out and its second token would wait a step more). One
        that joined as it landed (its first token came early), or at its first token during a GPU wait, waits in the
        scheduler's queue: that holds the chain back too."""
        seqs = done.seqs
        if self.scheduler.running != seqs or self.scheduler.has_schedulable_waiting():
            return None
        if self.handoff.take_landed():  # its finish_import comes during this wait: the next step takes it along
            return None
        if not self._overlappable(ScheduledBatch(seqs, [1] * len(seqs), len(seqs))):
            return None
        need = [self.scheduler.pages_for(s, s.num_computed_tokens + 2) for s in seqs]
        if sum(need) > self.allocator.num_free:
            return None  # the next regular step preempts
        for s, n in zip(seqs, need):
            if n:
                s.page_table.extend(self.allocator.allocate(n))
        positions = [s.num_computed_tokens + 1 for s in seqs]
        return _InflightDecode(seqs, self.runner.launch_decode(seqs, positions, done.launch))

    def _finish_decode(self, done: _InflightDecode) -> list[StepOutput]:
        """The tokens of a launched step, for the sequences still running (one that finished, was aborted or
        released since the launch drops its row)."""
        outputs = []
        for seq, token in zip(done.seqs, done.launch.tokens()):
            if self._seqs.get(seq.request_id) is not seq or seq.status != SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += 1
            outputs.append(self._postprocess_token(seq, token, False, None))
        return outputs

    @staticmethod
    def _merge(outputs: dict[tuple[str, int], StepOutput], o: StepOutput) -> None:
        key = (o.request_id, o.index)
        prev = outputs.get(key)
        outputs[key] = o if prev is None else o.after(prev)

    def _output(
        self,
        seq: Sequence,
        new_ids: list[int],
        text: str,
        ready: list[int] | None = None,
        logits: torch.Tensor | None = None,
    ) -> StepOutput:
        group = seq.group
        return StepOutput(
            seq.request_id if group is None else group.request_id,
            new_ids,
            text,
            seq.finished,
            seq.finish_reason,
            seq.num_prompt_tokens,
            seq.num_completion_tokens,
            ready or [],
            logits,
            seq.stop_reason,
            index=seq.index,
            choices_left=0 if group is None else group.live(),
        )

    def _load_cached(self, seqs: list[Sequence]) -> None:
        """Write the cached prefixes of the step's sequences scheduled for the first time (before its forward)."""
        for seq in seqs:
            if seq.cached_pages is not None:
                self._load_cached_pages(seq)

    def _run(self, batch: ScheduledBatch, return_logits: bool) -> list[StepOutput]:
        self._load_cached(batch.seqs)
        sample_rows = [
            i
            for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
            if s.num_computed_tokens + n == s.num_tokens
        ]
        with self.handoff.layer_export(batch):  # a streaming chunk's layer groups leave during the forward
            tokens, logits, logprobs, prompt_lps = self.runner.run(
                batch.seqs, batch.num_new_tokens, sample_rows, batch.num_decode, return_logits
            )
        outputs = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            seq.num_computed_tokens += n
            row = logits.get(i)
            new_prompt_lps = self._new_prompt_logprobs(seq, start, prompt_lps.get(i))
            forks = i in tokens and seq.choices is not None
            if forks:  # the prompt's KV is complete: the request forks (its token here is not used)
                self._fork(seq)
                if i >= batch.num_decode:
                    self.scheduler.prefill_done(seq)
            if seq.prefill_only:
                out = self._postprocess_prefill_only(seq, start, tokens.get(i), row)[0]
            elif i in tokens and not forks:
                out = self._postprocess_token(seq, tokens[i], i >= batch.num_decode, row)
            elif new_prompt_lps:  # a prompt chunk before the last: its scores go out now
                out = self._output(seq, [], "")
            else:
                continue
            out.prompt_logprobs = new_prompt_lps
            if i in logprobs and not forks:
                out.logprobs = [logprobs[i]]
            outputs.append(out)
        return outputs

    @staticmethod
    def _new_prompt_logprobs(seq: Sequence, start: int, values: list[TokenLogprob] | None) -> list[TokenLogprob]:
        """The part of a chunk's prompt logprobs not reported before (a preempted request recomputes its prompt)."""
        if not values:
            return []
        new = values[max(0, seq.num_prompt_logprobs - start) :]
        seq.num_prompt_logprobs = max(seq.num_prompt_logprobs, start + len(values))
        return new

    def _postprocess_prefill_only(
        self, seq: Sequence, start: int, token: int | None, row: torch.Tensor | None
    ) -> list[StepOutput]:
        ps, end = self.page_size, seq.num_computed_tokens
        ready = list(range(start // ps, end // ps))
        if not seq.shared_pages_reported:  # the pool's prefix pages are ready from the start
            ready = list(range(seq.num_shared_pages)) + ready
            seq.shared_pages_reported = True
        if token is not None:
            if end % ps:
                ready.append(end // ps)  # the last, partial page is final now
            seq.completion_token_ids.append(token)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "prefill_done"
            self.scheduler.remove(seq)  # pages stay allocated until release()
        out = self._output(seq, [] if token is None else [token], "", ready, row)
        out.token_range = (start, end)  # one output per chunk, also without ready pages (chunk spans)
        return [out]

    def _postprocess_token(self, seq: Sequence, token: int, was_prefill: bool, row: torch.Tensor | None) -> StepOutput:
        forced = seq.forced_token()
        if forced is not None:
            token = forced
        text = seq.append_token(token, self.model_config.eos_token_ids)
        out = self._output(seq, [token], text, logits=row)
        if seq.finished:
            self._drop(seq.request_id)
        elif was_prefill:
            self.scheduler.prefill_done(seq)
        return out

    # ---- convenience ---------------------------------------------------------------------------------------
    def generate(
        self, prompts_token_ids: list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion (test helper); returns the completion token ids of each."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts_token_ids)
        rids = [f"gen-{uuid.uuid4().hex}" for _ in prompts_token_ids]
        results: dict[str, list[int]] = {r: [] for r in rids}
        for rid, prompt, sp in zip(rids, prompts_token_ids, params):
            self.add_request(EngineRequest(rid, prompt, sp))
        pending = set(rids)
        while pending:
            for o in self.step():
                if o.request_id in results:
                    results[o.request_id].extend(o.new_token_ids)
                    if o.finished:
                        pending.discard(o.request_id)
        return [results[r] for r in rids]
