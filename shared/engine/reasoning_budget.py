"""Think tags of reasoning models (DeepSeek-R1 style `<think>...</think>`) and the reasoning-token budget.

`ThinkTags.from_tokenizer` finds the tags' token ids (None for models without them). `ReasoningBudget` follows a
sequence's completion tokens and, once `max_reasoning_tokens` tokens were generated inside the think block, names
the close tag's tokens to force next. It is a pure function of the prompt and the completion so far (it catches up
lazily), so a resumed or imported sequence and a seeded request behave exactly like an uninterrupted one: the
sampler still draws for a forced position, the forced token replaces the draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkTags:
    open_ids: tuple[int, ...]  # token ids of "<think>"
    close_ids: tuple[int, ...]  # token ids of "</think>"

    @staticmethod
    def from_tokenizer(tokenizer) -> ThinkTags | None:
        """The tags' ids when both are single added tokens of the vocabulary (how reasoning models ship them)."""
        vocab = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        if OPEN_TAG in vocab and CLOSE_TAG in vocab:
            return ThinkTags((int(vocab[OPEN_TAG]),), (int(vocab[CLOSE_TAG]),))
        return None

    def inside_after(self, token_ids: list[int]) -> bool:
        """Whether `token_ids` end inside a think block (the last open tag comes after the last close tag)."""
        last_open = _rfind(token_ids, self.open_ids)
        return last_open >= 0 and last_open > _rfind(token_ids, self.close_ids)


def _rfind(ids: list[int], sub: tuple[int, ...]) -> int:
    n = len(sub)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i : i + n]) == sub:
            return i
    return -1


@dataclass
class ReasoningBudget:
    """Per sequence: inside the think block or not, reasoning tokens so far, and the close-tag tokens to force."""

    tags: ThinkTags
    max_tokens: int
    inside: bool  # state after the prompt and the first `seen` completion tokens
    seen: int = 0
    used: int = 0  # reasoning tokens of the current think block
    recent: list[int] = field(default_factory=list)  # last few tokens, to match multi-token tags

    @classmethod
    def for_prompt(cls, tags: ThinkTags, max_tokens: int, prompt_ids: list[int]) -> ReasoningBudget:
        return cls(tags, max_tokens, inside=tags.inside_after(prompt_ids))

    def _observe(self, completion: list[int]) -> None:
        width = max(len(self.tags.open_ids), len(self.tags.close_ids))
        for t in completion[self.seen :]:
            self.recent = (self.recent + [t])[-width:]
            if self.inside:
                if tuple(self.recent[-len(self.tags.close_ids) :]) == self.tags.close_ids:
                    self.inside, self.used = False, 0
                else:
                    self.used += 1
            elif tuple(self.recent[-len(self.tags.open_ids) :]) == self.tags.open_ids:
                self.inside, self.used = True, 0
        self.seen = len(completion)

    def forced_token(self, completion: list[int]) -> int | None:
        """The token to force at position len(completion), or None: after the budget is spent inside a think
        block, the close tag's tokens in order (a partial close tag already generated is continued)."""
        self._observe(completion)
        if not self.inside or self.used < self.max_tokens:
            return None
        close = self.tags.close_ids
        for k in range(len(close) - 1, 0, -1):  # the tail of `recent` may already hold the tag's first tokens
            if tuple(self.recent[-k:]) == close[:k]:
                return close[k]
        return close[0]
