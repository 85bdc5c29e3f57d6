"""The engine's side of disaggregated serving: a prefill instance exports the computed KV pages of a request as one
batch buffer; a decode instance reserves pages for a prompt computed elsewhere, imports batches of them, takes the
prefill side's first token, and joins its running batch.

`KVHandoff` is an object `LLMEngine` owns (`engine.handoff`; the engine keeps methods of the same names that call
it). It reads and updates the engine's live sequences, page allocator, scheduler and model runner, and asks the
engine, through the three callables it was given, to admit a sequence, drop one, and queue an output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.loader import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.page_table import PageAllocator
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.errors import InvalidRequest
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer.base import ExportedPages
from pdserve.kv.transfer.page_format import PageFormat


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
        data, scales, zeros = self.runner.kv_cache.gather_pages(
            [seq.page_table[i] for i in page_indexes],
            num_tokens,
            layout.quantized,
            layout.group_size,
            layout.asymmetric,
            layout.torch_dtype,
        )
        rows = PageFormat(layout).pack(data, scales, zeros)
        return ExportedPages(list(page_indexes), num_tokens, rows, self.runner.record_event())

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
        seq.pages_imported = [False] * n_pages
        self._seqs[request_id] = seq

    def _importing(self, request_id: str) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.IMPORTING:
            raise InvalidRequest(f"request {request_id!r} is not importing")
        return seq

    def import_batch(
        self, request_id: str, page_indexes: list[int], num_tokens: list[int], rows: torch.Tensor, layout: KVLayoutSpec
    ) -> None:
        """Write received whole pages (rows uint8 [N, page_bytes] in `layout`, on the pool's device) in one
        scatter. Raises InvalidRequest on any mismatch."""
        seq = self._importing(request_id)
        imported = seq.pages_imported
        assert imported is not None  # an importing sequence has its flags
        for idx, n in zip(page_indexes, num_tokens, strict=True):
            if not 0 <= idx < len(seq.page_table):
                raise InvalidRequest(f"page_index {idx} outside 0..{len(seq.page_table) - 1}")
            want = min(self.page_size, _kv_tokens(seq) - idx * self.page_size)
            if n != want:
                raise InvalidRequest(f"page {idx} carries {n} tokens, expected {want}")
            if imported[idx]:
                raise InvalidRequest(f"page {idx} imported twice")
        data, scales, zeros = PageFormat(layout).unpack(rows)
        physical_pages = [seq.page_table[i] for i in page_indexes]
        self.runner.kv_cache.scatter_pages(physical_pages, data, scales, zeros, layout.group_size)
        for idx in page_indexes:
            imported[idx] = True

    def emit_first_token(self, request_id: str, first_token_id: int) -> bool:
        """Before the pages are all in: append the first token (stop checks apply) and stream it now (the next
        `take_pending` / `step`); the request keeps importing. `finish_import` then only checks the token and
        joins the batch, or drops the request when this token ended it. Returns whether it ended the request."""
        seq = self._importing(request_id)
        if seq.early_first_token is not None:
            raise InvalidRequest(f"request {request_id!r}: first token sent twice")
        self._append_first(seq, first_token_id)
        seq.early_first_token = int(first_token_id)
        # the output says whether the token ended the request; the pages keep arriving until finish_import
        seq.early_finished, seq.status = seq.finished, SequenceStatus.IMPORTING
        return seq.early_finished

    def finish_import(self, request_id: str, first_token_id: int) -> None:
        """All pages are in: append the first token (stop checks apply) and join the running batch. The
        StepOutput carrying the first token comes from the next `step()`. After `emit_first_token` the token must
        be the same one, and nothing more is output here."""
        seq = self._importing(request_id)
        assert seq.pages_imported is not None  # set by begin_import while IMPORTING
        missing = [i for i, done in enumerate(seq.pages_imported) if not done]
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
