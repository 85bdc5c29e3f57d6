"""The engine's side of disaggregated serving: a prefill instance exports the computed KV pages of a request as one
batch buffer; a decode instance reserves pages for a prompt computed elsewhere, imports batches of them, takes the
prefill side's first token, and joins its running batch: at `finish_import` (prefill's PrefillDone read), or, when
the first token came ahead of the pages (`emit_first_token`), as soon as the last layer of the last page lands.

`KVHandoff` is an object `LLMEngine` owns (`engine.handoff`; the engine keeps methods of the same names that call
it). It reads and updates the engine's live sequences, page allocator, scheduler and model runner, and asks the
engine, through the three callables it was given, to admit a sequence, drop one, and queue an output.

Layer groups (`pdserve.kv.transfer.layers`): around each forward the engine enters `layer_export(batch)`. When a
prefill-only sequence of the batch streams its pages (`Sequence.layer_stream`), the model's per-layer hook is set for
that forward: after the last layer of each group, the chunk's pages that the step completes are gathered at those
layers on the compute stream, a CUDA event is recorded (no host sync) and the rows go to the stream's sink; the
sender copies them after the event while the forward runs on. Decode imports each group into its pages
(`import_batch(..., layers)`); a page is in once all its layers landed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from pdserve.engine.host_to_device import to_device
from pdserve.engine.loader import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.page_table import PageAllocator
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.tp.page_export import LayerExport
from pdserve.errors import DuplicateRequest, InvalidRequest
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer.base import ExportedPages
from pdserve.kv.transfer.layers import LayerRange, LayerStream
from pdserve.kv.transfer.page_format import PageFormat

# One sequence's part of a layer-streaming forward: (sequence, logical pages the step completes, their token counts,
# their physical pages on the device (made before the forward), its stream, the group ending at each layer)
_LayerPlan = tuple[Sequence, list[int], list[int], torch.Tensor, LayerStream, dict[int, LayerRange]]


def export_of(plan: _LayerPlan, r: LayerRange) -> LayerExport:
    """Layer group `r` of a streaming chunk, as a tensor-parallel step plan names it (`tp.page_export`)."""
    seq, pages, tokens, _, stream, _ = plan
    lay = stream.layout
    physical = [seq.page_table[i] for i in pages]
    return LayerExport(
        r.start, r.stop, physical, list(tokens), lay.quantized, lay.group_size, lay.asymmetric, lay.torch_dtype
    )


def _kv_tokens(seq: Sequence) -> int:
    """Tokens whose K/V an importing sequence receives: all but a first token streamed ahead of the pages."""
    return seq.num_tokens - (seq.early_first_token is not None)


class KVHandoff:
    """Page export (prefill side) and import (decode side) for one engine.

    `seqs`: the engine's live sequences by request id (shared, not copied). `admit(request)`: a new, validated
    Sequence (a failover resume applied), not yet live. `drop(request_id)`: end a live request and free its pages.
    `emit(seq, new_token_ids, text)`: queue an output for the engine's next `take_pending` / `step`."""

    def __init__(
        self,
        runner: ModelRunner,
        allocator: PageAllocator,
        scheduler: Scheduler,
        model_config: ModelConfig,
        page_size: int,
        seqs: dict[str, Sequence],
        admit: Callable[[EngineRequest], Sequence],
        drop: Callable[[str], Sequence | None],
        emit: Callable[[Sequence, list[int], str], None],
    ):
        self.runner = runner
        self.allocator = allocator
        self.scheduler = scheduler
        self.model_config = model_config
        self.page_size = page_size
        self._seqs = seqs
        self._admit = admit
        self._drop = drop
        self._emit = emit
        # imports whose every page landed, not finished yet, since the engine last looked (`take_landed`): their
        # `finish_import` is on its way, and an overlapped decode step chained now would leave them out of the next
        # step (at most the importing requests: `finish_import` and `forget` take them out)
        self._landed: set[str] = set()
        # imports that joined the batch as their last page landed (`_join_on_landing`), by request id: the early first
        # token their `finish_import` must match. Kept when the request ends, which may come before that
        # finish_import (a short max_tokens); removed by it, or by `abandon` (an abort or release: the service gave
        # up on the request, so its finish_import will not come)
        self._joined: dict[str, int] = {}

    @property
    def kv_group_size(self) -> int:
        """int8 group size of the engine's pool and of its int8 exports by default."""
        return self.runner.kv_group_size

    @property
    def kv_asymmetric(self) -> bool:
        return self.runner.kv_asymmetric

    # ---- prefill side: page export -------------------------------------------------------------------------
    def _computed_pages(self, request_id: str, page_indexes: list[int]) -> tuple[Sequence, list[int]]:
        """The request's sequence and the valid token count of each of its pages `page_indexes`; raises
        InvalidRequest for an unknown request or a page with no computed KV."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise InvalidRequest(f"unknown request {request_id!r}")
        num_tokens = []
        for idx in page_indexes:
            n = min(self.page_size, seq.num_computed_tokens - idx * self.page_size)
            if idx < 0 or idx >= len(seq.page_table) or n <= 0:
                raise InvalidRequest(
                    f"page {idx} of {request_id!r} has no computed KV ({seq.num_computed_tokens} tokens computed)"
                )
            num_tokens.append(n)
        return seq, num_tokens

    def export_batch(self, request_id: str, page_indexes: list[int], layout: KVLayoutSpec) -> ExportedPages:
        """The computed pages `page_indexes` of a request as one page-major buffer in `layout`
        (`pdserve.kv.transfer.page_format`), gathered on the device; its `ready` event marks the gather."""
        seq, num_tokens = self._computed_pages(request_id, page_indexes)
        return self._gather(seq, list(page_indexes), num_tokens, layout, None)

    def _gather(
        self,
        seq: Sequence,
        page_indexes: list[int],
        num_tokens: list[int],
        layout: KVLayoutSpec,
        layers: LayerRange | None,
        index: torch.Tensor | None = None,
    ) -> ExportedPages:
        """Pages of `seq` (their `layers`; None: all) as one page-major buffer uint8 [N, row bytes] in `layout`,
        gathered on the compute stream (`index`: their physical pages on the device, made ahead); its `ready` event
        is recorded after the gather."""
        data, scales, zeros = self.runner.kv_cache.gather_pages(
            [seq.page_table[i] for i in page_indexes],
            num_tokens,
            layout.quantized,
            layout.group_size,
            layout.asymmetric,
            layout.torch_dtype,
            None if layers is None else (layers.start, layers.stop),
            index,
        )
        rows = PageFormat(layout, 0 if layers is None else layers.count).pack(data, scales, zeros)
        return ExportedPages(page_indexes, num_tokens, rows, self.runner.record_event(), layers=layers)

    @contextmanager
    def layer_export(self, batch: ScheduledBatch) -> Iterator[None]:
        """Around one forward of `batch`: the model's per-layer hook exports the layer groups of the chunks whose
        sequence streams its pages (`Sequence.layer_stream`); no hook (no cost) when none does."""
        plans = self._layer_plans(batch)
        model = self.runner.model
        if not plans:
            yield
            return
        runner = self.runner
        runner.layer_export_ns = 0

        def hook(layer: int) -> None:
            t0 = time.perf_counter_ns()
            self._export_layer(plans, layer)
            runner.layer_export_ns += time.perf_counter_ns() - t0

        model.layer_hook = hook
        if self.runner.tp is not None:  # the step's plan names the groups: every rank's hook joins their gathers
            self.runner.layer_exports = [export_of(p, r) for p in plans for r in p[4].groups()]
        try:
            yield
        finally:
            model.layer_hook = None
            self.runner.layer_exports = []

    def _layer_plans(self, batch: ScheduledBatch) -> list[_LayerPlan]:
        """The streaming chunks of a batch: the pages each completes (its full pages; the last, partial one too
        when the chunk ends the prompt, as `ready_pages` will report them) with their token counts."""
        plans: list[_LayerPlan] = []
        ps = self.page_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            stream = seq.layer_stream
            if stream is None or not seq.prefill_only:
                continue
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            pages = list(range(start // ps, end // ps))
            if end == seq.num_tokens and end % ps:
                pages.append(end // ps)
            if pages:
                tokens = [min(ps, end - i * ps) for i in pages]
                physical = [seq.page_table[i] for i in pages]
                index = to_device(physical, torch.long, self.runner.kv_cache.device)  # [N]; no host-GPU sync
                plans.append((seq, pages, tokens, index, stream, stream.ending_at()))
        return plans

    def _export_layer(self, plans: list[_LayerPlan], layer: int) -> None:
        """The model's hook after `layer`'s K/V are written: each group ending at it goes to its stream's sink."""
        for seq, pages, tokens, index, stream, ending_at in plans:
            group = ending_at.get(layer)
            if group is not None:
                stream.sink(self._gather(seq, list(pages), list(tokens), stream.layout, group, index))

    # ---- decode side: page import --------------------------------------------------------------------------
    def begin_import(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        resumed_tokens: int = 0,
        resumed_text_chars: int = 0,
    ) -> None:
        """Reserve pages for a prompt whose KV comes from a prefill instance. Raises OutOfPages (nothing
        allocated) or ValueError.

        Failover resume: `resumed_tokens` k > 0 says the last k tokens of `prompt_token_ids` were generated for
        this request by an instance that died. They count as completion tokens (max_tokens, usage, stop strings
        spanning the boundary), and the first `resumed_text_chars` characters of their text were delivered
        already: text held back there (a possible stop-string prefix, an incomplete character) comes out here."""
        if request_id in self._joined:  # joined on landing, its finish_import still to come: the id is in use
            raise DuplicateRequest(f"duplicate request id {request_id!r}")
        request = EngineRequest(
            request_id,
            prompt_token_ids,
            sampling,
            resumed_tokens=resumed_tokens,
            resumed_text_chars=resumed_text_chars,
        )
        seq = self._admit(request)
        try:
            n_pages = -(-seq.num_tokens // self.page_size)
            seq.page_table = self.allocator.allocate(n_pages)
        except Exception:
            self.runner.drop_request(request_id)
            raise
        seq.status = SequenceStatus.IMPORTING
        seq.pages_imported = [0] * n_pages
        self._seqs[request_id] = seq

    def _importing(self, request_id: str) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.IMPORTING:
            raise InvalidRequest(f"request {request_id!r} is not importing")
        return seq

    def import_batch(
        self,
        request_id: str,
        page_indexes: list[int],
        num_tokens: list[int],
        rows: torch.Tensor,
        layout: KVLayoutSpec,
        layers: LayerRange | None = None,
    ) -> None:
        """Write received pages (rows uint8 [N, row bytes] in `layout`, on the pool's device: every layer, or the
        `layers` of a layer group) in one scatter. A page's layers land in order from layer 0. The batch that
        completes an import whose first token came early joins it to the batch (`_join_on_landing`). Raises
        InvalidRequest on any mismatch."""
        seq = self._importing(request_id)
        imported = seq.pages_imported
        assert imported is not None  # an importing sequence has its per-page layer counts
        num_layers = self.model_config.num_layers
        r = layers or LayerRange(0, num_layers)
        if not 0 <= r.start < r.stop <= num_layers:
            raise InvalidRequest(f"layers [{r.start}, {r.stop}) outside the model's {num_layers}")
        for idx, n in zip(page_indexes, num_tokens, strict=True):
            if not 0 <= idx < len(seq.page_table):
                raise InvalidRequest(f"page_index {idx} outside 0..{len(seq.page_table) - 1}")
            want = min(self.page_size, _kv_tokens(seq) - idx * self.page_size)
            if n != want:
                raise InvalidRequest(f"page {idx} carries {n} tokens, expected {want}")
            if imported[idx] != r.start:
                what = "imported twice" if imported[idx] >= r.stop else "out of order"
                raise InvalidRequest(f"page {idx}: layers [{r.start}, {r.stop}) {what} ({imported[idx]} landed)")
        data, scales, zeros = PageFormat(layout, r.count).unpack(rows)
        physical_pages = [seq.page_table[i] for i in page_indexes]
        span = None if layers is None else (r.start, r.stop)
        self.runner.kv_cache.scatter_pages(physical_pages, data, scales, zeros, layout.group_size, span)
        for idx in page_indexes:
            imported[idx] = r.stop
        if r.stop == num_layers and self._all_landed(imported):
            self._landed.add(request_id)
            self._join_on_landing(seq)

    def _all_landed(self, pages_imported: list[int]) -> bool:
        return all(n == self.model_config.num_layers for n in pages_imported)

    def _join_on_landing(self, seq: Sequence) -> None:
        """An importing `seq` whose first token came early without ending it joins the running batch once every
        page has all its layers, not at its `finish_import`, which waits for prefill's PrefillDone to be read: its
        first decode step need not wait for that message. A forking one waits for it (`_fork` copies a page)."""
        early, imported = seq.early_first_token, seq.pages_imported
        if early is None or seq.early_finished or seq.choices is not None or imported is None:
            return
        if not self._all_landed(imported):
            return
        seq.pages_imported = None
        self.scheduler.add(seq)  # WAITING, decode-ready (its first token is in)
        self._joined[seq.request_id] = early

    def joined(self, request_id: str) -> bool:
        """Whether the request joined the batch as its last page landed and its `finish_import` is still to come."""
        return request_id in self._joined

    def forget(self, request_id: str) -> None:
        """The request ended (finished its import, aborted, released): no longer a landing to wait for. A join on
        landing stays remembered: the request may end before its `finish_import` comes."""
        self._landed.discard(request_id)

    def abandon(self, request_id: str) -> None:
        """The request was aborted or released (the service gave up on it): no `finish_import` of a join on landing
        will come."""
        self._joined.pop(request_id, None)

    def take_landed(self) -> bool:
        """Whether an import's last page landed since the last call (then forgotten: a chained step is held back
        once per landing, not again if its `finish_import` is late)."""
        landed = bool(self._landed)
        self._landed.clear()
        return landed

    def emit_first_token(self, request_id: str, first_token_id: int) -> bool:
        """Before the pages are all in: append the first token (stop checks apply) and stream it now (the next
        `take_pending` / `step`); the request keeps importing. Unless the token ended it, it joins the batch as soon
        as its last page lands (here, if that happened already): `finish_import` then only checks the token. One it
        ended is dropped by `finish_import`. Returns whether it ended the request."""
        seq = self._importing(request_id)
        if seq.early_first_token is not None:
            raise InvalidRequest(f"request {request_id!r}: first token sent twice")
        self._append_first(seq, first_token_id)
        seq.early_first_token = int(first_token_id)
        # the output says whether the token ended the request; it joins the batch once the pages are in (or now)
        seq.early_finished, seq.status = seq.finished, SequenceStatus.IMPORTING
        self._join_on_landing(seq)
        return seq.early_finished

    def finish_import(self, request_id: str, first_token_id: int) -> None:
        """All pages are in: append the first token (stop checks apply) and join the running batch. The
        StepOutput carrying the first token comes from the next `step()`. After `emit_first_token` the token must
        be the same one, and nothing more is output here. A request that joined on landing is only checked: it may
        have finished and been dropped since, which is no error."""
        early = self._joined.get(request_id)
        if early is not None:
            if early != first_token_id:  # the entry stays, as an importing request would: the service aborts it
                raise InvalidRequest(f"first token {first_token_id} differs from the one streamed early ({early})")
            del self._joined[request_id]
            return
        seq = self._importing(request_id)
        self.forget(request_id)
        assert seq.pages_imported is not None  # set by begin_import while IMPORTING
        missing = [i for i, landed in enumerate(seq.pages_imported) if landed != self.model_config.num_layers]
        if missing:
            raise InvalidRequest(f"request {request_id!r}: pages {missing} not imported")
        early = seq.early_first_token
        if early is not None and early != first_token_id:
            raise InvalidRequest(f"first token {first_token_id} differs from the one streamed early ({early})")
        seq.pages_imported = None
        if early is None:
            self._append_first(seq, first_token_id)
        elif seq.early_finished:
            seq.status = SequenceStatus.FINISHED
        else:
            seq.status = SequenceStatus.WAITING
        if seq.finished:
            self._drop(request_id)
        else:
            self.scheduler.add(seq)

    def _append_first(self, seq: Sequence, first_token_id: int) -> None:
        """The prefill side's first token into an importing sequence, its output pending (status: WAITING, or
        FINISHED when the token ended the request)."""
        if not 0 <= first_token_id < self.model_config.vocab_size:
            raise InvalidRequest(f"first token {first_token_id} outside the vocabulary")
        seq.num_computed_tokens = seq.num_tokens  # the prompt (+ resumed tokens)
        # The prefill side drew once from the same seed for the first token; skip that draw so a seeded request
        # samples exactly as it would on a single engine.
        self.runner.skip_draws(seq.request_id, 1)
        seq.status = SequenceStatus.WAITING
        text = seq.append_token(int(first_token_id), self.model_config.eos_token_ids)
        self._emit(seq, [int(first_token_id)], text)
