"""The caller's view of relayed chunks: token texts for logprobs, the prompt's logprobs with its token ids, and the
reasoning split (`reasoning.ReasoningSplitter`). One `ChunkShaper` per request, kept across failover attempts (the
split state follows what the caller has seen, not what one decode instance sent)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pdserve.router.reasoning import ReasoningSplitter
from pdserve.router.tools.stream import merge_calls
from pdserve.v1 import generate_pb2


class ChunkShaper:
    def __init__(self, tokenizer, prompt_ids: list[int], splitter: ReasoningSplitter | None):
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.splitter = splitter
        self._texts: dict[int, str] = {}  # token id -> text, for this request's logprobs

    def _text(self, token_id: int) -> str:
        t = self._texts.get(token_id)
        if t is None:
            t = self._texts[token_id] = self.tokenizer.decode([token_id])
        return t

    def shape(
        self, chunks: Iterable[generate_pb2.GenerateStreamResponse]
    ) -> Iterator[generate_pb2.GenerateStreamResponse]:
        for out in chunks:
            for lp in out.logprobs:
                lp.token = self._text(lp.token_id)
                for alt in lp.top:
                    alt.token = self._text(alt.token_id)
            if out.prompt_logprobs.logprobs:
                out.prompt_logprobs.token_ids.extend(self.prompt_ids)
                out.prompt_logprobs.tokens.extend(self._text(t) for t in self.prompt_ids)
                for position in out.prompt_logprobs.top:
                    for alt in position.top:
                        alt.token = self._text(alt.token_id)
            if self.splitter is not None:
                reasoning, answer = self.splitter.feed(out.text)
                if out.finish_reason:
                    r, a = self.splitter.flush()
                    reasoning, answer = reasoning + r, answer + a
                out.reasoning_text, out.text = reasoning, answer
            yield out


def merge_chunks(chunks: Iterable[generate_pb2.GenerateStreamResponse]) -> generate_pb2.GenerateResponse:
    """A whole GenerateResponse from a request's stream."""
    resp = generate_pb2.GenerateResponse()
    text, reasoning, calls = [], [], []
    for chunk in chunks:
        resp.request_id = chunk.request_id
        resp.token_ids.extend(chunk.token_ids)
        resp.logprobs.extend(chunk.logprobs)
        if chunk.HasField("prompt_logprobs"):
            resp.prompt_logprobs.CopyFrom(chunk.prompt_logprobs)
        text.append(chunk.text)
        reasoning.append(chunk.reasoning_text)
        calls.extend(chunk.tool_calls)
        if chunk.finish_reason:
            resp.finish_reason = chunk.finish_reason
            resp.stop_reason = chunk.stop_reason
            resp.usage.CopyFrom(chunk.usage)
            resp.timing.CopyFrom(chunk.timing)
    resp.text = "".join(text)
    resp.reasoning_text = "".join(reasoning)
    resp.tool_calls.extend(merge_calls(calls))
    return resp
