"""The colocated engine's step sizes, chosen from its own measured step costs (`--step-token-budget -1`, auto).

Every step of a colocated engine re-reads all the weights, whatever it computes: on a GPU a step has a fixed
cost (the weight read, ~4.5 ms at 8B on an H200, plus the eager launches of a mixed step) and a cost per token
(~24 µs per prompt token at 8B). Small steps multiply the fixed cost: four 512-token steps pay it four times for
one 2048-token prompt, and the prefill capacity beside decoding falls with them.
Large steps stall the running sequences once per step, but the GPU time a prompt takes is the same whatever the
chunking, so TPOT averaged over a request's tokens does not grow with the step; only the single stall does.

So, on a GPU, after the warm-up (`measure_step_costs`): beside `DECODE_ROWS` running sequences, the time of a
mixed step prefilling P tokens, for P in `CANDIDATES`, and of a step that only decodes them (about the weight
read); the step's fixed cost is the larger of that decode step and the intercept of the line through the mixed
steps' times (`fixed_cost_ms`), and the budget is the smallest P whose step it is at most `MAX_OVERHEAD` of, among
those whose step stays under `MAX_STEP_MS` (`choose_prefill_tokens`; the largest of those if none). A step with
no running sequence to stall may prefill up to the largest P measured (`idle_chunk_size`): on a 70B shape, where
P is 512, a lone 2048-token prompt then takes one step instead of four, each re-reading the 70 GB of weights. Prefill
chunks then take P tokens per step and the step holds up to `max_num_seqs` decode rows beside them (so the decode
rows never shorten a chunk into a tail step of a few tokens). The rate at P is the instance's prefill capacity
until its own mixed steps measured one (`PrefillRateMeter`'s prior), which the router's admission uses to predict
TTFT.

On CPU (and on a GPU without warm-up) nothing is measured: a CPU engine keeps --chunk-size per step as before
(its per-step cost is small against its per-token cost), a GPU engine takes `GPU_DEFAULT_TOKENS`.
"""

from __future__ import annotations

import logging
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams

log = logging.getLogger("pdserve.colocated")

AUTO = -1  # EngineConfig.step_token_budget: chosen here
CANDIDATES = (512, 1024, 2048, 4096)  # prefill tokens per step measured
DECODE_ROWS = 16  # running sequences beside the measured prefill (a typical batch at the SLO's rates)
MAX_OVERHEAD = 0.1  # the step's fixed cost (weight read, launches) at most this share of the chosen step
# a step stalls every running sequence for its whole time: beyond ~100 ms a stream visibly halts (7 tokens at a
# 15 ms TPOT), and the prefill rate hardly grows past a few thousand tokens per step anyway
MAX_STEP_MS = 100.0
GPU_DEFAULT_TOKENS = 2048  # a GPU engine without measurements (--no-warmup): 2048-token steps cost ~10% overhead
REPS = 3  # timed steps per size (after one untimed: a new shape's first launch compiles)


@dataclass
class StepCosts:
    """Measured step times (ms) beside `decode_rows` running sequences: `mixed_ms[P]` a step that also prefills a
    P-token prompt, `decode_ms` a step that only decodes them."""

    decode_rows: int
    decode_ms: float
    mixed_ms: dict[int, float] = field(default_factory=dict)

    def tokens_per_s(self, p: int) -> float:
        """Prompt tokens per second a stream of P-token mixed steps prefills."""
        return p / self.mixed_ms[p] * 1e3


@dataclass
class StepBudget:
    """What a colocated engine runs with: `chunk_size` prefill tokens and `step_token_budget` tokens in all per
    step; `prior_tokens_per_s`: its prefill capacity beside decoding as measured at start-up (None: not measured);
    `reason`: one line for the log; `idle_chunk_size`: prefill tokens of a step without decode rows (nothing to
    stall: the largest step measured, which the activation memory holds)."""

    chunk_size: int
    step_token_budget: int
    prior_tokens_per_s: float | None
    reason: str
    idle_chunk_size: int = 0  # prefill tokens of a step without decode rows (0: chunk_size; Scheduler.set_budget)


def fixed_cost_ms(costs: StepCosts) -> float:
    """What every step pays whatever it prefills: the larger of the decode-only step (the weight read; its rows'
    attention over short contexts is small) and the intercept of the least-squares line through the measured
    mixed steps (P, ms). Where small steps are bound by the host's launches the line is flatter and its intercept
    higher, a cost those steps pay too; attention's quadratic share bends the line the other way, lowering its
    intercept, which the decode step's floor makes up for."""
    pts = sorted(costs.mixed_ms.items())
    if len(pts) < 2:
        return costs.decode_ms
    mx = statistics.fmean(p for p, _ in pts)
    my = statistics.fmean(ms for _, ms in pts)
    slope = sum((p - mx) * (ms - my) for p, ms in pts) / sum((p - mx) ** 2 for p, _ in pts)
    return max(costs.decode_ms, my - slope * mx)


def choose_prefill_tokens(
    costs: StepCosts, max_overhead: float = MAX_OVERHEAD, max_step_ms: float = MAX_STEP_MS
) -> int:
    """The smallest measured P whose step the fixed cost is at most `max_overhead` of, among steps of at most
    `max_step_ms` (the largest of those when none is; the smallest measured P when no step is that short)."""
    fits = sorted(p for p, ms in costs.mixed_ms.items() if ms <= max_step_ms) or [min(costs.mixed_ms)]
    t0 = fixed_cost_ms(costs)
    return next((p for p in fits if t0 <= max_overhead * costs.mixed_ms[p]), fits[-1])


def measure_step_costs(
    engine: LLMEngine,
    sizes: tuple[int, ...] = CANDIDATES,
    decode_rows: int = DECODE_ROWS,
    reps: int = REPS,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] | None = None,
) -> StepCosts:
    """Time mixed steps on `engine` (its thread; no requests in it): `decode_rows` short greedy requests decode
    while one P-token prompt per timed step is prefilled beside them. Sizes the pool or the context cannot hold are
    skipped. The engine's step sizes are restored and every request dropped afterwards. `clock` (seconds) and `sync`
    (waits for the device; default: the engine's CUDA stream) are for tests."""
    if sync is None:
        sync = _device_sync(engine)
    sched, ps = engine.scheduler, engine.page_size
    ctx = 2 * ps  # the decoding requests' prompts: two pages each
    decode_rows = max(0, min(decode_rows, engine.cfg.max_num_seqs - 1))
    steps = 3 + 2 * decode_rows + reps + 3 * len(sizes) * (reps + 1)  # at most this many steps decode each row
    if ctx + steps + 1 > engine.max_model_len:
        decode_rows = 0
    free_pages = engine.allocator.num_free - decode_rows * -(-(ctx + steps + 1) // ps)
    sizes = tuple(p for p in sorted(sizes) if p + 1 <= engine.max_model_len and -(-(p + 1) // ps) <= free_pages)
    if not sizes:
        raise ValueError("no step size to measure fits the KV pool and the context")
    saved = (sched.chunk_size, sched.step_token_budget, sched.idle_chunk_size)
    sched.set_budget(max(sizes), max(sizes) + decode_rows)
    tag = uuid.uuid4().hex[:8]
    vocab = engine.model_config.vocab_size
    prompt = lambda n, k: [(31 * k + 7 * i + 3) % vocab for i in range(n)]  # noqa: E731
    rids: list[str] = []
    costs = StepCosts(decode_rows, 0.0)

    def add(rid: str, tokens: list[int], max_tokens: int) -> None:
        rids.append(rid)
        engine.add_request(EngineRequest(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True)))  # fmt: skip

    def timed_step() -> float:
        sync()
        t0 = clock()
        engine.step()
        sync()
        return (clock() - t0) * 1e3

    try:
        for i in range(decode_rows):
            add(f"step-costs-{tag}-d{i}", prompt(ctx, i), steps + 1)
        for _ in range(3 + 2 * decode_rows):  # until every one decodes (each prompt fits one step)
            if not sched.waiting:
                break
            engine.step()
        costs.decode_ms = statistics.median(timed_step() for _ in range(reps))
        for p in sizes:
            times = []
            for r in range(reps + 1):
                add(f"step-costs-{tag}-p{p}-{r}", prompt(p, 1000 + r), 1)
                for _ in range(3):  # an overlapped decode step may finish first: time the step that prefilled
                    ms = timed_step()
                    if engine.last_step_prefill_tokens:
                        break
                if engine.last_step_prefill_tokens != p:
                    raise RuntimeError(f"step-cost measurement: a step prefilled {engine.last_step_prefill_tokens} "
                                       f"tokens, not {p}")  # fmt: skip
                if r:
                    times.append(ms)
            costs.mixed_ms[p] = statistics.median(times)
        # untimed: Triton specializes integer arguments on divisibility by 16, and serving meets odd decode-row and
        # token counts that the sizes above (multiples of 16, beside 16 rows) never compiled
        if decode_rows > 1:
            engine.abort(rids[decode_rows - 1])
            add(f"step-costs-{tag}-odd", prompt(max(1, sizes[0] - 1), 2000), 1)
            for _ in range(3):
                engine.step()
                if engine.last_step_prefill_tokens:
                    break
    finally:
        for rid in rids:
            engine.abort(rid)
        while engine.has_unfinished_requests():
            engine.step()
        engine.take_pending()
        sched.set_budget(*saved)
    return costs


def _device_sync(engine: LLMEngine) -> Callable[[], None]:
    device = engine.runner.device
    if device.type != "cuda":
        return lambda: None
    import torch

    return lambda: torch.cuda.current_stream(device).synchronize()


def resolve_step_budget(
    engine: LLMEngine,
    measure: bool,
    gpu: bool | None = None,
    measurer: Callable[[LLMEngine], StepCosts] = measure_step_costs,
) -> StepBudget:
    """The step sizes of a colocated engine whose --step-token-budget is `AUTO` (engine thread): measured on a GPU
    when `measure` (after the warm-up: the timed steps then compile nothing new but their own shapes), else the
    defaults in the module docstring. Applies them to the engine's scheduler. `gpu` (None: the engine's device is
    CUDA) and `measurer` are for tests."""
    cfg = engine.cfg
    rows = cfg.max_num_seqs  # room for every decode row beside a full chunk
    if not (engine.runner.device.type == "cuda" if gpu is None else gpu):
        budget = StepBudget(cfg.chunk_size, cfg.chunk_size, None, f"CPU: --chunk-size {cfg.chunk_size} per step")
    elif not measure:
        p = GPU_DEFAULT_TOKENS
        budget = StepBudget(p, p + rows, None, f"GPU default {p} prefill tokens per step (not measured: no warm-up)")
    else:
        try:
            costs = measurer(engine)
        except Exception as e:  # e.g. out of memory at the largest size: serve with the default rather than not
            log.warning("colocated step budget: measurement failed (%s); %d prefill tokens per step", e,
                        GPU_DEFAULT_TOKENS)  # fmt: skip
            return _apply(engine, StepBudget(GPU_DEFAULT_TOKENS, GPU_DEFAULT_TOKENS + rows, None, "default"))
        p = choose_prefill_tokens(costs)
        table = ", ".join(f"{q}: {ms:.1f} ms ({costs.tokens_per_s(q) / 1e3:.1f}k tokens/s)"
                          for q, ms in sorted(costs.mixed_ms.items()))  # fmt: skip
        reason = (
            f"measured beside {costs.decode_rows} decoding sequences (decode step {costs.decode_ms:.1f} ms), "
            f"prefill tokens per step {table}; fixed cost {fixed_cost_ms(costs):.1f} ms: {p}, the smallest step it "
            f"is <= {MAX_OVERHEAD:.0%} of, steps <= {MAX_STEP_MS:g} ms"
        )
        idle = max(costs.mixed_ms)  # ran in the measurement: the activation memory holds it
        reason += f"; {max(idle, p)} prefill tokens per step while nothing decodes"
        budget = StepBudget(p, p + rows, costs.tokens_per_s(p), reason, idle_chunk_size=idle)
    return _apply(engine, budget)


def _apply(engine: LLMEngine, budget: StepBudget) -> StepBudget:
    engine.scheduler.set_budget(budget.chunk_size, budget.step_token_budget, budget.idle_chunk_size)
    log.info("colocated step budget: %d prefill tokens, %d tokens per step (%s)",
             budget.chunk_size, budget.step_token_budget, budget.reason)  # fmt: skip
    return budget
