"""Fault and abuse suite over real processes (docs/reliability.md): router, prefill and decode as separate processes
on CPU with a tiny random checkpoint, a private redis-server for the prompt cache, faults injected from outside
(SIGKILL, SIGTERM, Redis stopped, storms of cancels and deadlines, hostile and oversized calls).

    python bench/reliability.py --json docs/bench/reliability.json --tls --soak-minutes 30     # the published run
    python bench/reliability.py --json docs/bench/reliability.json --tls --scenarios a,b --merge  # re-run some
        [--scale 1.0] [--instances 2,2] [--work DIR]

Each scenario records `requests`, `completed`, `lost_tokens`, `duplicated_tokens`, `wrong_outputs`, `wrong_status`
and `leaked_pages` (definitions: pdserve.testing.stream_audit and docs/reliability.md), the statuses seen, a few
examples of anything unexpected and `passed` (every counter at its target and the fault actually exercised). The
JSON is rewritten after every scenario. `--scale` multiplies the request counts (the smoke test uses a small one).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))  # reliability_abuse (run as a script)

from pdserve.models.checkpoints import build_checkpoint
from pdserve.testing.fault_stack import DECODE, PREFILL, FaultStack, Identity
from pdserve.testing.provenance import git_commit
from pdserve.testing.redis_server import RedisServer
from pdserve.testing.stream_audit import (
    TARGETS,
    Outcome,
    Result,
    Tally,
    stream_once,
    stream_retrying,
    token_request,
)
from pdserve.v1 import generate_pb2, generate_pb2_grpc

SCHEMA = "pdserve.reliability/1"
VOCAB = 512  # build_checkpoint's tiny tokenizer
PAGE, CHUNK = 4, 16
DECODE_MAX_STREAMS = 24  # each decode's stream budget (--max-streams) in the main stack
DRAIN_GRACE_S = 60.0  # the main stack router's --drain-grace-s
SLO_TTFT_MS, SLO_TPOT_MS = 5000, 250  # the main stack router's SLO admission targets (CPU figures)


class Suite:
    """The shared stack and what scenarios need from it: prompts, references, public calls, healing."""

    def __init__(self, work: Path, scale: float, seed: int = 0, prefill: int = 2, decode: int = 2, tls: bool = False):
        self.work = work
        self.scale = scale
        self.seed = seed
        self.model = build_checkpoint(work / "model", arch="llama", seed=4)
        self.tenants = {"tenant-a": "tok-a-" + os.urandom(12).hex(), "tenant-b": "tok-b-" + os.urandom(12).hex()}
        tokens_file = work / "auth-tokens.json"
        tokens_file.write_text(json.dumps({tok: t for t, tok in self.tenants.items()}))
        self.redis = RedisServer(work / "redis").start()
        self.identity = Identity.with_tls(work / "pki") if tls else Identity.with_token()
        self.engine_args = [
            *("--torch-threads", "1", "--page-size", str(PAGE), "--chunk-size", str(CHUNK)),
            *("--num-pages", "2048", "--kv-dtype", "auto", "--max-num-seqs", "16", "--log-level", "INFO"),
        ]
        self.stack = FaultStack(
            self.model,
            work / "stack",
            prefill=prefill,
            decode=decode,
            engine_args=self.engine_args,
            prefill_args=["--redis-url", self.redis.url, "--cache-local-mb", "0", "--max-streams", "64"],
            decode_args=["--max-streams", str(DECODE_MAX_STREAMS)],
            router_args=[
                *("--auth-tokens-file", str(tokens_file), "--drain-grace-s", str(DRAIN_GRACE_S)),
                *("--max-queue-wait-s", "20", "--default-timeout-s", "120"),
                # SLO admission targets for a shared CPU host (the defaults are GPU figures: 15 ms per token)
                *("--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-tpot-ms", str(SLO_TPOT_MS)),
            ],
            identity=self.identity,
        )
        self._refs: dict[tuple[tuple[int, ...], int], list[int]] = {}
        self.channel: grpc.aio.Channel | None = None
        self.retried = 0  # RESOURCE_EXHAUSTED answers retried by `stream` (reported per scenario)
        self.baseline: dict[str, tuple[int, int]] = {}  # pages / active requests per instance as a scenario began

    def count(self, n: int, least: int = 2) -> int:
        return max(least, round(n * self.scale))

    def prompts(self, name: str, n: int, lo: int, hi: int) -> list[list[int]]:
        rng = random.Random(f"{self.seed}:{name}")
        return [[rng.randrange(5, VOCAB) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]

    def metadata(self, tenant: str = "tenant-a") -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.tenants[tenant]}")]

    # ---- public calls ---------------------------------------------------------------------------------------
    async def open(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        self.channel = self.identity.public_channel(self.stack.router)
        await asyncio.wait_for(self.channel.channel_ready(), 60)

    @property
    def stub(self) -> generate_pb2_grpc.GenerationStub:
        assert self.channel is not None
        return generate_pb2_grpc.GenerationStub(self.channel)

    async def stream(
        self, req: generate_pb2.GenerateRequest, tenant: str = "tenant-a", retry: bool = True, **kw
    ) -> Outcome:
        """One stream as `tenant`. `retry`: RESOURCE_EXHAUSTED before the first token is retried after the router's
        pushback, as the SDK does (a caller of pdserve.Client never sees it unless the overload lasts); False:
        the first answer counts (storms and the thread-budget scenario, where that answer is the point)."""
        if retry:
            out = await stream_retrying(self.stub, req, metadata=self.metadata(tenant), **kw)
            self.retried += out.retries
            return out
        return await stream_once(self.stub, req, metadata=self.metadata(tenant), **kw)

    async def run_all(
        self, reqs: Sequence[generate_pb2.GenerateRequest], concurrency: int, retry: bool = True, **kw
    ) -> list[Outcome]:
        sem = asyncio.Semaphore(concurrency)

        async def one(r):
            async with sem:
                return await self.stream(r, retry=retry, **kw)

        return list(await asyncio.gather(*(one(r) for r in reqs)))

    async def reference(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        """Greedy outputs of `prompts` on the unfaulted stack (each computed once, then kept)."""
        todo = sorted({tuple(p) for p in prompts if (tuple(p), max_tokens) not in self._refs})
        if todo:
            outs = await self.run_all([token_request(p, max_tokens) for p in todo], 16, timeout=300)
            for p, o in zip(todo, outs):
                if not o.completed or len(o.tokens) != max_tokens:
                    raise RuntimeError(f"reference run failed: {o.code} {o.details} ({len(o.tokens)} tokens)")
                self._refs[(p, max_tokens)] = o.tokens
        return [self._refs[(tuple(p), max_tokens)] for p in prompts]

    # ---- stack health ----------------------------------------------------------------------------------------
    def heal(self) -> None:
        """Start again whatever is dead, then wait until the router sees every instance up."""
        if self.redis.proc is None or self.redis.proc.poll() is not None:
            self.redis.start()
        for addr, m in list(self.stack.members.items()):
            if m.proc.poll() is not None:
                self.stack.restart(addr)
        self.stack.wait_up()

    def leaked(self, tally: Tally, extras: dict, timeout: float = 30.0) -> None:
        """After a scenario: wait for every instance and the router to drain, then count what is still held: KV
        pages and active requests on the engines (their Stats), requests the router still has in flight or queued
        (its ListInstances)."""
        deadline = time.monotonic() + timeout
        used = self.stack.wait_drained(timeout, self.baseline)
        while True:
            listing = self.stack.listing()
            held = sum(i.in_flight for i in listing.instances) + listing.queued
            if not held or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # what this scenario left: above what each instance held when it began (an earlier leak is not counted
        # again; a restarted instance starts from 0)
        base = {a: self.baseline.get(a, (0, 0)) for a in used}
        new = {a: (max(0, p - base[a][0]), max(0, r - base[a][1])) for a, (p, r) in used.items()}
        tally.leaked_pages = sum(p for p, _ in new.values())
        extras["leaked_requests"] = sum(r for _, r in new.values()) + held
        if any(any(v) for v in base.values()):
            extras["held_before_scenario"] = {a: list(v) for a, v in base.items() if any(v)}
        if tally.leaked_pages or extras["leaked_requests"]:
            extras["leaks_by_instance"] = {a: list(v) for a, v in new.items() if any(v)}
            extras["router_held"] = dict(
                queued=listing.queued, in_flight={i.address: i.in_flight for i in listing.instances}
            )

    def close(self) -> None:
        self.stack.stop()
        self.redis.stop()


# ---- failover scenarios ---------------------------------------------------------------------------------------
async def _closed_loop(
    suite: Suite, prompts, max_tokens: int, concurrency: int, until, live: dict
) -> list[tuple[int, Outcome]]:
    """Send prompts round-robin from `concurrency` workers until `until(sent)` is true; (prompt index, outcome).
    `live["streaming"]` counts the requests that have their first token and have not ended."""
    out: list[tuple[int, Outcome]] = []
    sent = 0

    async def one(i: int) -> Outcome:
        first = asyncio.Event()
        task = asyncio.create_task(suite.stream(token_request(prompts[i], max_tokens), timeout=180, on_first=first))
        await first.wait()
        live["streaming"] += 1
        try:
            return await task
        finally:
            live["streaming"] -= 1

    async def worker():
        nonlocal sent
        while not until(sent):
            i = sent % len(prompts)
            sent += 1
            out.append((i, await one(i)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def _kill_scenario(
    suite: Suite, role: str, name: str, prompt_len: tuple[int, int], max_tokens: int, pause_s: float
) -> Result:
    """Closed-loop load while `role` instances are SIGKILLed in turn (each once it has 2+ requests in flight, after
    a random pause up to `pause_s`), restarted on their port and back up before the next kill."""
    st = suite.stack
    n, min_kills = suite.count(120, 8), 4 if suite.scale >= 0.5 else 1
    prompts = suite.prompts(name, n, *prompt_len)
    refs = await suite.reference(prompts, max_tokens)
    retries0 = st.listing().retries
    kills: list[dict] = []
    done = asyncio.Event()
    rng = random.Random(name)
    live = {"streaming": 0}

    async def killer():
        victims = st.addresses(role)
        k = 0
        while not done.is_set():
            victim = victims[k % len(victims)]
            while not done.is_set():
                info = {i.address: i for i in (await asyncio.to_thread(st.listing)).instances}
                if info[victim].in_flight >= 2:
                    break
                await asyncio.sleep(0.02)
            if done.is_set():
                return
            await asyncio.sleep(rng.uniform(0.0, pause_s))
            st.kill(victim)
            kills.append(
                dict(
                    address=victim,
                    in_flight=info[victim].in_flight,
                    streaming_overall=live["streaming"],
                    at_s=round(time.monotonic() - t0, 2),
                )
            )
            await asyncio.to_thread(st.wait_exit, victim, 10)
            await asyncio.to_thread(st.restart, victim)
            await asyncio.to_thread(st.wait_up)
            k += 1

    t0 = time.monotonic()
    task = asyncio.create_task(killer())
    outs = await _closed_loop(suite, prompts, max_tokens, 12, lambda sent: sent >= n and len(kills) >= min_kills, live)
    done.set()
    await task
    tally, extras = Tally(), {}
    for i, o in outs:
        tally.add(o, ["OK"], refs[i], must_complete=True, label=f"prompt {i}")
    extras.update(kills=kills, retried_or_resumed=st.listing().retries - retries0, max_tokens=max_tokens)
    suite.leaked(tally, extras)
    return Result(tally, {"stream": ["OK"]}, extras, exercised=len(kills) >= min_kills)


async def decode_kill(suite: Suite) -> Result:
    """SIGKILL a decode instance while it streams (alternating between the two, restarted on its port each time)."""
    return await _kill_scenario(suite, DECODE, "decode_kill", (16, 40), 64, 0.6)


async def prefill_kill(suite: Suite) -> Result:
    """SIGKILL a prefill instance while it prefills / ships pages (long prompts, short outputs)."""
    return await _kill_scenario(suite, PREFILL, "prefill_kill", (150, 260), 8, 0.05)


async def redis_outage(suite: Suite) -> Result:
    """The prompt cache's Redis killed mid-load and started again (empty) later: requests must not notice."""
    n = suite.count(120, 9)
    rng = random.Random("redis")
    prefixes = suite.prompts("redis-prefix", 6, 48, 48)
    prompts = [prefixes[i % 6] + [rng.randrange(5, VOCAB) for _ in range(rng.randrange(3, 9))] for i in range(n)]
    refs = await suite.reference(prompts, 16)
    tally, phases = Tally(), {}
    third = n // 3
    for phase, lo, hi in (("before", 0, third), ("outage", third, 2 * third), ("after", 2 * third, n)):
        if phase == "outage":
            suite.redis.kill()
        elif phase == "after":
            suite.redis.start()
        idx = list(range(lo, hi))
        outs = await suite.run_all([token_request(prompts[i], 16) for i in idx], 6)
        for i, o in zip(idx, outs):
            tally.add(o, ["OK"], refs[i], must_complete=True, label=f"{phase} {i}")
        phases[phase] = dict(requests=len(idx), ok=sum(o.completed for o in outs))
        phases[phase]["cached_tokens"] = sum(o.cached_tokens for o in outs)
    extras = dict(phases=phases)
    suite.leaked(tally, extras)
    # exercised: the cache served prompts before the outage (so losing it mattered) and none during it
    used = phases["before"]["cached_tokens"] > 0 and phases["outage"]["cached_tokens"] == 0
    return Result(tally, {"stream": ["OK"]}, extras, exercised=used)


# ---- storms -----------------------------------------------------------------------------------------------------
STORM_OK = ["OK", "RESOURCE_EXHAUSTED"]  # a storm may meet admission's overload answer; nothing else


async def _controls(suite: Suite, tally: Tally, name: str) -> None:
    """After a storm: 20 fresh requests must complete exactly (the stack is still whole)."""
    prompts = suite.prompts(name + "-control", suite.count(20, 4), 16, 40)
    refs = await suite.reference(prompts, 16)
    for i, o in enumerate(await suite.run_all([token_request(p, 16) for p in prompts], 8)):
        tally.add(o, ["OK"], refs[i], must_complete=True, label=f"control {i}")


async def _storm(
    suite: Suite, name: str, prompts: list[list[int]], plan: list[tuple[int, dict]], code: str, count: str, least: int
) -> Result:
    """A storm: `plan`'s streams ((prompt index, `suite.stream` keywords)), 48 at once and never retried, each
    ending OK, overloaded or with `code` (counted as extras[`count`], at least `least` to have exercised it);
    then controls."""
    refs = await suite.reference(prompts, 32)
    sem = asyncio.Semaphore(48)

    async def one(i, kw):
        async with sem:
            return await suite.stream(token_request(prompts[i], 32), retry=False, **kw)

    outs = await asyncio.gather(*(one(i, kw) for i, kw in plan))
    tally, extras = Tally(), {}
    for (i, _kw), o in zip(plan, outs):
        tally.add(o, [*STORM_OK, code], refs[i], must_complete=False, label=f"{name} {i}")
    extras[count] = sum(o.code == code for o in outs)
    suite.leaked(tally, extras)
    await _controls(suite, tally, name)
    return Result(tally, {"storm": [*STORM_OK, code], "control": ["OK"]}, extras, exercised=extras[count] >= least)


async def cancel_storm(suite: Suite) -> Result:
    """1,000 streams cancelled by their callers at random points (before the first token, mid-stream), 20% left
    to finish; then controls."""
    n = suite.count(1000, 20)
    prompts = suite.prompts("cancel", 40, 12, 48)
    rng = random.Random("cancel")
    plan = []
    for k in range(n):
        r = rng.random()
        plan.append((k % 40, dict(cancel_after_s=rng.uniform(0.0, 0.25)) if r < 0.4 else {}))
        if 0.4 <= r < 0.8:
            plan[-1] = (k % 40, dict(cancel_after_tokens=rng.randint(1, 24)))
    return await _storm(suite, "cancel", prompts, plan, "CANCELLED", "cancelled", n // 2)


async def deadline_storm(suite: Suite) -> Result:
    """300 streams with deadlines from 5 ms to 1 s (most expire mid-prefill, mid-transfer or mid-stream)."""
    n = suite.count(300, 10)
    prompts = suite.prompts("deadline", 30, 12, 120)
    rng = random.Random("deadline")
    plan = [(k % 30, dict(timeout=rng.uniform(0.005, 1.0))) for k in range(n)]
    return await _storm(suite, "deadline", prompts, plan, "DEADLINE_EXCEEDED", "expired", n // 4)


async def duplicate_ids(suite: Suite) -> Result:
    """Pairs of requests with one request_id: the second starts once the first streams (half from the same
    tenant, half from another). The first must finish untouched; the second is served or refused ALREADY_EXISTS."""
    pairs = suite.count(50, 4)
    prompts = suite.prompts("dup", 2 * pairs, 16, 40)
    refs = await suite.reference(prompts, 48)
    tally = Tally()
    sem = asyncio.Semaphore(8)

    async def pair(k):
        async with sem:
            rid = f"dup-{k}-{os.urandom(3).hex()}"
            first_tok = asyncio.Event()
            a = asyncio.create_task(
                suite.stream(token_request(prompts[2 * k], 48, request_id=rid), timeout=30, on_first=first_tok)
            )
            await first_tok.wait()
            other = "tenant-a" if k % 2 == 0 else "tenant-b"
            b = await suite.stream(token_request(prompts[2 * k + 1], 48, request_id=rid), other, timeout=30)
            return await a, b

    for k, (a, b) in enumerate(await asyncio.gather(*(pair(k) for k in range(pairs)))):
        tally.add(a, ["OK"], refs[2 * k], must_complete=True, label=f"first {k}")
        tally.add(b, ["OK", "ALREADY_EXISTS"], refs[2 * k + 1], must_complete=False, label=f"second {k}")
    extras: dict = {}
    suite.leaked(tally, extras)
    return Result(tally, {"first": ["OK"], "second": ["OK", "ALREADY_EXISTS"]}, extras)


async def thread_budget(suite: Suite) -> Result:
    """Twice the decode instances' stream budget of long streams at once: every stream completes or is refused
    RESOURCE_EXHAUSTED at once, health checks keep answering (no instance marked down)."""
    budget = DECODE_MAX_STREAMS * len(suite.stack.decode)
    n = 2 * budget if suite.scale >= 0.5 else max(8, round(2 * budget * suite.scale))
    prompts = suite.prompts("threads", n, 16, 40)
    refs = await suite.reference(prompts, 96)
    failures0 = {i.address: i.failures for i in suite.stack.listing().instances}
    seen_down: set[str] = set()
    done = asyncio.Event()

    async def watch():
        while not done.is_set():
            for i in (await asyncio.to_thread(suite.stack.listing)).instances:
                if i.state != "up":
                    seen_down.add(i.address)
            await asyncio.sleep(0.2)

    w = asyncio.create_task(watch())
    outs = await suite.run_all([token_request(p, 96) for p in prompts], n, retry=False, timeout=180)
    done.set()
    await w
    tally, extras = Tally(), {}
    for i, o in enumerate(outs):
        tally.add(o, STORM_OK, refs[i], must_complete=False, label=f"stream {i}")
    failures = {i.address: i.failures - failures0.get(i.address, 0) for i in suite.stack.listing().instances}
    extras.update(
        streams=n,
        stream_budget_total=budget,
        rejected=sum(o.code == "RESOURCE_EXHAUSTED" for o in outs),
        instances_seen_not_up=sorted(seen_down),
        health_failures=failures,
    )
    suite.leaked(tally, extras)
    checks = {"no instance marked down": not seen_down, "some streams completed": tally.completed > 0}
    return Result(tally, {"stream": STORM_OK}, extras, checks=checks)


async def router_sigterm(suite: Suite) -> Result:
    """SIGTERM the router while long streams run. Cycles with the stack's grace (60 s) and 700-token streams (longer
    than the old fixed 5 s grace): every stream finishes; a new call during the drain is refused; the process exits.
    A last cycle restarts the router with a 0.5 s grace and streams that cannot finish in it: they end with
    UNAVAILABLE, having received only correct tokens."""
    st = suite.stack
    cycles = 2 if suite.scale >= 0.5 else 1
    n = suite.count(24, 3)
    tally, extras = Tally(), {"cycles": []}
    honoured = 0
    for cycle in range(cycles + 1):
        short = cycle == cycles
        max_tokens = 400 if short else 700  # long-grace cycles: streams that outlast the old fixed 5 s grace
        prompts = suite.prompts(f"sigterm-{cycle}", n, 16, 40)
        refs = await suite.reference(prompts, max_tokens)
        if short:
            await asyncio.to_thread(st.kill, st.router, signal.SIGTERM)
            await asyncio.to_thread(st.wait_exit, st.router, DRAIN_GRACE_S + 15)
            await asyncio.to_thread(st.restart, st.router, ["--drain-grace-s", "0.5"])
            await suite.open()
        started = [asyncio.Event() for _ in prompts]
        tasks = [
            asyncio.create_task(suite.stream(token_request(p, max_tokens), timeout=300, on_first=e))
            for p, e in zip(prompts, started)
        ]
        await asyncio.gather(*(e.wait() for e in started))
        router = st.router
        t_term = time.monotonic()
        st.kill(router, signal.SIGTERM)
        await asyncio.sleep(0.2)
        late = await suite.stream(token_request(prompts[0], 4), retry=False, timeout=10)
        tally.refusal(late.code, ["UNAVAILABLE"], label=f"call during drain (cycle {cycle})", details=late.details)
        outs = await asyncio.gather(*tasks)
        code = await asyncio.to_thread(st.wait_exit, router, (0.5 if short else DRAIN_GRACE_S) + 15)
        exit_s = time.monotonic() - t_term
        honoured += code is not None
        for i, o in enumerate(outs):
            # A stream whose first attempt was refused (admission) and whose retry came after the SIGTERM is a call
            # during the drain: refused, not owed a completion. Only streams running at the SIGTERM must finish.
            running = o.first_s is not None and o.first_s < t_term
            want = ["UNAVAILABLE"] if short or not running else ["OK"]
            label = f"cycle {cycle} stream {i}" + ("" if running or short else " (retried into the drain)")
            tally.add(o, want, refs[i], must_complete=not short and running, label=label)
        extras["cycles"].append(
            dict(grace_s=0.5 if short else DRAIN_GRACE_S, streams=n, max_tokens=max_tokens, exit_code=code,
                 exit_s=round(exit_s, 2), statuses=sorted({o.code for o in outs}))
        )  # fmt: skip
        await asyncio.to_thread(st.restart, router, [])
        await asyncio.to_thread(st.wait_up)
        await suite.open()
    extras["sigterms_honoured"] = f"{honoured}/{cycles + 1}"
    suite.leaked(tally, extras)
    long_drains = [c["exit_s"] for c in extras["cycles"][:-1]]
    exercised = all(t > 5.0 for t in long_drains) if suite.scale >= 0.5 else True  # streams outlasted 5 s
    expected = {"stream (grace long enough)": ["OK"], "stream (grace too short)": ["UNAVAILABLE"]}
    expected["call during drain"] = ["UNAVAILABLE"]
    expected["stream retried into the drain (first attempt refused by admission)"] = ["UNAVAILABLE"]
    checks = {"every SIGTERM honoured": honoured == cycles + 1}
    return Result(tally, expected, extras, exercised=exercised, checks=checks)


from reliability_abuse import ABUSE_SCENARIOS  # noqa: E402

SCENARIOS = {
    "decode_kill": decode_kill,
    "prefill_kill": prefill_kill,
    "redis_outage": redis_outage,
    "cancel_storm": cancel_storm,
    "deadline_storm": deadline_storm,
    "duplicate_ids": duplicate_ids,
    **ABUSE_SCENARIOS,
    "thread_budget": thread_budget,
    "router_sigterm": router_sigterm,
}


# ---- soak -------------------------------------------------------------------------------------------------------
def slope_per_min(samples: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope (MB per minute) of (seconds, MB) samples."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mx = sum(t for t, _ in samples) / n
    my = sum(v for _, v in samples) / n
    var = sum((t - mx) ** 2 for t, _ in samples)
    return 0.0 if var == 0 else 60.0 * sum((t - mx) * (v - my) for t, v in samples) / var


async def soak(suite: Suite, minutes: float, sample_s: float = 15.0) -> Result:
    """Steady mixed load for `minutes`: exact greedy streams (85%), cancels (5%), short deadlines (5%), an
    oversized prompt (5%, refused); RSS of every process sampled every `sample_s`; the slope over the second half."""
    prompts = suite.prompts("soak", 32, 12, 64)
    refs = await suite.reference(prompts, 24)
    tally = Tally()
    series: dict[str, list[tuple[float, float]]] = {}
    t0 = time.monotonic()
    end = t0 + minutes * 60
    rng = random.Random("soak")
    big = "x" * (2 << 20)

    async def worker():
        while time.monotonic() < end:
            i, r = rng.randrange(32), rng.random()
            if r < 0.05:
                o = await suite.stream(token_request(prompts[i], 24), cancel_after_tokens=rng.randint(1, 20))
                tally.add(o, ["OK", "CANCELLED"], refs[i], must_complete=False, label="soak cancel")
            elif r < 0.10:
                o = await suite.stream(token_request(prompts[i], 24), timeout=rng.uniform(0.01, 0.5))
                tally.add(o, ["OK", "DEADLINE_EXCEEDED"], refs[i], must_complete=False, label="soak deadline")
            elif r < 0.15:
                req = generate_pb2.GenerateRequest(prompt=big, sampling=generate_pb2.SamplingParams(max_tokens=4))
                o = await suite.stream(req, timeout=30)
                tally.refusal(o.code, ["INVALID_ARGUMENT"], label="soak oversized", details=o.details)
            else:
                o = await suite.stream(token_request(prompts[i], 24), timeout=120)
                tally.add(o, ["OK"], refs[i], must_complete=True, label="soak stream")
            await asyncio.sleep(0.1)  # steady, not flat out: the host is shared

    async def sampler():
        while time.monotonic() < end:
            now = time.monotonic() - t0
            for name, mb in suite.stack.rss_mb().items():
                series.setdefault(name, []).append((now, mb))
            await asyncio.sleep(sample_s)

    await asyncio.gather(sampler(), *(worker() for _ in range(3)))
    half = minutes * 30
    slopes = {k: round(slope_per_min([s for s in v if s[0] >= half]), 3) for k, v in series.items()}
    extras = dict(
        minutes=minutes,
        rss_slope_mb_per_min=max(slopes.values(), default=0.0),
        rss_slope_by_process=slopes,
        rss_mb_first={k: round(v[0][1], 1) for k, v in series.items()},
        rss_mb_last={k: round(v[-1][1], 1) for k, v in series.items()},
        rss_samples=len(next(iter(series.values()), [])),
    )
    suite.leaked(tally, extras)
    return Result(tally, {"stream": ["OK"], "cancel": ["OK", "CANCELLED"], "deadline": ["OK", "DEADLINE_EXCEEDED"],
                          "oversized": ["INVALID_ARGUMENT"]}, extras)  # fmt: skip


# ---- driver -------------------------------------------------------------------------------------------------------
def write(path: Path | None, doc: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


async def run(args) -> dict:
    names = list(SCENARIOS) if args.scenarios == "all" else [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS and s != "soak"]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}, soak")
    work = (
        Path(args.work) if args.work else Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-reliability-{os.getpid()}"
    )
    work.mkdir(parents=True, exist_ok=True)
    n_pre, n_dec = (int(x) for x in args.instances.split(","))
    doc: dict = dict(
        schema=SCHEMA,
        generated=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        commit=git_commit(),
        command=" ".join(["python", *sys.argv]),
        host=dict(machine=platform.machine(), cpus=os.cpu_count(), python=platform.python_version()),
        stack=dict(
            model="tiny random llama (pdserve.models.build_checkpoint seed 4: 2 layers, hidden 64, vocab 512)",
            main=f"router + {n_pre} prefill + {n_dec} decode, kv-dtype auto (float32 pages), page 4, chunk 16, "
            f"router SLO targets TTFT {SLO_TTFT_MS} ms / TPOT {SLO_TPOT_MS} ms, Redis prompt cache (no local tier), "
            f"public bearer auth (2 tenants), internal token, {'mTLS (test CA)' if args.tls else 'plaintext'}, "
            f"decode --max-streams {DECODE_MAX_STREAMS}, router "
            f"--drain-grace-s {DRAIN_GRACE_S:g}",
            hostile_kv="router + 1 decode (kv-dtype int8) + an impostor prefill in the harness process",
            scale=args.scale,
        ),
        targets=dict(TARGETS, anonymous_internal_calls_refused="all"),
        scenarios={},
    )
    if args.merge and args.json is not None and args.json.exists():  # keep the other scenarios' last records
        doc["scenarios"] = json.loads(args.json.read_text()).get("scenarios", {})
        doc["merged"] = "scenarios not run by this command keep their record from an earlier run (their own commit)"
    t_start = time.monotonic()
    suite = Suite(work, args.scale, prefill=n_pre, decode=n_dec, tls=args.tls)
    try:
        suite.stack.start()
        await suite.open()
        for name in names + (["soak"] if args.soak_minutes > 0 and "soak" not in names else []):
            print(f"[{time.monotonic() - t_start:7.1f}s] {name} ...", flush=True)
            t0 = time.monotonic()
            try:
                await asyncio.to_thread(suite.heal)
                await suite.open()
                fn = SCENARIOS.get(name)
                suite.retried = 0
                suite.baseline = await asyncio.to_thread(suite.stack.pages_in_use)
                res = await (fn(suite) if fn else soak(suite, args.soak_minutes or 1.0))
                rec = res.record(time.monotonic() - t0)
                rec["client_retries_of_resource_exhausted"] = suite.retried
            except Exception as e:  # a scenario that breaks the harness is a failed scenario, not a lost run
                rec = dict(passed=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
            rec["commit"] = doc["commit"]
            doc["scenarios"][name] = rec
            print(f"  {name}: " + json.dumps({k: rec.get(k) for k in ("passed", *Tally().counters(), "error")}))
            write(args.json, doc)
    finally:
        if suite.channel is not None:
            await suite.channel.close()
        suite.close()
    soak_rec = doc["scenarios"].get("soak", {})
    doc["rss_slope_mb_per_min"] = soak_rec.get("rss_slope_mb_per_min")
    doc["summary"] = dict(
        passed=[n for n, r in doc["scenarios"].items() if r.get("passed")],
        failed=[n for n, r in doc["scenarios"].items() if not r.get("passed")],
        seconds=round(time.monotonic() - t_start, 1),
    )
    write(args.json, doc)
    return doc


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write the results here (rewritten after each scenario)")
    ap.add_argument("--scenarios", default="all", help=f"comma-separated subset of: {', '.join(SCENARIOS)}, soak")
    ap.add_argument("--soak-minutes", type=float, default=0.0, help="run the soak for this long (0: no soak)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the request counts (smoke runs: 0.05)")
    ap.add_argument("--instances", default="2,2", help="prefill,decode instances of the main stack (kills need 2)")
    ap.add_argument("--tls", action="store_true", help="TLS on every port, client certificates on internal ones")
    ap.add_argument("--merge", action="store_true", help="update only the scenarios run now in an existing --json")
    ap.add_argument("--work", default="", help="working directory (model, logs); default: a new one under $TMPDIR")
    args = ap.parse_args(argv)
    doc = asyncio.run(run(args))
    print(json.dumps(doc["summary"]))


if __name__ == "__main__":
    main()
