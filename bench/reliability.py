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
import json
import os
import random
import signal
import statistics
import struct
import time
import traceback
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import crc32c
import grpc
from benchutil import provenance

from pdserve.cache.fetch_policy import PROBE_AFTER_S
from pdserve.cache.value_auth import TAG_BYTES
from pdserve.cli.launch import start_service, wait_ready
from pdserve.engine.config import EngineConfig
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import CHANNEL_OPTIONS
from pdserve.server.security import ChannelSecurity
from pdserve.server.tls import TlsConfig
from pdserve.testing.fault_stack import DECODE, PREFILL, FaultStack, Identity
from pdserve.testing.impostors import HOSTILE_VARIANTS, VALID, VARIANTS, ImpostorDecode, ImpostorPrefill
from pdserve.testing.redis_server import RedisServer
from pdserve.testing.stream_audit import (
    TARGETS,
    Outcome,
    Result,
    Tally,
    status_name,
    stream_once,
    stream_retrying,
    token_request,
)  # fmt: skip
from pdserve.v1 import (
    generate_pb2,
    generate_pb2_grpc,
    internal_pb2,
    internal_pb2_grpc,
    kv_pb2,
    router_admin_pb2,
    router_admin_pb2_grpc,
)  # fmt: skip

SCHEMA = "pdserve.reliability/1"
GenerateRequest = generate_pb2.GenerateRequest
VOCAB = 512  # build_checkpoint's tiny tokenizer
PAGE, CHUNK = 4, 16
DECODE_MAX_STREAMS = 24  # each decode's stream budget (--max-streams) in the main stack
DRAIN_GRACE_S = 60.0  # the main stack router's --drain-grace-s
SLO_TTFT_MS, SLO_TPOT_MS = 5000, 250  # the main stack router's SLO admission targets (CPU figures)


class Suite:
    """The shared stack and what scenarios need from it: prompts, references, public calls, healing."""

    def __init__(self, work: Path, scale: float, seed: int = 0, prefill: int = 2, decode: int = 2, tls: bool = False):
        self.work, self.scale, self.seed = work, scale, seed
        self.model = build_checkpoint(work / "model", arch="llama", seed=4)
        self.tenants = {"tenant-a": "tok-a-" + os.urandom(12).hex(), "tenant-b": "tok-b-" + os.urandom(12).hex()}
        tokens_file = work / "auth-tokens.json"
        tokens_file.write_text(json.dumps({tok: t for t, tok in self.tenants.items()}))
        self.redis = RedisServer(work / "redis").start()
        self.identity = Identity.with_tls(work / "pki") if tls else Identity.with_token()
        self.engine_args = ["--torch-threads", "1", "--page-size", str(PAGE), "--chunk-size", str(CHUNK), "--num-pages",
                            "2048", "--kv-dtype", "auto", "--max-num-seqs", "16", "--log-level", "INFO"]  # fmt: skip
        router_args = ["--auth-tokens-file", str(tokens_file), "--drain-grace-s", str(DRAIN_GRACE_S),
                       "--max-queue-wait-s", "20", "--default-timeout-s", "120",
                       # SLO admission targets for a shared CPU host (the defaults are GPU figures: 15 ms per token)
                       "--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-tpot-ms", str(SLO_TPOT_MS)]  # fmt: skip
        prefill_args = ["--redis-url", self.redis.url, "--cache-local-mb", "0", "--max-streams", "64"]
        decode_args = ["--max-streams", str(DECODE_MAX_STREAMS)]
        self.stack = FaultStack(self.model, work / "stack", prefill=prefill, decode=decode, identity=self.identity,
                                engine_args=self.engine_args, prefill_args=prefill_args, decode_args=decode_args,
                                router_args=router_args)  # fmt: skip
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
        return generate_pb2_grpc.GenerationStub(self.channel)

    async def stream(self, req: GenerateRequest, tenant="tenant-a", retry=True, stub=None, **kw) -> Outcome:
        """One stream as `tenant` (through `stub`, default the main stack's router). `retry`: RESOURCE_EXHAUSTED
        before the first token is retried after the router's pushback, as the SDK does (a caller of pdserve.Client
        never sees it unless the overload lasts); False: the first answer counts (storms and the thread-budget
        scenario, where that answer is the point)."""
        stub, metadata = stub or self.stub, self.metadata(tenant)
        if retry:
            out = await stream_retrying(stub, req, metadata=metadata, **kw)
            self.retried += out.retries
            return out
        return await stream_once(stub, req, metadata=metadata, **kw)

    async def run_all(self, reqs: Sequence[GenerateRequest], concurrency: int, retry=True, each=(), **kw):
        """`reqs`, `concurrency` at once; `each`: per-request `stream` keywords (beside the shared `kw`)."""
        sem = asyncio.Semaphore(concurrency)

        async def one(r, more):
            async with sem:
                return await self.stream(r, retry=retry, **kw, **more)

        return list(await asyncio.gather(*(one(r, m) for r, m in zip(reqs, each or [{}] * len(reqs)))))

    async def started(self, req: GenerateRequest, tenant="tenant-a", **kw) -> asyncio.Task:
        """A stream running in a task, returned once it has its first token (or has failed)."""
        first = asyncio.Event()
        task = asyncio.create_task(self.stream(req, tenant, on_first=first, **kw))
        await first.wait()
        return task

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

    async def exact(self, tally: Tally, prompts, max_tokens: int, concurrency: int, label="control", first=0, **kw):
        """Greedy streams of `prompts`, each owed its whole reference output (tallied as `label i`, i from `first`);
        `kw`: `stream`'s keywords. Their outcomes."""
        refs = await self.reference(prompts, max_tokens)
        outs = await self.run_all([token_request(p, max_tokens) for p in prompts], concurrency, **kw)
        for i, (o, ref) in enumerate(zip(outs, refs), first):
            tally.add(o, ["OK"], ref, must_complete=True, label=f"{label} {i}")
        return outs

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
            in_flight = {i.address: i.in_flight for i in listing.instances}
            extras["router_held"] = dict(queued=listing.queued, in_flight=in_flight)

    def result(self, tally: Tally, expected: dict, extras: dict, **kw) -> Result:
        """A scenario's Result, once what it left held is counted (`leaked`)."""
        self.leaked(tally, extras)
        return Result(tally, expected, extras, **kw)

    def close(self) -> None:
        self.stack.stop()
        self.redis.stop()


# ---- failover scenarios ---------------------------------------------------------------------------------------
async def _closed_loop(suite: Suite, prompts, max_tokens: int, concurrency: int, until, live: dict) -> list:
    """Send prompts round-robin from `concurrency` workers until `until(sent)` is true; (prompt index, outcome).
    `live["streaming"]` counts the requests that have their first token and have not ended."""
    out: list[tuple[int, Outcome]] = []
    sent = 0  # requests started, over all workers

    async def one(i: int) -> Outcome:
        task = await suite.started(token_request(prompts[i], max_tokens), timeout=180)
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


async def _kill_scenario(suite: Suite, role: str, name: str, prompt_len: tuple, max_tokens: int, pause_s: float):
    """Closed-loop load while `role` instances are SIGKILLed in turn (each once it has 2+ requests in flight, after
    a random pause up to `pause_s`), restarted on their port and back up before the next kill."""
    st = suite.stack
    n, min_kills = suite.count(120, 8), 4 if suite.scale >= 0.5 else 1
    prompts = suite.prompts(name, n, *prompt_len)
    refs = await suite.reference(prompts, max_tokens)
    retries0, rng = st.listing().retries, random.Random(name)
    kills: list[dict] = []
    done, live = asyncio.Event(), {"streaming": 0}

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
            kills.append(dict(address=victim, in_flight=info[victim].in_flight, streaming_overall=live["streaming"],
                              at_s=round(time.monotonic() - t0, 2)))  # fmt: skip
            await asyncio.to_thread(st.wait_exit, victim, 10)
            await asyncio.to_thread(st.restart, victim)
            await asyncio.to_thread(st.wait_up)
            k += 1

    t0 = time.monotonic()
    task = asyncio.create_task(killer())
    outs = await _closed_loop(suite, prompts, max_tokens, 12, lambda sent: sent >= n and len(kills) >= min_kills, live)
    done.set()
    await task
    tally = Tally()
    for i, o in outs:
        tally.add(o, ["OK"], refs[i], must_complete=True, label=f"prompt {i}")
    extras = dict(kills=kills, retried_or_resumed=st.listing().retries - retries0, max_tokens=max_tokens)
    return suite.result(tally, {"stream": ["OK"]}, extras, exercised=len(kills) >= min_kills)


async def decode_kill(suite: Suite) -> Result:
    """SIGKILL a decode instance while it streams (alternating between the two, restarted on its port each time)."""
    return await _kill_scenario(suite, DECODE, "decode_kill", (16, 40), 64, 0.6)


async def prefill_kill(suite: Suite) -> Result:
    """SIGKILL a prefill instance while it prefills / ships pages (long prompts, short outputs)."""
    return await _kill_scenario(suite, PREFILL, "prefill_kill", (150, 260), 8, 0.05)


async def redis_outage(suite: Suite) -> Result:
    """The prompt cache's Redis killed mid-load and started again (empty) later: requests must not notice."""
    n, rng = suite.count(120, 9), random.Random("redis")
    prefixes = suite.prompts("redis-prefix", 6, 48, 48)
    prompts = [prefixes[i % 6] + [rng.randrange(5, VOCAB) for _ in range(rng.randrange(3, 9))] for i in range(n)]
    await suite.reference(prompts, 16)  # on the whole stack
    tally, phases = Tally(), {}
    third = n // 3
    for phase, lo, hi in (("before", 0, third), ("outage", third, 2 * third), ("after", 2 * third, n)):
        if phase == "outage":
            suite.redis.kill()
        elif phase == "after":
            suite.redis.start()
        outs = await suite.exact(tally, prompts[lo:hi], 16, 6, phase, first=lo)
        phases[phase] = dict(requests=hi - lo, ok=sum(o.completed for o in outs),
                             cached_tokens=sum(o.cached_tokens for o in outs))  # fmt: skip
    # exercised: the cache served prompts before the outage (so losing it mattered) and none during it
    used = phases["before"]["cached_tokens"] > 0 and phases["outage"]["cached_tokens"] == 0
    return suite.result(tally, {"stream": ["OK"]}, dict(phases=phases), exercised=used)


# ---- storms -----------------------------------------------------------------------------------------------------
STORM_OK = ["OK", "RESOURCE_EXHAUSTED"]  # a storm may meet admission's overload answer; nothing else


async def _storm(suite: Suite, name: str, shape: tuple, plan: list, code: str, count: str, least: int) -> Result:
    """A storm over `suite.prompts(name, *shape)`: `plan`'s streams ((prompt index, `suite.stream` keywords)), 48 at
    once, never retried, each ending OK, overloaded or with `code` (counted as extras[`count`], at least `least` to
    have exercised it); then controls: 20 fresh requests that must complete exactly (the stack is still whole)."""
    prompts = suite.prompts(name, *shape)
    refs = await suite.reference(prompts, 32)
    reqs, each = [token_request(prompts[i], 32) for i, _ in plan], [kw for _, kw in plan]
    outs = await suite.run_all(reqs, 48, retry=False, each=each)
    tally, extras = Tally(), {}
    for (i, _kw), o in zip(plan, outs):
        tally.add(o, [*STORM_OK, code], refs[i], must_complete=False, label=f"{name} {i}")
    extras[count] = sum(o.code == code for o in outs)
    suite.leaked(tally, extras)
    await suite.exact(tally, suite.prompts(name + "-control", suite.count(20, 4), 16, 40), 16, 8)
    return Result(tally, {"storm": [*STORM_OK, code], "control": ["OK"]}, extras, exercised=extras[count] >= least)


async def cancel_storm(suite: Suite) -> Result:
    """1,000 streams cancelled by their callers at random points (before the first token, mid-stream), 20% left
    to finish; then controls."""
    n = suite.count(1000, 20)
    rng = random.Random("cancel")
    plan = []
    for k in range(n):  # 40% cancelled after a time, 40% after some tokens, 20% left to finish
        r = rng.random()
        kw = dict(cancel_after_s=rng.uniform(0.0, 0.25)) if r < 0.4 else {}
        plan.append((k % 40, dict(cancel_after_tokens=rng.randint(1, 24)) if 0.4 <= r < 0.8 else kw))
    return await _storm(suite, "cancel", (40, 12, 48), plan, "CANCELLED", "cancelled", n // 2)


async def deadline_storm(suite: Suite) -> Result:
    """300 streams with deadlines from 5 ms to 1 s (most expire mid-prefill, mid-transfer or mid-stream)."""
    n = suite.count(300, 10)
    rng = random.Random("deadline")
    plan = [(k % 30, dict(timeout=rng.uniform(0.005, 1.0))) for k in range(n)]
    return await _storm(suite, "deadline", (30, 12, 120), plan, "DEADLINE_EXCEEDED", "expired", n // 4)


async def duplicate_ids(suite: Suite) -> Result:
    """Pairs of requests with one request_id: the second starts once the first streams (half from the same
    tenant, half from another). The first must finish untouched; the second is served or refused ALREADY_EXISTS."""
    pairs = suite.count(50, 4)
    prompts = suite.prompts("dup", 2 * pairs, 16, 40)
    refs = await suite.reference(prompts, 48)
    tally, sem = Tally(), asyncio.Semaphore(8)

    async def pair(k):
        async with sem:
            rid = f"dup-{k}-{os.urandom(3).hex()}"
            a = await suite.started(token_request(prompts[2 * k], 48, request_id=rid), timeout=30)
            other = "tenant-a" if k % 2 == 0 else "tenant-b"
            b = await suite.stream(token_request(prompts[2 * k + 1], 48, request_id=rid), other, timeout=30)
            return await a, b

    for k, (a, b) in enumerate(await asyncio.gather(*(pair(k) for k in range(pairs)))):
        tally.add(a, ["OK"], refs[2 * k], must_complete=True, label=f"first {k}")
        tally.add(b, ["OK", "ALREADY_EXISTS"], refs[2 * k + 1], must_complete=False, label=f"second {k}")
    return suite.result(tally, {"first": ["OK"], "second": ["OK", "ALREADY_EXISTS"]}, {})


async def thread_budget(suite: Suite) -> Result:
    """Twice the decode instances' stream budget of long streams at once: every stream completes or is refused
    RESOURCE_EXHAUSTED at once, health checks keep answering (no instance marked down)."""
    budget = DECODE_MAX_STREAMS * len(suite.stack.decode)
    n = 2 * budget if suite.scale >= 0.5 else max(8, round(2 * budget * suite.scale))
    prompts = suite.prompts("threads", n, 16, 40)
    refs = await suite.reference(prompts, 96)
    failures0 = {i.address: i.failures for i in suite.stack.listing().instances}
    seen_down: set[str] = set()
    done = asyncio.Event()  # the streams ended: stop watching

    async def watch():
        while not done.is_set():
            listing = await asyncio.to_thread(suite.stack.listing)
            seen_down.update(i.address for i in listing.instances if i.state != "up")
            await asyncio.sleep(0.2)

    w = asyncio.create_task(watch())
    outs = await suite.run_all([token_request(p, 96) for p in prompts], n, retry=False, timeout=180)
    done.set()
    await w
    tally, extras = Tally(), {}
    for i, o in enumerate(outs):
        tally.add(o, STORM_OK, refs[i], must_complete=False, label=f"stream {i}")
    failures = {i.address: i.failures - failures0.get(i.address, 0) for i in suite.stack.listing().instances}
    extras.update(streams=n, stream_budget_total=budget, rejected=sum(o.code == "RESOURCE_EXHAUSTED" for o in outs),
                  instances_seen_not_up=sorted(seen_down), health_failures=failures)  # fmt: skip
    checks = {"no instance marked down": not seen_down, "some streams completed": tally.completed > 0}
    return suite.result(tally, {"stream": STORM_OK}, extras, checks=checks)


async def router_sigterm(suite: Suite) -> Result:
    """SIGTERM the router while long streams run. Cycles with the stack's grace (60 s) and 700-token streams (longer
    than the old fixed 5 s grace): every stream finishes; a new call during the drain is refused; the process exits.
    A last cycle restarts the router with a 0.5 s grace and streams that cannot finish in it: they end with
    UNAVAILABLE, having received only correct tokens."""
    st = suite.stack
    cycles, n = 2 if suite.scale >= 0.5 else 1, suite.count(24, 3)
    tally, extras, honoured = Tally(), {"cycles": []}, 0
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
        tasks = await asyncio.gather(*(suite.started(token_request(p, max_tokens), timeout=300) for p in prompts))
        router, t_term = st.router, time.monotonic()
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
    long_drains = [c["exit_s"] > 5.0 for c in extras["cycles"][:-1]]  # the streams outlasted the old 5 s grace
    exercised = all(long_drains) if suite.scale >= 0.5 else True
    refused = ("stream (grace too short)", "call during drain",
               "stream retried into the drain (first attempt refused by admission)")  # fmt: skip
    expected = {"stream (grace long enough)": ["OK"], **{k: ["UNAVAILABLE"] for k in refused}}
    checks = {"every SIGTERM honoured": honoured == cycles + 1}
    return suite.result(tally, expected, extras, exercised=exercised, checks=checks)


# ---- abuse: calls a hostile or clumsy party makes ------------------------------------------------------------
REFUSED = ["UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED"]
TOO_BIG = ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"]


def _call(fn) -> tuple[str, str]:
    """Run one blocking call; ("OK", "") when it was served (a stream: it sent anything or ended cleanly)."""
    try:
        out = fn()
        if hasattr(out, "__next__"):
            next(out, None)
            out.cancel()
        return "OK", ""
    except grpc.RpcError as e:
        return status_name(e), e.details() or ""


def _layout(model_dir) -> kv_pb2.KVLayout:
    """The main stack's KV layout (kv-dtype auto on CPU: float32 pages), as a PrefillRequest carries it."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return kv_pb2.KVLayout(format_version=1, dtype=kv_pb2.KV_DTYPE_FLOAT32, page_size=PAGE, group_size=0,
                           num_layers=cfg["num_hidden_layers"], num_kv_heads=cfg["num_key_value_heads"],
                           head_dim=cfg["hidden_size"] // cfg["num_attention_heads"])  # fmt: skip


def _internal_calls(suite, impostor: str) -> list[tuple[str, str, object]]:
    """(label, address, call(channel)) for every internal RPC on every port of the stack, the public one included."""
    st = suite.stack
    rid, prompt = "anon-" + os.urandom(4).hex(), [5 + i for i in range(12)]
    s = generate_pb2.SamplingParams(max_tokens=4, temperature=0.0)
    preq = internal_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=s,
                                       kv_layout=_layout(suite.model))  # fmt: skip
    msg = internal_pb2.PrefillClientMessage(request=preq)
    P, D, R = internal_pb2_grpc.PrefillStub, internal_pb2_grpc.DecodeStub, router_admin_pb2_grpc.RegistryStub
    prefill_stats, decode_stats = (_rpc(stub, "Stats", internal_pb2.StatsRequest()) for stub in (P, D))
    dreq = internal_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=s, prefill_target=impostor)
    out = [c for a in st.prefill for c in (("Prefill.Prefill", a, _rpc(P, "Prefill", lambda: iter([msg]))),
                                           ("Prefill.Stats", a, prefill_stats))]  # fmt: skip
    out += [c for a in st.decode for c in (("Decode.Generate", a, _rpc(D, "Generate", dreq)),
                                           ("Decode.Stats", a, decode_stats))]  # fmt: skip
    pb, role = router_admin_pb2, router_admin_pb2.INSTANCE_ROLE_DECODE
    registry = [("Register", pb.RegisterRequest(role=role, address=impostor)),
                ("Heartbeat", pb.HeartbeatRequest(role=role, address=impostor)),
                ("Deregister", pb.DeregisterRequest(role=role, address=st.decode[0])),
                ("ListInstances", pb.ListInstancesRequest())]  # fmt: skip
    for a in sorted({st.registry_address(), st.router}):
        out += [(f"Registry.{method}", a, _rpc(R, method, msg)) for method, msg in registry]
        if a == st.router and a != st.registry_address():  # the internal services on the public port
            out += [("Decode.Stats@public", a, decode_stats), ("Prefill.Stats@public", a, prefill_stats)]
    return out


def _rpc(stub, method: str, msg):
    """call(channel): `stub`'s `method` with `msg` (a callable: called for a fresh message, e.g. a request stream)."""
    return lambda ch: getattr(stub(ch), method)(msg() if callable(msg) else msg, timeout=10)


def _anonymous_channels(suite) -> dict[str, ChannelSecurity]:
    """The ways an outsider calls: plaintext without identity or with a guessed token; with TLS on, also TLS without
    a client certificate, and with a well-formed certificate from another CA."""
    wrong, tls = "wrong-" + os.urandom(12).hex(), suite.identity.tls
    if not tls.on:
        return {"no identity": ChannelSecurity.anonymous(), "wrong token": ChannelSecurity(token=wrong)}
    from pdserve.testing.certs import CertAuthority

    rogue = CertAuthority.create(suite.work / "rogue-pki").issue("intruder")
    return {
        "plaintext": ChannelSecurity.anonymous(),
        "TLS, no client certificate": ChannelSecurity(TlsConfig(ca=tls.ca)),
        "TLS, no client certificate, wrong token": ChannelSecurity(TlsConfig(ca=tls.ca), token=wrong),
        "TLS, certificate from another CA": ChannelSecurity(TlsConfig(rogue.cert, rogue.key, tls.ca)),
    }


async def _refuse_all(suite, tally: Tally, calls: list[tuple[str, str, object]]) -> list[str]:
    """Each (label, address, call(channel)) through each of `_anonymous_channels`: each must be refused."""
    seen = []
    for variant, sec in _anonymous_channels(suite).items():
        for label, target, fn in calls:
            with sec.open(target, CHANNEL_OPTIONS) as ch:
                code, details = await asyncio.to_thread(_call, lambda: fn(ch))
            tally.refusal(code, _refused(suite), label=f"{label} on {target} ({variant})", details=details)
            seen.append(f"{label} ({variant}): {code}")
    return seen


def _refused(suite) -> list[str]:
    """Refusals: a missing or wrong identity; the service not served on that port; with TLS on, the handshake
    itself refused (UNAVAILABLE on a port that, as the insider calls show, is up)."""
    return [*REFUSED, "UNAVAILABLE"] if suite.identity.tls.on else REFUSED


async def anonymous_internal(suite) -> Result:
    """Every internal RPC (Prefill, Decode, Registry) on every port, without the internal identity and with a wrong
    token: each must be refused (UNAUTHENTICATED / PERMISSION_DENIED, or UNIMPLEMENTED where the service is not
    served), and nothing may reach the impostor prefill a decode was told to dial."""
    impostor = ImpostorPrefill(lambda p: VALID, PAGE)
    addr, server = impostor.start()
    tally, extras = Tally(), {}
    try:
        calls = _internal_calls(suite, addr)
        extras["calls"] = await _refuse_all(suite, tally, calls)
        insider = {}
        for label, target, fn in calls:  # the same calls as an insider, read-only ones only: the ports do serve
            registry_here = not label.startswith("Registry") or target == suite.stack.registry_address()
            read_only = label.endswith("Stats") or label.endswith("ListInstances")
            if read_only and registry_here and "@public" not in label:
                got = await asyncio.to_thread(_call, lambda: fn(suite.stack.channel_for(target)))
                insider[f"{label} on {target}"] = got[0]
        states = await asyncio.to_thread(suite.stack.states)
    finally:
        server.stop(0)
    extras.update(insider_calls=insider, impostor_prefill_calls=impostor.calls, instances_after=states)
    checks = {
        "every anonymous call refused": tally.completed == 0,
        "decode never dialled the caller's prefill target": impostor.calls == 0,
        "insider calls served (the ports are up)": all(c == "OK" for c in insider.values()),
        "no impostor in the router's table, every instance still up": _all_up(states, suite.stack),
    }  # fmt: skip
    return suite.result(tally, {"anonymous internal call": _refused(suite)}, extras, checks=checks)


def _all_up(states: dict[str, str], st: FaultStack) -> bool:
    return set(states) == set(st.prefill + st.decode) and all(v == "up" for v in states.values())


async def bogus_registration(suite) -> Result:
    """Anonymous Register of an impostor decode and prefill and Deregister of the real instances, on the router's
    public and internal ports; then prompts through the router: none may reach an impostor, all must be exact."""
    st = suite.stack
    dec, pre = ImpostorDecode(), ImpostorPrefill(lambda p: VALID, PAGE)
    (dec_addr, dec_server), (pre_addr, pre_server) = dec.start(), pre.start()
    pb, tally, extras = router_admin_pb2, Tally(), {}
    try:
        D, P = pb.INSTANCE_ROLE_DECODE, pb.INSTANCE_ROLE_PREFILL
        reqs = [pb.RegisterRequest(role=D, address=dec_addr), pb.RegisterRequest(role=P, address=pre_addr)]
        dereg = [pb.DeregisterRequest(role=r, address=a) for r, ads in ((D, st.decode), (P, st.prefill)) for a in ads]
        beats = [pb.HeartbeatRequest(role=D, address=dec_addr)]
        rpcs = (("Register", reqs), ("Heartbeat", beats), ("Deregister", dereg))
        targets, stub = sorted({st.registry_address(), st.router}), router_admin_pb2_grpc.RegistryStub
        calls = [(method, t, _rpc(stub, method, m)) for t in targets for method, msgs in rpcs for m in msgs]
        await _refuse_all(suite, tally, calls * suite.count(5, 1))
        await suite.exact(tally, suite.prompts("bogus", suite.count(40, 4), 16, 40), 16, 8, "prompt")
        states = await asyncio.to_thread(st.states)
    finally:
        dec_server.stop(0)
        pre_server.stop(0)
    extras.update(impostor_decode_calls=dec.calls, impostor_prefill_calls=pre.calls, instances_after=states)
    checks = {
        "no prompt reached an impostor": dec.calls == 0 and pre.calls == 0,
        "router table unchanged, all up": _all_up(states, st),
    }  # fmt: skip
    return suite.result(tally, {"registry call": _refused(suite), "prompt": ["OK"]}, extras, checks=checks)


async def hostile_kv(suite) -> Result:
    """A prefill instance gone bad: the router's only prefill is an impostor that answers each request with KV
    pages damaged one way (NaN / inf scales, flipped byte, sizes, indexes, identity fields, out-of-vocab first
    token, missing pages, garbage). Decode (int8 pool) must refuse each with its status, send no token, free every
    page; the impostor's well-formed pages ("valid", the control) must generate."""
    impostor = ImpostorPrefill(lambda p: VARIANTS[p[0] - 100] if 100 <= p[0] < 100 + len(VARIANTS) else VALID, PAGE)
    addr, server = impostor.start(suite.identity.tls)  # a prefill gone bad: it holds the stack's certificate
    stack = FaultStack(suite.model, suite.work / "hostile", prefill=0, decode=1,
                       engine_args=[a if a != "auto" else "int8" for a in suite.engine_args],
                       router_args=["--auth-tokens-file", str(suite.work / "auth-tokens.json")], extra_prefill=[addr],
                       identity=suite.identity)  # fmt: skip
    tally, extras = Tally(), {}
    try:
        await asyncio.to_thread(stack.start)
        rng = random.Random("hostile")
        plan = [(v, [100 + VARIANTS.index(v)] + [rng.randrange(5, VOCAB) for _ in range(rng.randrange(9, 24))])
                for v in VARIANTS for _ in range(suite.count(8, 1))]  # fmt: skip
        async with suite.identity.public_channel(stack.router) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            outs = await suite.run_all([token_request(p, 8) for _, p in plan], 8, retry=False, timeout=60, stub=stub)
        for (v, _), o in zip(plan, outs):
            if v == VALID:
                tally.add(o, ["OK"], None, must_complete=True, label=v)
            else:  # any token delivered is a garbage token
                tally.add(o, list(HOSTILE_VARIANTS[v]), None, must_complete=False, label=v)
                tally.no_tokens(o, v)
        by_variant = {v: dict(Counter(o.code for (w, _), o in zip(plan, outs) if w == v)) for v in VARIANTS}
        used = await asyncio.to_thread(stack.wait_drained, 30)
        tally.leaked_pages = sum(p for p, _ in used.values())
        extras.update(by_variant=by_variant, impostor_served=dict(impostor.served),
                      leaked_requests=sum(r for _, r in used.values()))  # fmt: skip
    finally:
        await asyncio.to_thread(stack.stop)
        server.stop(0)
    expected = {"valid pages (control)": ["OK"], **{v: list(c) for v, c in HOSTILE_VARIANTS.items()}}
    return Result(tally, expected, extras, exercised=sum(impostor.served.values()) >= len(plan))


def _raw_call(st: FaultStack, address: str, method: str, body: bytes, unary: bool = False):
    """A call of `method` with `body` as the serialized request, over the stack's insider channel."""
    ch, ident = st.channel_for(address), (lambda b: b)
    kind = ch.unary_unary if unary else ch.unary_stream
    return lambda: kind(method, request_serializer=ident, response_deserializer=ident)(body, timeout=30)


def _oversized(suite) -> list[tuple[str, object, list[str]]]:
    """(name, request or raw call, allowed statuses): public requests far over the limits, and insider messages
    over the internal ports' size limits."""
    mb, G = 1 << 20, GenerateRequest
    s = lambda **kw: generate_pb2.SamplingParams(max_tokens=4, temperature=0.0, **kw)
    cases: list[tuple[str, object, list[str]]] = [
        ("prompt 10 MB", G(prompt="a" * (10 * mb), sampling=s()), TOO_BIG),
        ("prompt 10 MB of 3-byte characters", G(prompt="€" * (10 * mb // 3), sampling=s()), TOO_BIG),
        ("100k stop strings", G(prompt="hi", sampling=s(stop=["ab"] * 100_000)), TOO_BIG),
        ("one 1 MB stop string", G(prompt="hi", sampling=s(stop=["x" * mb])), TOO_BIG),
        ("100k stop_token_ids", G(prompt="hi", sampling=s(stop_token_ids=[5] * 100_000)), TOO_BIG),
        ("1M prompt token ids", G(token_ids=generate_pb2.TokenIds(ids=[5] * 1_000_000), sampling=s()), TOO_BIG),
        ("100k chat messages", G(messages=[generate_pb2.ChatMessage(role="user", content="hi")] * 100_000), TOO_BIG),
        ("request_id 1 MB", G(request_id="r" * mb, prompt="hi", sampling=s()), TOO_BIG),
        ("message 100 MB", G(prompt="a" * (100 * mb), sampling=s()), TOO_BIG),
    ]  # fmt: skip
    st = suite.stack
    # an 80 MB DecodeRequest (request_id, then 80M packed token ids of one byte each), built as bytes
    big = _field(1, b"big") + _field(2, b"\x05" * (80 * mb))
    reg = router_admin_pb2.RegisterRequest(role=router_admin_pb2.INSTANCE_ROLE_DECODE, address="h" * (16 * mb))
    decode = _raw_call(st, st.decode[0], "/pdserve.v1.Decode/Generate", big)
    registry = _raw_call(st, st.registry_address(), "/pdserve.v1.Registry/Register", reg.SerializeToString(), True)
    return cases + [("decode: 80 MB DecodeRequest (insider)", decode, TOO_BIG),
                    ("registry: 16 MB Register (insider)", registry, TOO_BIG)]  # fmt: skip


async def oversized_inputs(suite) -> Result:
    """Requests far over every limit (10 MB prompts, 100k stop strings, 1M token ids, 100 MB messages, ...), each
    repeated, while exact control streams run: each refused at once, the controls unharmed."""
    prompts = suite.prompts("oversized-control", 8, 16, 40)
    await suite.reference(prompts, 96)  # before the abuse starts
    tally = Tally()
    router_rss0 = suite.stack.rss_mb().get(f"router@{suite.stack.router}")
    controls = asyncio.create_task(suite.exact(tally, prompts, 96, 8, timeout=180))
    seen = await _refusals(suite, tally, _oversized(suite), suite.count(3, 1), 60)
    extras: dict = {"seconds_to_refuse": {name: round(s, 3) for name, (_, s) in seen.items()}}
    await controls
    extras["router_rss_mb"] = [router_rss0, suite.stack.rss_mb().get(f"router@{suite.stack.router}")]
    extras["slowest_refusal_s"] = slowest = max(extras["seconds_to_refuse"].values())
    checks = {"every refusal within 2 s": slowest < 2.0}
    return suite.result(tally, {"oversized": TOO_BIG, "control": ["OK"]}, extras, checks=checks)


async def _refusals(suite, tally: Tally, cases, reps: int, timeout: float) -> dict[str, tuple[str, float]]:
    """Each (name, public request or blocking call, allowed statuses) `reps` times, never retried; a request must
    send no token. Per name: its last status and its slowest answer (seconds)."""
    seen: dict[str, tuple[str, float]] = {}
    for name, req, allowed in cases:
        for _ in range(reps):
            t0 = time.monotonic()
            is_request = isinstance(req, GenerateRequest)
            o = await suite.stream(req, retry=False, timeout=timeout) if is_request else None
            code, details = (o.code, o.details) if o is not None else await asyncio.to_thread(_call, req)
            tally.refusal(code, allowed, label=name, details=details)
            if o is not None:
                tally.no_tokens(o, name)
            seen[name] = (code, max(time.monotonic() - t0, seen.get(name, ("", 0.0))[1]))
    return seen


def _field(num: int, data: bytes) -> bytes:
    """One length-delimited protobuf field (tag, varint length, bytes)."""
    n, out = len(data), bytearray([(num << 3) | 2])
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out) + data


async def malformed_inputs(suite) -> Result:
    """Malformed public requests (unknown priority, invalid UTF-8, token ids outside the vocabulary, no input,
    out-of-range sampling values): each INVALID_ARGUMENT with no token generated."""
    G, S = generate_pb2.GenerateRequest, generate_pb2.SamplingParams
    ids = lambda xs: generate_pb2.TokenIds(ids=xs)
    cases = [
        ("unknown priority", G(prompt="hi", priority=99, sampling=S(max_tokens=4))),
        ("token id -1", G(token_ids=ids([5, -1]), sampling=S(max_tokens=4))),
        ("token id 10^6", G(token_ids=ids([5, 10**6]), sampling=S(max_tokens=4))),
        ("empty token ids", G(token_ids=ids([]), sampling=S(max_tokens=4))),
        ("no input", G(sampling=S(max_tokens=4))),
        ("temperature NaN", G(prompt="hi", sampling=S(max_tokens=4, temperature=float("nan")))),
        ("temperature -1", G(prompt="hi", sampling=S(max_tokens=4, temperature=-1.0))),
        ("top_p 1.5", G(prompt="hi", sampling=S(max_tokens=4, top_p=1.5))),
        ("top_k -1", G(prompt="hi", sampling=S(max_tokens=4, top_k=-1))),
        ("max_tokens 0", G(prompt="hi", sampling=S(max_tokens=0))),
        ("max_tokens -5", G(prompt="hi", sampling=S(max_tokens=-5))),
        ("top_logprobs 50", G(prompt="hi", sampling=S(max_tokens=4, top_logprobs=50))),
        ("unknown chat role", G(messages=[generate_pb2.ChatMessage(role="wizard", content="hi")])),
    ]  # fmt: skip
    # a GenerateRequest whose `prompt` (field 2) is invalid UTF-8: built as bytes (a message cannot hold it)
    sampling = _field(4, generate_pb2.SamplingParams(max_tokens=4, temperature=0.0).SerializeToString())
    body, tls, ident = _field(2, b"\xff\xfe bad utf-8 \xc3\x28") + sampling, suite.identity.tls, (lambda b: b)
    public = ChannelSecurity(TlsConfig(ca=tls.ca)) if tls.on else ChannelSecurity.anonymous()
    with public.open(suite.stack.router, CHANNEL_OPTIONS) as ch:
        raw = ch.unary_stream("/pdserve.v1.Generation/GenerateStream", ident, ident)
        cases.append(("invalid UTF-8 prompt", lambda: raw(body, metadata=suite.metadata(), timeout=30)))
        cases = [(name, req, ["INVALID_ARGUMENT"]) for name, req in cases]
        seen = await _refusals(suite, tally := Tally(), cases, suite.count(4, 1), 30)
    extras = {"statuses_by_case": {name: code for name, (code, _) in seen.items()}}
    return suite.result(tally, {"malformed": ["INVALID_ARGUMENT"]}, extras)


# ---- fairness and determinism under load (issue 35) ---------------------------------------------------------------
def _ttft_s(o: Outcome) -> float:
    return (o.first_s if o.first_s is not None else o.end_s) - o.sent_s


async def long_prompt_fairness(suite) -> Result:
    """A tenant's long prompt (900 tokens: 57 chunks of 16) beside another tenant's short requests: the short ones
    complete exactly (as alone), none reaching its first token later than alone by more than one chunk's time (plus
    the host's noise); the long one completes exactly too (its page wait scales with its work; nothing fails its
    batch mates). Every request asks for prompt logprobs, so each prompt is computed, none served from a cache."""
    lp = dict(prompt_logprobs=True)  # every prompt token computed: nothing from the pool or the prompt cache
    long_req = token_request(suite.prompts("fair-long", 1, 900, 900)[0], 8, **lp)
    shorts = [token_request(p, 8, **lp) for p in suite.prompts("fair-short", suite.count(24, 6), 8, 16)]
    long_alone = await suite.stream(long_req, timeout=300)
    alone = await suite.run_all(shorts, 2, tenant="tenant-b", timeout=120)
    chunk_s = _ttft_s(long_alone) / -(-len(long_req.token_ids.ids) // CHUNK)  # its time to first token per chunk
    long_task = asyncio.create_task(suite.stream(long_req, timeout=300))
    await asyncio.sleep(3 * chunk_s)  # its first chunks are in the engine
    beside = await suite.run_all(shorts, 2, tenant="tenant-b", timeout=120)
    long_beside = await long_task
    tally = Tally()
    tally.add(long_alone, ["OK"], None, must_complete=True, label="long alone")
    tally.add(long_beside, ["OK"], long_alone.tokens, must_complete=True, label="long beside")
    for i, (a, b) in enumerate(zip(alone, beside)):
        tally.add(a, ["OK"], None, must_complete=True, label=f"short alone {i}")
        tally.add(b, ["OK"], a.tokens, must_complete=True, label=f"short beside {i}")
    worst = max(_ttft_s(b) - _ttft_s(a) for a, b in zip(alone, beside))
    noise_s = 0.3 + statistics.median(map(_ttft_s, alone))  # a shared 2-core host's jitter
    ms = lambda xs: [round(1e3 * _ttft_s(o)) for o in xs]
    extras = dict(chunk_ms=round(1e3 * chunk_s, 1), short_ttft_ms_alone=ms(alone), short_ttft_ms_beside=ms(beside),
                  long_ttft_ms_alone=ms([long_alone])[0], long_ttft_ms_beside=ms([long_beside])[0],
                  worst_short_delay_ms=round(1e3 * worst),
                  allowed_delay_ms=round(1e3 * (chunk_s + noise_s)))  # fmt: skip
    checks = {"short requests' first tokens delayed by at most a chunk (+ noise)": worst <= chunk_s + noise_s}
    overlapped = (long_beside.first_s or long_beside.end_s) > min(o.sent_s for o in beside)  # shorts met its chunks
    return suite.result(tally, {"stream": ["OK"]}, extras, exercised=overlapped, checks=checks)


WIDE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)


async def greedy_under_load(suite) -> Result:
    """N concurrent greedy streams against the same prompts run one at a time, per KV mode, each on a 1+1 stack of
    a random llama of SmolLM2-135M's widths (6 layers: its GEMMs take MKL's shape-dependent paths, the tiny model's
    do not; 128 tokens a stream, 48 below --scale 0.5: differences show late). Modes: unquantized KV (`auto`), the
    default int8 (`--batch-invariant` as EngineConfig sets it) and int8 with `--batch-invariant`. Differing streams
    are counted per mode (`differing_<mode>`); where the mode promises the same tokens (auto, batch-invariant) a
    differing stream is a wrong output."""
    n, max_tokens = suite.count(48, 6), 128 if suite.scale >= 0.5 else 48
    model = suite.work / "wide-model"
    if not (model / "config.json").exists():
        build_checkpoint(model, arch="llama", seed=3, num_hidden_layers=6, **WIDE)
    prompts = suite.prompts("greedy-load", n, 16, 48)
    tally, extras = Tally(), dict(streams=n, max_tokens=max_tokens, int8_batch_invariant=EngineConfig.batch_invariant)
    modes = {
        "auto": ("auto", True),
        "int8": ("int8", EngineConfig.batch_invariant),
        "int8_batch_invariant": ("int8", True),
    }
    for mode, (kv, invariant) in modes.items():
        args = [a if a != "auto" else kv for a in suite.engine_args] + ["--batch-invariant"] * (
            kv != "auto" and invariant
        )
        args += ["--max-num-seqs", str(max(16, n)), "--num-pages", "4096"]  # all in one batch (a later flag wins)
        stack = FaultStack(model, suite.work / f"greedy-{mode}", prefill=1, decode=1, engine_args=args,
                           decode_args=["--max-streams", str(2 * n)],
                           router_args=["--auth-tokens-file", str(suite.work / "auth-tokens.json")],
                           identity=suite.identity)  # fmt: skip
        try:
            await asyncio.to_thread(stack.start)
            async with suite.identity.public_channel(stack.router) as ch:
                stub = generate_pb2_grpc.GenerationStub(ch)
                alone = [await suite.stream(token_request(p, max_tokens), stub=stub, timeout=120) for p in prompts]
                reqs = [token_request(p, max_tokens) for p in prompts]
                together = await suite.run_all(reqs, n, stub=stub, timeout=300)
            for i, (a, t) in enumerate(zip(alone, together)):
                tally.add(a, ["OK"], None, must_complete=True, label=f"{mode} alone {i}")
                tally.add(t, ["OK"], a.tokens if invariant else None, must_complete=True, label=f"{mode} together {i}")
            pairs = [(a, t) for a, t in zip(alone, together) if a.completed and t.completed]
            extras[f"differing_{mode}"] = sum(a.tokens != t.tokens for a, t in pairs)
            used = await asyncio.to_thread(stack.wait_drained, 30)
            tally.leaked_pages += sum(p for p, _ in used.values())
        finally:
            await asyncio.to_thread(stack.stop)
    return Result(tally, {"stream": ["OK"]}, extras)


# ---- cache forgery (issue 35 item 1) ------------------------------------------------------------------------------
def _value_parts(value: bytes) -> tuple[int, int]:
    """(page index, header length) of a stored prompt-cache value: header (its three block lengths last) | CRC32C |
    data | scales | zeros | MAC tag (pdserve.cache.value, value_auth)."""
    for end in range(60, len(value)):  # the header's end: where its block lengths add up to the value's size
        if end + 4 + sum(struct.unpack_from("<QQQ", value, end - 24)) + TAG_BYTES == len(value):
            return struct.unpack_from("<I", value, 40)[0], end
    raise ValueError("not a prompt-cache value")


def _new_page0(rds, before: set[bytes], pages: int) -> tuple[bytes, set[bytes]]:
    """Wait for `pages` new keys (a prompt's write-back) beyond `before`: the key of its page 0, and all keys now."""
    deadline = time.monotonic() + 30
    while len(new := set(rds.keys("*")) - before) < pages:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the write-back stored {len(new)} of {pages} pages")
        time.sleep(0.05)
    page0 = next(k for k in new if _value_parts(rds.get(k))[0] == 0)
    return page0, before | new


def _mac_failures(member) -> float:
    """The prefill's `pdserve_prompt_cache_total{event="mac_failures"}` (its /metrics)."""
    with urllib.request.urlopen(f"http://{member.info['metrics']}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if "prompt_cache_total" in x and "mac_failures" in x)


async def cache_forgery(suite) -> Result:
    """An attacker with write access to Redis forges alice's cached page 0: alice's stored header, bob's page data,
    a recomputed CRC32C and alice's old MAC tag. Alice's next request must miss (cached_tokens 0) with her exact
    output and the prefill's mac_failures counter up; the recomputed page's write-back replaces the forgery. A 1+1
    stack on the suite's Redis, prefix reuse off (a hit must come from Redis) and no local tier."""
    pre_args = ["--redis-url", suite.redis.url, "--cache-local-mb", "0", "--no-prefix-reuse"]
    stack = FaultStack(suite.model, suite.work / "forgery", prefill=1, decode=1, engine_args=suite.engine_args,
                       prefill_args=pre_args, router_args=["--auth-tokens-file", str(suite.work / "auth-tokens.json")],
                       identity=suite.identity)  # fmt: skip
    rds, tally, checks, extras = suite.redis.client(), Tally(), {}, {}
    alice, bob = suite.prompts("forgery", 2, 4 * PAGE + 1, 4 * PAGE + 1)
    try:
        await asyncio.to_thread(stack.start)
        prefill = stack.members[stack.prefill[0]]
        async with suite.identity.public_channel(stack.router) as ch:
            run = lambda p, tenant: suite.stream(token_request(p, 8), tenant, stub=generate_pb2_grpc.GenerationStub(ch),
                                                 timeout=60)  # fmt: skip
            keys = set(rds.keys("*"))
            cold = await run(alice, "tenant-a")
            a_key, keys = await asyncio.to_thread(_new_page0, rds, keys, 4)
            await run(bob, "tenant-b")
            b_key, keys = await asyncio.to_thread(_new_page0, rds, keys, 4)
            a_value, b_value = rds.get(a_key), rds.get(b_key)
            _, head = _value_parts(a_value)
            data = b_value[head + 4 : len(b_value) - TAG_BYTES]  # bob's page bytes (same layout: same lengths)
            crc = crc32c.crc32c(data, crc32c.crc32c(a_value[:head])).to_bytes(4, "little")
            rds.set(a_key, a_value[:head] + crc + data + a_value[len(a_value) - TAG_BYTES :])
            macs = _mac_failures(prefill)
            # the tiny model computes faster than Redis fetches: the store is asked again once that is stale
            await asyncio.sleep(PROBE_AFTER_S + 0.5)
            forged = await run(alice, "tenant-a")
            extras.update(mac_failures_added=_mac_failures(prefill) - macs, forged_cached_tokens=forged.cached_tokens)
            deadline = time.monotonic() + 30
            while (replaced := rds.get(a_key) == a_value) is False and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the recomputed page's write-back
        tally.add(cold, ["OK"], None, must_complete=True, label="alice cold")
        tally.add(forged, ["OK"], cold.tokens, must_complete=True, label="alice over the forged page")
        checks = {"the forged page is a miss (cached_tokens 0)": forged.cached_tokens == 0,
                  "mac_failures counted it": extras["mac_failures_added"] >= 1,
                  "the recomputed page replaced the forgery": replaced}  # fmt: skip
        used = await asyncio.to_thread(stack.wait_drained, 30)
        tally.leaked_pages = sum(p for p, _ in used.values())
        extras["leaked_requests"] = sum(r for _, r in used.values())
    finally:
        rds.close()
        await asyncio.to_thread(stack.stop)
    return Result(tally, {"stream": ["OK"]}, extras, checks=checks)


# ---- the OpenAI gateway (issue 35 items 2 and 3) ----------------------------------------------------------------
GATEWAY_LIMITS = ["--header-timeout-s", "2", "--body-timeout-s", "2", "--max-body-mb", "1", "--max-connections", "256"]


class Gateway:
    """`pdserve serve gateway` in front of the main stack's router (HTTP on loopback; TLS to the router with --tls),
    with short header / body deadlines (`GATEWAY_LIMITS`)."""

    def __init__(self, suite) -> None:
        tls = suite.identity.tls
        args = ["--router", suite.stack.router, "--model-name", "tiny", *GATEWAY_LIMITS]
        args += ["--tls-ca", str(tls.ca)] if tls.on else []
        self.work = suite.work / "gateway"
        self.work.mkdir(exist_ok=True)
        self.proc, ready, log = start_service("gateway", args, self.work)
        try:
            self.host, port = str(wait_ready(self.proc, ready, log, timeout=60)).rsplit(":", 1)
        except BaseException:
            self.proc.kill()
            raise
        self.port, self.auth = int(port), f"Bearer {suite.tenants['tenant-a']}"

    def request(self, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
        """A whole HTTP/1.1 request (Connection: close; Content-Length set)."""
        head = {"Host": "gw", "Authorization": self.auth, "Content-Type": "application/json", **(headers or {})}
        head |= {"Content-Length": str(len(body)), "Connection": "close"}
        lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
        return f"{method} {path} HTTP/1.1\r\n".encode() + lines.encode("latin-1") + b"\r\n" + body

    async def send(self, raw: bytes, timeout: float = 60.0) -> tuple[int, bytes]:
        """(status, body) of one raw request; status 0 when the connection closed without a response."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        data = b""
        try:
            writer.write(raw)
            await writer.drain()
        except ConnectionError:  # refused before the whole body was sent (413): its answer may be read still
            pass
        try:
            async with asyncio.timeout(timeout):
                while chunk := await reader.read(1 << 16):
                    data += chunk
        except ConnectionError:  # reset after the answer
            pass
        finally:
            writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        parts = head.split(b" ", 2)
        return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), body

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()


def _fuzz_cases(rng: random.Random, n: int) -> list[tuple[str, str, bytes, list[str]]]:
    """(label, path, body, allowed status classes): hand-made malformed bodies (4xx only), then `n` seeded
    mutations of a valid chat body, one field given a hostile value (2xx or 4xx: never 5xx, never no answer)."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    bad = [
        ("truncated JSON", comp, b"{"),
        ("an array", comp, b"[]"),
        ("NaN", comp, b'{"prompt":"hi","temperature":NaN}'),
        ("Infinity", comp, b'{"prompt":"hi","top_p":Infinity}'),
        ("nesting 100 deep", comp, b'{"prompt":' + b"[" * 100 + b"]" * 100 + b"}"),
        ("a 5000-digit integer", comp, b'{"prompt":"hi","max_tokens":' + b"9" * 5000 + b"}"),
        ("lone surrogate", comp, b'{"prompt":"\\ud800"}'),
        ("invalid UTF-8", comp, b'{"prompt":"\xff\xfe"}'),
        ("messages a string", chat, b'{"messages":"hi"}'),
        ("content a number", chat, b'{"messages":[{"role":"user","content":5}]}'),
        ("unknown role", chat, b'{"messages":[{"role":"wizard","content":"hi"}]}'),
        ("max_tokens a string", comp, b'{"prompt":"hi","max_tokens":"ten"}'),
        ("max_tokens 0", comp, b'{"prompt":"hi","max_tokens":0}'),
        ("temperature 5", comp, b'{"prompt":"hi","temperature":5}'),
        ("top_p -1", comp, b'{"prompt":"hi","top_p":-1}'),
        ("n 3", comp, b'{"prompt":"hi","n":3}'),
        ("logprobs 50", comp, b'{"prompt":"hi","logprobs":50}'),
        ("seed 2^70", comp, b'{"prompt":"hi","seed":1180591620717411303424}'),
        ("token id -1", comp, b'{"prompt":[5,-1]}'),
        ("no prompt", comp, b'{"max_tokens":4}'),
        ("empty body", comp, b""),
        ("1.5 MiB body", comp, b" " * (3 << 19)),
    ]
    cases = [(label, path, body, ["4xx"]) for label, path, body in bad]
    hostile = [None, True, -1, 0, 1e308, -1e308, "", "x" * 300, [], {}, [[]], {"a": {"b": [1]}}, "\u0000", 2**64]
    fields = ["model", "messages", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "logprobs", "tools",
              "top_logprobs", "stream", "presence_penalty", "frequency_penalty", "response_format", "user"]  # fmt: skip
    for k in range(n):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        field_, value = rng.choice(fields), rng.choice(hostile)
        body[field_] = value
        raw = json.dumps(body).encode()
        cases.append((f"mutation {k}: {field_}={json.dumps(value)[:40]}", chat, raw, ["2xx", "4xx"]))
    return cases


async def gateway_fuzz(suite) -> Result:
    """Malformed and hostile OpenAI requests through the gateway: each answered 4xx (a mutation of a valid body: 2xx
    or 4xx), never 500 nor a dropped connection; wrong routes 404 / 405; controls complete."""
    gw = await asyncio.to_thread(Gateway, suite)
    tally, statuses = Tally(), Counter()
    try:
        cases = _fuzz_cases(random.Random("gateway-fuzz"), suite.count(120, 20))
        cases += [("unknown route", "/v1/nothing", b"{}", ["4xx"])]
        sem = asyncio.Semaphore(8)

        async def one(label, path, body, allowed):
            async with sem:
                status, reply = await gw.send(gw.request("POST", path, body))
            statuses[status] += 1
            tally.refusal(f"{status // 100}xx", allowed, label=label, details=reply[:200].decode(errors="replace"))

        await asyncio.gather(*(one(*c) for c in cases))
        status, reply = await gw.send(gw.request("GET", "/v1/completions"))  # a POST route
        statuses[status] += 1
        tally.refusal(f"{status // 100}xx", ["4xx"], label="GET on a POST route", details=str(status))
        body = json.dumps({"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0}).encode()
        controls = await asyncio.gather(*(gw.send(gw.request("POST", "/v1/completions", body)) for _ in range(4)))
        for status, reply in controls:
            tally.refusal(
                "OK" if status == 200 else f"HTTP {status}", ["OK"], label="control", details=str(reply[:200])
            )
    finally:
        await asyncio.to_thread(gw.stop)
    extras = dict(cases=len(cases) + 1, http_statuses={str(k): v for k, v in sorted(statuses.items())})
    checks = {"no 5xx": not any(500 <= k < 600 for k in statuses), "no dropped connection": 0 not in statuses}
    return suite.result(tally, {"malformed": ["4xx"], "mutation": ["2xx", "4xx"], "control": ["OK"]}, extras,
                        checks=checks)  # fmt: skip


async def _slow_client(gw: Gateway, body_stall: bool, hold_s: float) -> tuple[float, int]:
    """A connection that sends half its headers (or all headers and half its body), then one byte a second: how
    long until the gateway closed it, and the status it answered (0: none)."""
    reader, writer = await asyncio.open_connection(gw.host, gw.port)
    t0 = time.monotonic()
    body = b'{"prompt":"hi","max_tokens":4}'
    raw = gw.request("POST", "/v1/completions", body)
    cut = len(raw) - len(body) // 2 if body_stall else raw.index(b"\r\n") + 10
    writer.write(raw[:cut])
    data = b""
    try:
        for _ in range(int(hold_s)):
            await writer.drain()
            try:
                data = await asyncio.wait_for(reader.read(-1), 1.0)
                break  # closed by the gateway
            except TimeoutError:
                writer.write(b" " if body_stall else b"X")  # a trickle that never completes the request
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
    parts = data.split(b" ", 2)
    return time.monotonic() - t0, int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


async def slow_clients(suite) -> Result:
    """Many slow-header and stalled-body connections at once: the gateway closes each within its deadline (2 s here,
    `--header-timeout-s` / `--body-timeout-s`) with 408 or a close, while normal requests through it complete."""
    gw = await asyncio.to_thread(Gateway, suite)
    n, tally = suite.count(100, 10), Tally()
    try:
        slow = [asyncio.create_task(_slow_client(gw, k % 2 == 1, 20)) for k in range(n)]
        await asyncio.sleep(0.5)
        body = json.dumps({"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0}).encode()
        normal = await asyncio.gather(*(gw.send(gw.request("POST", "/v1/completions", body)) for _ in range(n // 2)))
        closed = await asyncio.gather(*slow)
    finally:
        await asyncio.to_thread(gw.stop)
    for status, reply in normal:
        tally.refusal("OK" if status == 200 else f"HTTP {status}", ["OK"], label="normal", details=str(reply[:200]))
    for k, (held, status) in enumerate(closed):
        in_time = 1.5 <= held < 2 + 3  # held until its 2 s deadline, closed by it (plus a loaded host's noise)
        code = "closed in time" if in_time else f"closed after {held:.1f} s"
        tally.refusal(code, ["closed in time"], label=f"slow {'body' if k % 2 else 'header'} {k}", details=str(status))
    extras = dict(slow_connections=n, normal_requests=n // 2, held_s_max=round(max(h for h, _ in closed), 2),
                  slow_statuses=dict(Counter(str(s) for _, s in closed)))  # fmt: skip
    return suite.result(tally, {"normal": ["OK"], "slow": ["closed in time"]}, extras)


SCENARIOS = {f.__name__: f for f in (decode_kill, prefill_kill, redis_outage, cancel_storm, deadline_storm,
                                      duplicate_ids, anonymous_internal, bogus_registration, hostile_kv,
                                      oversized_inputs, malformed_inputs, thread_budget, router_sigterm,
                                      cache_forgery, gateway_fuzz, slow_clients, long_prompt_fairness,
                                      greedy_under_load)}  # fmt: skip


# ---- soak -------------------------------------------------------------------------------------------------------
def slope_per_min(samples: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope (MB per minute) of (seconds, MB) samples."""
    if len({t for t, _ in samples}) < 2:
        return 0.0
    return 60.0 * statistics.linear_regression([t for t, _ in samples], [v for _, v in samples]).slope


async def soak(suite: Suite, minutes: float, sample_s: float = 15.0) -> Result:
    """Steady mixed load for `minutes`: exact greedy streams (85%), cancels (5%), short deadlines (5%), an
    oversized prompt (5%, refused); RSS of every process sampled every `sample_s`; the slope over the second half."""
    prompts = suite.prompts("soak", 32, 12, 64)
    refs = await suite.reference(prompts, 24)
    tally = Tally()
    series: dict[str, list[tuple[float, float]]] = {}
    t0, rng, big = time.monotonic(), random.Random("soak"), "x" * (2 << 20)
    end = t0 + minutes * 60

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
    slopes = {k: round(slope_per_min([s for s in v if s[0] >= minutes * 30]), 3) for k, v in series.items()}
    extras = dict(minutes=minutes, rss_slope_mb_per_min=max(slopes.values(), default=0.0), rss_slope_by_process=slopes,
                  rss_mb_first={k: round(v[0][1], 1) for k, v in series.items()},
                  rss_mb_last={k: round(v[-1][1], 1) for k, v in series.items()},
                  rss_samples=len(next(iter(series.values()), [])))  # fmt: skip
    expected = {"stream": ["OK"], "cancel": ["OK", "CANCELLED"], "deadline": ["OK", "DEADLINE_EXCEEDED"]}
    return suite.result(tally, {**expected, "oversized": ["INVALID_ARGUMENT"]}, extras)


# ---- driver -------------------------------------------------------------------------------------------------------
def write(path: Path | None, doc: dict) -> None:
    """The whole record, replaced (atomically: an interrupted run leaves the last complete one)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(doc, indent=1) + "\n")
        path.with_suffix(".tmp").replace(path)


async def run(args) -> dict:
    names = list(SCENARIOS) if args.scenarios == "all" else [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS and s != "soak"]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}, soak")
    work = Path(args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-reliability-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    n_pre, n_dec = (int(x) for x in args.instances.split(","))
    prov = provenance(args.commit)
    stack = dict(
        model="tiny random llama (pdserve.models.build_checkpoint seed 4: 2 layers, hidden 64, vocab 512)",
        main=f"router + {n_pre} prefill + {n_dec} decode, kv-dtype auto (float32 pages), page 4, chunk 16, "
        f"router SLO targets TTFT {SLO_TTFT_MS} ms / TPOT {SLO_TPOT_MS} ms, Redis prompt cache (no local tier), "
        f"public bearer auth (2 tenants), internal token, {'mTLS (test CA)' if args.tls else 'plaintext'}, "
        f"decode --max-streams {DECODE_MAX_STREAMS}, router --drain-grace-s {DRAIN_GRACE_S:g}",
        hostile_kv="router + 1 decode (kv-dtype int8) + an impostor prefill in the harness process",
        scale=args.scale,
    )
    doc: dict = dict(schema=SCHEMA, generated=prov["date"], commit=prov["commit"], command=prov["command"],
                     host=prov["device"], stack=stack, targets=dict(TARGETS, anonymous_internal_calls_refused="all"),
                     scenarios={})  # fmt: skip
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
    doc["rss_slope_mb_per_min"] = doc["scenarios"].get("soak", {}).get("rss_slope_mb_per_min")
    ok = {n: bool(r.get("passed")) for n, r in doc["scenarios"].items()}
    doc["summary"] = dict(passed=[n for n in ok if ok[n]], failed=[n for n in ok if not ok[n]],
                          seconds=round(time.monotonic() - t_start, 1))  # fmt: skip
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
    ap.add_argument("--commit", default="", help="the commit measured (a copied tree may lack git)")
    print(json.dumps(asyncio.run(run(ap.parse_args(argv)))["summary"]))


if __name__ == "__main__":
    main()
