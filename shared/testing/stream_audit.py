"""Streams a fault suite sends, and how each one is judged against a reference run (docs/reliability.md).

`stream_once` sends one GenerateStream over an asyncio channel and records what came back (`Outcome`): the token
ids in arrival order, the text, the finish chunk's reason and usage, the final status. It can cancel the call after
some tokens or some time. `Tally` adds outcomes up into the suite's counters:

- completed: status OK and a finish chunk with reason stop or length (not abort);
- wrong_status: the final status is not in the scenario's expected set;
- wrong_outputs: a request whose delivered tokens disagree with the reference (greedy, same prompt, unfaulted
  stack): an OK stream must equal it, any other stream must have delivered a prefix of it;
- lost_tokens / duplicated_tokens: the delivered tokens aligned to the reference (difflib, no junk heuristic):
  reference tokens with no delivered counterpart are lost, delivered tokens with no reference counterpart are
  duplicated; an OK stream whose usage.completion_tokens disagrees with what arrived adds the difference. The
  reference's tail after a failure counts as lost only for requests the scenario promises to complete.
"""

from __future__ import annotations

import asyncio
import difflib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.client_retry import RetryPolicy
from pdserve.v1 import generate_pb2, generate_pb2_grpc

OK = "OK"


@dataclass
class Outcome:
    """What one request got back. `code` is the final gRPC status name ("OK" when the stream ended cleanly)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: int = 0  # generate_pb2.FinishReason of the last chunk (0: none arrived)
    usage_completion: int | None = None
    cached_tokens: int = 0  # usage.cached_tokens of the finish chunk (prompt tokens served from the prompt cache)
    code: str = OK
    details: str = ""
    chunks: int = 0
    sent_s: float = 0.0
    first_s: float | None = None
    end_s: float = 0.0
    error: grpc.RpcError | None = field(default=None, repr=False)  # the final error (its trailers: pushback)
    retries: int = 0  # RESOURCE_EXHAUSTED answers retried before this outcome (`stream_retrying`)

    @property
    def completed(self) -> bool:
        """Status OK and a finish chunk saying stop or length (an OK stream finishing "abort" did not complete)."""
        return self.code == OK and self.finish in (generate_pb2.FINISH_REASON_STOP, generate_pb2.FINISH_REASON_LENGTH)


def status_name(err: grpc.RpcError) -> str:
    code = err.code() if hasattr(err, "code") else None
    return code.name if code is not None else "UNKNOWN"


async def stream_once(
    stub: generate_pb2_grpc.GenerationStub,
    request: generate_pb2.GenerateRequest,
    *,
    timeout: float | None = 120.0,
    metadata: Sequence[tuple[str, str]] = (),
    cancel_after_tokens: int | None = None,
    cancel_after_s: float | None = None,
    on_first: asyncio.Event | None = None,
) -> Outcome:
    """Send one stream and read it to its end (or cancel it once `cancel_after_tokens` tokens arrived, or
    `cancel_after_s` seconds passed: the outcome's code is then CANCELLED). `on_first` is set at the first token."""
    out = Outcome(sent_s=time.monotonic())
    call = stub.GenerateStream(request, timeout=timeout, metadata=list(metadata) or None)
    timer = None
    if cancel_after_s is not None:
        timer = asyncio.get_running_loop().call_later(cancel_after_s, call.cancel)
    try:
        async for msg in call:
            out.chunks += 1
            if msg.token_ids and out.first_s is None:
                out.first_s = time.monotonic()
                if on_first is not None:
                    on_first.set()
            out.tokens += msg.token_ids
            out.text += msg.text
            if msg.finish_reason:
                out.finish = msg.finish_reason
                out.usage_completion = msg.usage.completion_tokens
                out.cached_tokens = msg.usage.cached_tokens
            if cancel_after_tokens is not None and len(out.tokens) >= cancel_after_tokens and not out.finish:
                call.cancel()
                break
        if call.cancelled():
            out.code = "CANCELLED"
    except asyncio.CancelledError:
        out.code = "CANCELLED"
    except grpc.RpcError as e:
        out.code, out.details = status_name(e), (e.details() or "") if hasattr(e, "details") else ""
        out.error = e
    finally:
        if timer is not None:
            timer.cancel()
        if on_first is not None:
            on_first.set()  # a failed stream releases its waiter too
    out.end_s = time.monotonic()
    return out


async def stream_retrying(
    stub: generate_pb2_grpc.GenerationStub,
    request: generate_pb2.GenerateRequest,
    *,
    timeout: float = 120.0,
    policy: RetryPolicy | None = None,
    **kw,
) -> Outcome:
    """`stream_once`, retrying RESOURCE_EXHAUSTED before the first token as the SDK does (`RetryPolicy`: the
    server's pushback, bounded attempts and total wait, within `timeout`): what a caller of `pdserve.Client` sees."""
    policy = policy or RetryPolicy()
    deadline = time.monotonic() + timeout
    waited, attempt = 0.0, 1
    while True:
        out = await stream_once(stub, request, timeout=max(0.001, deadline - time.monotonic()), **kw)
        out.retries = attempt - 1
        if out.code != "RESOURCE_EXHAUSTED" or out.tokens or out.error is None:
            return out
        delay = policy.delay(out.error, attempt, waited, deadline)
        if delay is None:
            return out
        await asyncio.sleep(delay)
        waited, attempt = waited + delay, attempt + 1


def align(delivered: Sequence[int], reference: Sequence[int]) -> tuple[int, int, int]:
    """(reference tokens missing, delivered tokens extra, replaced pairs) of `delivered` against `reference`."""
    lost = extra = replaced = 0
    sm = difflib.SequenceMatcher(None, list(reference), list(delivered), autojunk=False)
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        r, d = i2 - i1, j2 - j1
        if op == "delete":
            lost += r
        elif op == "insert":
            extra += d
        elif op == "replace":
            replaced += min(r, d)
            lost += max(0, r - d)
            extra += max(0, d - r)
    return lost, extra, replaced


@dataclass
class Tally:
    """The suite's counters for one scenario (see the module doc for each definition)."""

    requests: int = 0
    completed: int = 0
    lost_tokens: int = 0
    duplicated_tokens: int = 0
    wrong_outputs: int = 0
    wrong_status: int = 0
    leaked_pages: int = 0
    statuses: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)  # a few unexpected outcomes, for the report

    def note(self, what: str) -> None:
        if len(self.examples) < 8:
            self.examples.append(what[:300])

    def add(
        self,
        out: Outcome,
        expected: Sequence[str],
        reference: Sequence[int] | None,
        *,
        must_complete: bool,
        label: str = "",
    ) -> None:
        """Count one request. `expected`: the status names this scenario allows; `reference`: the tokens an
        unfaulted greedy run gave for this prompt (None: no output check); `must_complete`: the scenario promises
        this request's whole output (its missing tail counts as lost)."""
        self.requests += 1
        self.statuses[out.code] += 1
        if out.completed:
            self.completed += 1
        if out.code not in expected:
            self.wrong_status += 1
            self.note(f"{label} status {out.code} not in {sorted(expected)}: {out.details}")
        lost = dup = 0
        if reference is not None:
            if out.completed or must_complete:
                lost, dup, replaced = align(out.tokens, reference)
                wrong = list(out.tokens) != list(reference)
            else:  # ended early by design: what arrived must be the reference's beginning
                part = list(reference[: len(out.tokens)])
                _, dup, replaced = align(out.tokens, part)
                wrong = list(out.tokens) != part
            if wrong:
                self.wrong_outputs += 1
                got, want = list(out.tokens)[:24], list(reference)[:24]
                self.note(f"{label} output differs ({out.code}, finish {out.finish}): got {got} want {want}")
        if out.completed and out.usage_completion is not None:
            n = len(out.tokens)
            lost = max(lost, out.usage_completion - n)
            dup = max(dup, n - out.usage_completion)
        self.lost_tokens += lost
        self.duplicated_tokens += dup

    def no_tokens(self, out: Outcome, label: str = "") -> None:
        """For a request that must not generate (refused, or fed damaged KV): any token it got is a wrong output."""
        if out.tokens:
            self.wrong_outputs += 1
            self.note(f"{label}: {len(out.tokens)} tokens generated ({out.code}): {list(out.tokens)[:16]}")

    def refusal(self, code: str, expected: Sequence[str], label: str = "", details: str = "") -> None:
        """Count one call whose only product is its status (an abuse call, a refused request)."""
        self.requests += 1
        self.statuses[code] += 1
        if code == OK:
            self.completed += 1
        if code not in expected:
            self.wrong_status += 1
            self.note(f"{label} status {code} not in {sorted(expected)}: {details}")

    def counters(self) -> dict:
        return dict(
            requests=self.requests,
            completed=self.completed,
            lost_tokens=self.lost_tokens,
            duplicated_tokens=self.duplicated_tokens,
            wrong_outputs=self.wrong_outputs,
            wrong_status=self.wrong_status,
            leaked_pages=self.leaked_pages,
        )


def token_request(
    ids: Sequence[int], max_tokens: int, *, request_id: str = "", **sampling
) -> generate_pb2.GenerateRequest:
    """A greedy token-id request that runs its full `max_tokens` (ignore_eos), the suite's unit of work."""
    s = generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    req = generate_pb2.GenerateRequest(request_id=request_id, sampling=s)
    req.token_ids.ids.extend(ids)
    return req


TARGETS = dict(lost_tokens=0, duplicated_tokens=0, wrong_outputs=0, wrong_status=0, leaked_pages=0)


@dataclass
class Result:
    """One scenario's verdict: its tally, the statuses it allows per request class, what else it measured, whether
    the fault actually hit requests (a scenario that broke nothing proves nothing) and its own promises."""

    tally: Tally
    expected: dict[str, list[str]]
    extras: dict = field(default_factory=dict)
    exercised: bool = True
    checks: dict[str, bool] = field(default_factory=dict)

    def record(self, seconds: float) -> dict:
        """The scenario's JSON record: the counters, `passed` (every counter at its target, exercised, every check
        held) and the details."""
        t = self.tally
        at_target = all(getattr(t, k) == v for k, v in TARGETS.items())
        checks = dict(self.checks)
        if "leaked_requests" in self.extras:  # requests an instance still counts active after the drain
            checks["no request left active after the drain"] = not self.extras["leaked_requests"]
        return dict(
            **t.counters(),
            passed=bool(at_target and self.exercised and all(checks.values())),
            exercised=self.exercised,
            checks=checks,
            expected_statuses=self.expected,
            statuses=dict(t.statuses),
            examples=t.examples,
            seconds=round(seconds, 1),
            **self.extras,
        )
