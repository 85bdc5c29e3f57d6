"""OpenAI `logprobs` parameters → SDK arguments, and pdserve logprobs → OpenAI's two logprobs shapes.

Chat (`logprobs: true`, `top_logprobs: 0..20`): `{"content": [{token, logprob, bytes, top_logprobs: [...]}]}`.
Completions (`logprobs: N`, N alternatives, 0..20; `echo: true` adds the prompt, scored by `prompt_logprobs`):
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; the prompt's first token has no logprob nor
alternatives (null), every other prompt token has its N alternatives like a generated one. Values are the model's
distribution before temperature (docs).
"""

from __future__ import annotations

from typing import Any

from pdserve.client import PromptLogprobs, TokenLogprob
from pdserve.engine.request_limits import MAX_TOP_LOGPROBS
from pdserve.router.gateway.errors import APIError


def _top_count(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"'{name}' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {v!r}", param=name)
    return v


def chat_logprob_args(body: dict) -> dict:
    """`logprobs=` / `top_logprobs=` for the SDK from a chat body."""
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise APIError(400, "'logprobs' must be a boolean", param="logprobs")
    if top is not None:
        top = _top_count(top, "top_logprobs")
        if top and not on:
            raise APIError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    return dict(logprobs=bool(on), top_logprobs=top or 0) if on else {}


def completion_logprob_args(body: dict, prompt_is_text: bool) -> tuple[dict, bool]:
    """(SDK arguments, echo) from a completions body: `logprobs: N` → logprobs with N alternatives; `echo`
    returns the prompt too (scored when logprobs are asked, or to get the text of a token-id prompt)."""
    n = body.get("logprobs")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise APIError(400, "'echo' must be a boolean", param="echo")
    args: dict = {}
    if n is not None:
        args = dict(logprobs=True, top_logprobs=_top_count(n, "logprobs"))
    if echo and (n is not None or not prompt_is_text):
        args["prompt_logprobs"] = True
    return args, echo


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs_json(lps: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {**_entry(lp.token, lp.logprob), "top_logprobs": [_entry(t.token, t.logprob) for t in lp.top]} for lp in lps
        ],
        "refusal": None,
    }


def completion_logprobs_json(lps: list[TokenLogprob], prompt: PromptLogprobs | None, text_offset: int) -> dict:
    """The completions shape for the prompt (echo; may be None) then the generated tokens; offsets count from
    `text_offset` (where this piece of text starts in the choice's text)."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if prompt is not None:
        tokens += prompt.tokens
        values += [None, *prompt.logprobs]
        alternatives = prompt.top or [[] for _ in prompt.logprobs]
        tops += [None] + [{t.token: t.logprob for t in pos} for pos in alternatives]
    for lp in lps:
        tokens.append(lp.token)
        values.append(lp.logprob)
        tops.append({t.token: t.logprob for t in lp.top})
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
