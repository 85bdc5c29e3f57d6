"""StepOutput: what `LLMEngine.step()` returns for one request (one choice of it, with n > 1) per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.sampling import TokenLogprob


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool  # this choice finished (the request too unless other choices run: `request_done`)
    finish_reason: str | None  # "stop" | "length" | "prefill_done" | "abort" when finished
    num_prompt_tokens: int
    num_completion_tokens: int  # of this choice
    ready_pages: list[int] = field(default_factory=list)  # prefill-only: logical pages whose KV became final
    logits: torch.Tensor | None = None  # step(return_logits=True): float32 [vocab] row used for the last token
    stop_reason: str | None = None  # "eos", "token:<id>" or the matched stop string (finish_reason "stop")
    token_range: tuple[int, int] | None = None  # prefill-only: prompt tokens [start, end) this step computed
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token id (sampling.logprobs)
    # next prompt-token logprobs computed this step (token_id: the prompt token scored; `top` with top_logprobs)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    index: int = 0  # the choice (EngineRequest.n > 1): which of the request's forked sequences
    choices_left: int = 0  # the request's choices still running after this output (0 with n = 1)
    unreturned_tokens: int = 0  # best_of > n, the request's last output: completion tokens of candidates not returned

    @property
    def request_done(self) -> bool:
        """The request's last output: this choice finished and no other runs (n = 1: `finished`)."""
        return self.finished and self.choices_left == 0

    def after(self, prev: StepOutput) -> StepOutput:
        """This output with an earlier one of the same choice in front (tokens, text, pages, logprobs joined)."""
        self.new_token_ids = prev.new_token_ids + self.new_token_ids
        self.text_delta = prev.text_delta + self.text_delta
        self.ready_pages = prev.ready_pages + self.ready_pages
        self.logprobs = prev.logprobs + self.logprobs
        self.prompt_logprobs = prev.prompt_logprobs + self.prompt_logprobs
        return self
