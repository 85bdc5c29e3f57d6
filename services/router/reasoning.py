"""Reasoning split for DeepSeek-R1 style models: the completion text `<think>…</think>answer` becomes
`reasoning_text` (the thinking, tags removed) and `text` (the answer), chunk by chunk as text is relayed.

Template-aware: on by default when the model's tokenizer has `<think>`/`</think>` as added tokens that appear in
decoded text; a request can turn it off (`GenerateRequest.split_reasoning = false`). A tag may arrive split over
several deltas (held back until it is decided), and a stream may start inside the think block because the chat
template opened it (the rendered prompt ends inside `<think>`): the prompt's token ids decide the start state.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.reasoning_budget import CLOSE_TAG, OPEN_TAG, ThinkTags


def reasoning_tags(tokenizer) -> ThinkTags | None:
    """The model's think tags when it has them and they show in decoded text (what the splitter reads)."""
    tags = ThinkTags.from_tokenizer(tokenizer)
    if tags is None:
        return None
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731 - as the engine does
    if decode(tags.open_ids) != OPEN_TAG or decode(tags.close_ids) != CLOSE_TAG:
        return None  # special tokens dropped from the text: nothing to split on
    return tags


@dataclass
class ReasoningSplitter:
    """Feed text deltas in order; get (reasoning delta, answer delta) back. `flush` at the end of the stream."""

    inside: bool  # inside a think block (the prompt may have opened it)
    pending: str = ""  # text that may be the beginning of the next tag

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        answer: list[str] = []
        buf = self.pending + text
        while True:
            tag = CLOSE_TAG if self.inside else OPEN_TAG
            out = reasoning if self.inside else answer
            idx = buf.find(tag)
            if idx >= 0:
                out.append(buf[:idx])
                buf = buf[idx + len(tag) :]
                self.inside = not self.inside
                continue
            hold = next((k for k in range(min(len(tag) - 1, len(buf)), 0, -1) if buf.endswith(tag[:k])), 0)
            out.append(buf[: len(buf) - hold])
            self.pending = buf[len(buf) - hold :]
            return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """What was held back as a possible tag start, to the side it belongs to (the stream ended)."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.inside else ("", rest)
