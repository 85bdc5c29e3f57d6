"""n > 1 and best_of: one request, one prompt, several completions (choices).

The prompt is computed (or imported) once. When its KV is complete the request's sequence forks
(`LLMEngine._fork`) into `best_of` sequences (the request's own is candidate 0):
- they share the prompt's full pages by reference count (`PageAllocator.hold`); each page returns to the pool
  when its last holder frees it, so freeing (finish, abort, preemption) is per fork;
- the page holding the last prompt token is copied for each new fork (copy-on-write, before any fork writes to
  it); every fork, the request's own included, computes that last prompt position again as a decode row in its
  own page and samples its first token there, from its own generator: fork i of a seeded request draws as a
  request of n = 1 with seed + i does (fork 0's generator starts again: the token its prompt step sampled is
  discarded), so a failover resumes choice i as such a request (`pdserve.router.choice_resume`);
- each has its own detokenizer, stop conditions, structured-output matcher and reasoning budget, and is preempted
  alone (recomputed later from prompt + its tokens, like any sequence); a fork with no page for its copy at fork
  time computes the prompt itself when the pool has room.
With best_of > n every candidate runs to its end; then the n with the highest cumulative logprob (the sampled
tokens' logprobs, summed) are returned, renumbered 0..n-1, best first (`ForkGroup.collect`); the request's last
output tells the completion tokens of the others (`StepOutput.unreturned_tokens`): usage counts every candidate's,
as OpenAI bills best_of.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.request_limits import MAX_N
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.step_output import StepOutput
from pdserve.errors import InvalidRequest

FORK_SEPARATOR = "#fork"  # an internal fork's engine request id: "<request id>#fork<index>"


@dataclass(frozen=True)
class ChoicePlan:
    """How a request forks: `n` choices returned, out of `best_of` candidates run (best_of >= n)."""

    n: int = 1
    best_of: int = 1
    keep_logprobs: bool = True  # best_of > n: whether the caller asked for logprobs (the ranking computes them)

    @classmethod
    def of(cls, n: int, best_of: int) -> ChoicePlan:
        """A checked plan; best_of 0 means n. Raises InvalidRequest outside 1 <= n <= best_of <= MAX_N."""
        best_of = best_of or n
        if not 1 <= n <= MAX_N:
            raise InvalidRequest(f"n must be in [1, {MAX_N}], got {n}")
        if not n <= best_of <= MAX_N:
            raise InvalidRequest(f"best_of must be in [n, {MAX_N}] (n = {n}), got {best_of}")
        return cls(n, best_of)

    @property
    def forks(self) -> bool:
        return self.best_of > 1

    @property
    def buffered(self) -> bool:
        """best_of > n: the candidates' outputs are held until the best n are known."""
        return self.best_of > self.n


def fork_id(request_id: str, index: int) -> str:
    """The engine request id of fork `index` (0: the request's own id)."""
    return request_id if index == 0 else f"{request_id}{FORK_SEPARATOR}{index}"


def fork_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Fork `index`'s sampling: its own generator, seed + index for a seeded request (wrapping at 2^64)."""
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**64)


class _Member(Protocol):
    """What a group knows of its members (engine Sequences; forks.py does not import sequence.py, which imports it)."""

    request_id: str

    @property
    def finished(self) -> bool: ...


@dataclass
class ForkGroup:
    """The forked sequences of one request (`members[i]` is fork i) and, with best_of > n, their held outputs."""

    request_id: str
    plan: ChoicePlan
    members: list[_Member] = field(default_factory=list)
    _held: dict[int, StepOutput] = field(default_factory=dict)

    def live(self) -> int:
        """Members not finished."""
        return sum(1 for m in self.members if not m.finished)

    def collect(self, outputs: Iterable[StepOutput]) -> list[StepOutput]:
        """best_of > n: hold candidates' outputs; when the last candidate ends, the request's outputs: the n best
        (highest cumulative logprob; ties: lower index), renumbered 0..n-1 best first, each its whole completion;
        n aborted ones if any candidate was aborted."""
        done = False
        for out in outputs:
            prev = self._held.get(out.index)
            self._held[out.index] = out.after(prev) if prev is not None else out
            done = done or out.request_done
        if not done:
            return []
        held = sorted(self._held.values(), key=lambda o: o.index)
        prompt_lps = held[0].prompt_logprobs if held else []
        if any(o.finish_reason == "abort" for o in held):
            p = held[0].num_prompt_tokens
            chosen = [StepOutput(self.request_id, [], "", True, "abort", p, 0) for _ in range(self.plan.n)]
            unreturned = 0
        else:
            ranked = sorted(held, key=lambda o: (-cumulative_logprob(o), o.index))
            chosen, unreturned = ranked[: self.plan.n], sum(o.num_completion_tokens for o in ranked[self.plan.n :])
        for rank, o in enumerate(chosen):
            o.index, o.choices_left = rank, self.plan.n - 1 - rank
            o.unreturned_tokens = unreturned if rank == self.plan.n - 1 else 0  # on the request's last output
            o.prompt_logprobs = prompt_lps if rank == 0 else []
            if not self.plan.keep_logprobs:
                o.logprobs = []
        return chosen


def cumulative_logprob(out: StepOutput) -> float:
    """Sum of a completion's sampled-token logprobs (the model's own distribution, `SamplingParams` docs)."""
    return sum(lp.logprob for lp in out.logprobs)
