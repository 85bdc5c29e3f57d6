"""Structured output with xgrammar: a request's `StructuredSpec` compiled against the model's tokenizer, and the
per-sequence matcher that fills the step's token mask (on the host) and is fed every accepted token.

Why xgrammar (over llguidance, both CPU wheels on PyPI): on the tiny test tokenizer and a realistic nested schema
(objects, enum, bounded array, pattern) its mask took 0.9 us median / 8 us p99 per token against llguidance's 8 us /
340 us, with a compile of 4 ms; it also ships the JSON-schema, regex and EBNF front ends used here.

JSON is compact (no free whitespace between tokens): a model cannot pad the output with endless blanks, and a
bounded schema always ends. Known limit: xgrammar checks UTF-8 structurally, so a model that emits raw byte tokens
at random (random weights) can put an invalid sequence (an overlong form, a surrogate) inside a JSON string; it
decodes to U+FFFD, which may break a `maxLength`. Trained models do not emit those."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pdserve.engine.structured_spec import StructuredSpec
from pdserve.errors import InvalidRequest

log = logging.getLogger("pdserve.engine")

ANY_JSON_OBJECT = '{"type": "object"}'
# threads filling one step's masks, at most half the cores: a row inside a free JSON string costs ~0.9 ms on a
# 128k vocabulary (its tokens holding a quote are checked against what may follow), so 32 such rows need ~8 threads
# to fill within a decode step's forward (bench/structured.py --part cpu-fill measures a host)
MAX_MASK_THREADS = 8
CONTROL_BYTE = re.compile(rb"[\x00-\x1f]")


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar accepting exactly one of `choices` (JSON string escapes are valid GBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One sequence's matcher: its row of the step's mask (`fill_bitmasks`) before a draw, `accept` after it."""

    def __init__(self, matcher: Any, batch: Any, allowed: torch.Tensor | None = None):
        self._matcher = matcher
        self._batch = batch  # the compiler's xgrammar BatchGrammarMatcher: fills many rows on its threads
        self._allowed = allowed  # [ceil(V / 32)] int32: tokens the spec's grammar may ever use (None: all)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) when the grammar does not allow it (a forced token)."""
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.accept_token(token_id))

    def replay(self, token_ids: list[int]) -> None:
        """Feed tokens generated before (a failover resume): the state continues where the request was."""
        for t in token_ids:
            if not self.accept(t):
                raise InvalidRequest(f"resumed token {t} does not follow the request's structured output")

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def fill_bitmasks(states: Sequence[GrammarState | None], bitmask: torch.Tensor) -> None:
    """Row i of `bitmask` [>= len(states), ceil(V / 32)] int32 (host) for states[i], in one multi-threaded xgrammar
    call (the GIL released). Rows of None, of a complete output and past len(states) are left as they are (all ones
    from the caller: only with ignore_eos does a request go on past a complete output)."""
    live = [i for i, st in enumerate(states) if st is not None and not st.terminated]
    if not live:
        return
    first = states[live[0]]
    assert first is not None
    matchers = [st._matcher for i in live if (st := states[i]) is not None]
    first._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=live)
    by_allowed: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for i in live:
        allowed = states[i]._allowed  # type: ignore[union-attr]
        if allowed is not None:
            by_allowed.setdefault(id(allowed), (allowed, []))[1].append(i)
    for allowed, rows in by_allowed.values():  # one op per distinct mask (one compiler: at most one)
        bitmask[rows] &= allowed


class MaskFiller:
    """A decode step's grammar masks filled on a worker thread while the device computes the step (the overlapped
    decode, engine.py): `start` returns a future of the host bitmask [len(states), ceil(V / 32)] int32, one row a
    sequence (all ones for rows without a grammar). Two buffers alternate (pinned when `pin`, for a non-blocking
    copy to the device), so a step's mask is never overwritten while the previous one may still be copied."""

    def __init__(self, max_rows: int, vocab_size: int, pin: bool):
        words = (vocab_size + 31) // 32
        self._buffers = [torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._next = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar-masks")

    def start(self, states: list[GrammarState | None]) -> Future[torch.Tensor]:
        """Fill the masks of `states` (their matchers must not change until the future is done)."""
        if len(states) > self._buffers[0].shape[0]:
            raise ValueError(f"{len(states)} rows, the mask buffers hold {self._buffers[0].shape[0]}")
        buf = self._buffers[self._next][: len(states)]
        self._next ^= 1
        return self._pool.submit(self._fill, states, buf)

    @staticmethod
    def _fill(states: list[GrammarState | None], buf: torch.Tensor) -> torch.Tensor:
        buf.fill_(-1)
        fill_bitmasks(states, buf)
        return buf

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class MaskedDraw:
    """The grammar half of a launched greedy decode step (model_runner.DecodeLaunch): `start` fills the rows' masks
    on the filler's thread while the device computes the forward; `finish` waits for them and queues the masked
    argmax (`draw`: host bitmask [B, ceil(V / 32)] -> (tokens [B] int64, the event after which they are valid))."""

    def __init__(
        self,
        filler: MaskFiller,
        states: list[GrammarState | None],
        draw: Callable[[torch.Tensor], tuple[torch.Tensor, Any]],
    ):
        self._filler, self._states, self._draw = filler, states, draw
        self._future: Future[torch.Tensor] | None = None

    def start(self) -> None:
        """Fill the masks now (call it once the matchers have every token before this step)."""
        if self._future is None:
            self._future = self._filler.start(self._states)

    def finish(self) -> tuple[torch.Tensor, Any]:
        self.start()
        assert self._future is not None
        return self._draw(self._future.result())


class StructuredCompiler:
    """Compiles specs for one tokenizer (xgrammar caches compiled grammars, so repeated schemas compile once)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        import xgrammar as xgr  # imported on the first structured request only

        self._xgr = xgr
        hf = tokenizer.hf() if hasattr(tokenizer, "hf") else tokenizer  # loader.FileTokenizer: transformers' own
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._batch = xgr.BatchGrammarMatcher(max_threads=max(1, min(MAX_MASK_THREADS, (os.cpu_count() or 1) // 2)))
        # xgrammar's JSON strings admit raw control characters, which JSON forbids (strict parsers refuse them):
        # JSON outputs never use a token holding one (compact JSON needs no newline or tab between tokens either)
        self._json_allowed = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)
        stops = set(info.stop_token_ids)
        for t, raw in enumerate(info.decoded_vocab):
            if t not in stops and CONTROL_BYTE.search(raw):
                self._json_allowed[t // 32] &= ~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF

    def compile(self, spec: StructuredSpec) -> Any:
        c = self._compiler
        try:
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "json_object":
                return c.compile_json_schema(ANY_JSON_OBJECT, any_whitespace=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            if spec.kind == "choice":
                return c.compile_grammar(choice_grammar(spec.choices))
            if spec.kind == "structural_tag":
                return c.compile_structural_tag(spec.value)
            return c.compile_grammar(spec.value)
        except (RuntimeError, ValueError) as e:  # xgrammar reports syntax / unsupported-feature errors so
            raise InvalidRequest(f"structured output {spec.kind} does not compile: {str(e)[:300]}") from None

    def matcher(self, spec: StructuredSpec) -> GrammarState:
        allowed = self._json_allowed if spec.kind in ("json_schema", "json_object") else None
        return GrammarState(self._xgr.GrammarMatcher(self.compile(spec)), self._batch, allowed)
