"""Per-request state: token ids, KV progress, page table, stop conditions, incremental detokenization."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.forks import ChoicePlan, ForkGroup
from pdserve.engine.reasoning_budget import ReasoningBudget
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.structured import GrammarState
from pdserve.kv.payload import CachedUpload, PagePayload
from pdserve.kv.transfer.layers import LayerStream

if TYPE_CHECKING:
    from pdserve.cache.prefix_fetch import PrefixFetch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for (chunked) prefill; also after preemption (recompute)
    PREFILLING = "prefilling"  # part of its tokens computed, more chunks to go
    RUNNING = "running"  # in the decode batch
    IMPORTING = "importing"  # decode side: pages reserved, KV arriving from a prefill instance
    FINISHED = "finished"


class IncrementalDetokenizer:
    """Text deltas from a growing token list, decoding only a small window per token (prefix/read offsets,
    as in vLLM). Never emits a trailing U+FFFD: an incomplete UTF-8 sequence waits for the next token."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], context: int = 5):
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(prompt_token_ids[-context:])  # a little prompt context for spacing
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        # A HF fast tokenizer decodes through its Rust `tokenizers.Tokenizer` (`_tokenizer`): calling that directly
        # gives the same text without transformers' per-call Python work, which would otherwise be most of a large
        # decode batch's host time per step.
        backend = getattr(tokenizer, "_tokenizer", None)
        self._rust_decode: Callable[..., str] | None = None
        if backend is not None and type(backend).__module__.startswith("tokenizers"):
            self._rust_decode = backend.decode
        self._prefix: tuple[int, int, str] | None = None  # (prefix_offset, read_offset, its text): moves rarely

    def _decode(self, ids: list[int]) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        self.tokens.append(token_id)
        key = (self.prefix_offset, self.read_offset)
        if self._prefix is None or self._prefix[:2] != key:
            self._prefix = (*key, self._decode(self.tokens[self.prefix_offset : self.read_offset]))
        prefix = self._prefix[2]
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return delta
        return ""


@dataclass(eq=False)  # identity semantics: sequences live in queues and dicts
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prefill_only: bool = False
    forced_token_ids: list[int] | None = None
    detokenizer: IncrementalDetokenizer | None = None
    completion_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    page_table: list[int] = field(default_factory=list)  # logical page -> physical page
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | None = None  # "eos", "token:<id>", or the matched stop string
    arrival: int = 0  # admission order (preemption picks the newest)
    text: str = ""  # decoded completion text (may extend past what was emitted)
    num_emitted_chars: int = 0
    max_model_len: int = 0
    pages_imported: list[int] | None = None  # IMPORTING: per logical page, how many of its layers arrived
    early_first_token: int | None = None  # IMPORTING: the first token, streamed before the pages were all in
    early_finished: bool = False  # ... and it ended the request: `finish_import` drops the sequence
    reasoning: ReasoningBudget | None = None  # sampling.max_reasoning_tokens: forces the think close tag
    num_prompt_logprobs: int = 0  # prompt positions whose next-token logprob was reported (prompt_logprobs)
    prefix_keys: list[bytes] | None = None  # keys of the prompt's full pages (PageAllocator prefix reuse)
    num_imported_pages: int = 0  # leading pages imported from a prompt cache (never registered: not computed here)
    cached_pages: list[PagePayload] | None = None  # that prefix's KV, written into the pool on the first schedule
    keep_cached_upload: bool = False  # keep the device copy that write made (`cached_upload`)
    cached_upload: CachedUpload | None = None  # ... until `LLMEngine.take_cached_upload` takes it
    num_shared_pages: int = 0  # leading pages taken at admission from the pool's registered prefixes
    shared_pages_reported: bool = True  # prefill-only: the shared pages went out in a `ready_pages` already
    num_prior_output_tokens: int = 0  # the prompt's last tokens were generated elsewhere (`sampled_before`)
    grammar: GrammarState | None = None  # sampling.structured: the matcher, fed every appended token
    layer_stream: LayerStream | None = None  # prefill-only: its pages leave layer group by layer group (kv_handoff)
    prefix_fetch: PrefixFetch | None = None  # cached prefix pages racing the compute (engine/prefix_fetch.py)
    prefill_stop: int = 0  # a prefill chunk ends at this token rather than cross it (a racing fetch starts there)
    choices: ChoicePlan | None = None  # n / best_of > 1: forks once its prompt's KV is complete (forks.py)
    group: ForkGroup | None = None  # once forked: the request's forks, this one among them
    index: int = 0  # ... and which of them this is (its choice, or best_of candidate)

    # ---- sizes ---------------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.completion_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_schedulable(self) -> int:
        """Tokens the next prefill chunk may take: the uncomputed ones, up to `prefill_stop` while short of it."""
        if self.num_computed_tokens < self.prefill_stop:
            return min(self.num_uncomputed, self.prefill_stop - self.num_computed_tokens)
        return self.num_uncomputed

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated for this request so far, those sampled elsewhere before a resume included."""
        return self.num_prior_output_tokens + len(self.completion_token_ids)

    def output_token_ids(self) -> list[int]:
        """The generated tokens (penalties count them): sampled elsewhere, then here."""
        prior = self.prompt_token_ids[len(self.prompt_token_ids) - self.num_prior_output_tokens :]
        return prior + self.completion_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + completion, without copying the whole history."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.completion_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.completion_token_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    # ---- appending tokens -------------------------------------------------------------------------------
    def forced_token(self) -> int | None:
        i = len(self.completion_token_ids)
        if self.forced_token_ids is not None and i < len(self.forced_token_ids):
            return self.forced_token_ids[i]
        if self.reasoning is not None:
            return self.reasoning.forced_token(self.completion_token_ids)
        return None

    def append_token(self, token_id: int, eos_token_ids: list[int]) -> str:
        """Append a generated token, apply stop conditions, and return the text delta safe to emit.

        Order: stop token / EOS (token's text not emitted; none before `min_tokens` tokens, unless a structured
        output is complete) -> detokenize + stop strings (text truncated before
        the stop string) -> max_tokens / context length. Text that might be the start of a stop string is
        held back until it is disambiguated; it is flushed when the sequence finishes for another reason."""
        self.completion_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        sp = self.sampling
        may_stop = self.num_output_tokens >= sp.min_tokens or (self.grammar is not None and self.grammar.terminated)
        if may_stop and token_id in sp.stop_token_ids:
            return self._finish("stop", f"token:{token_id}")
        if may_stop and not sp.ignore_eos and token_id in eos_token_ids:
            return self._finish("stop", "eos")
        if self.detokenizer is not None:
            prev_len = len(self.text)
            self.text += self.detokenizer.add(token_id)
            if sp.stop and may_stop:
                hit = self._find_stop(prev_len)
                if hit is not None:
                    idx, s = hit
                    self.text = self.text[:idx]
                    return self._finish("stop", s)
        if len(self.completion_token_ids) >= sp.max_tokens or (
            self.max_model_len and self.num_tokens >= self.max_model_len
        ):
            return self._finish("length", None)
        return self._emit(self._safe_len())

    def _find_stop(self, prev_len: int) -> tuple[int, str] | None:
        """Earliest stop string occurrence that involves new text (older text was checked before)."""
        best: tuple[int, str] | None = None
        for s in self.sampling.stop:
            idx = self.text.find(s, max(0, prev_len - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        return best

    def _safe_len(self) -> int:
        """Length of text that cannot be the beginning of a stop string."""
        hold = 0
        for s in self.sampling.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return len(self.text) - hold

    def _emit(self, upto: int) -> str:
        if upto <= self.num_emitted_chars:
            return ""
        delta = self.text[self.num_emitted_chars : upto]
        self.num_emitted_chars = upto
        return delta

    def _finish(self, reason: str, stop_reason: str | None) -> str:
        self.status = SequenceStatus.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason
        return self._emit(len(self.text))
