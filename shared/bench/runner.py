"""Load generation for `pdserve bench`: asyncio streams over `pdserve.AsyncClient`, in one or several processes.

Open loop: every request is sent at its arrival time (Poisson or a trace), whatever is in flight. Closed loop: a
fixed number of streams, each sending its next request when the last one ends. Each request is one
`GenerateStream` with `ignore_eos` and `max_tokens` = its output length; the record holds when it was planned and
sent, when each chunk with tokens arrived and when the stream ended, on `time.monotonic()` (the system-wide
CLOCK_MONOTONIC, the same in every worker process), relative to the run's start.

Several worker processes (`workers`) split the requests (request i goes to worker i mod W; a closed loop's streams
are split as evenly), so hundreds of streams at a 10 ms token pace stay within what one Python event loop can
read on time; `client_lag` in the report shows whether the client kept up.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from pdserve.bench.workload import PromptMaker, RequestSpec

if TYPE_CHECKING:
    from pdserve.client import AsyncClient

READY_TIMEOUT_S = 120.0  # a worker process that has not started by then is broken
START_MARGIN_S = 0.25  # between "every worker ready" and the run's start


@dataclass(frozen=True)
class ClientOptions:
    """How requests are sent: the router's address and credentials, the per-request deadline, sampling."""

    target: str
    timeout_s: float = 600.0
    retry: bool = False  # retry RESOURCE_EXHAUSTED as the SDK does (off: a rejection is an error)
    temperature: float = 0.0
    token: str | None = None  # bearer token (sent as `authorization: Bearer ...`)
    tls: bool = False  # TLS, verified against the system roots (or tls_ca)
    tls_ca: str | None = None  # PEM file of the root certificate(s); set: TLS

    def client(self) -> AsyncClient:
        """A `pdserve.AsyncClient` (create it inside the event loop that uses it)."""
        from pdserve.client import AsyncClient

        return AsyncClient(
            self.target, timeout=self.timeout_s, retry=self.retry, token=self.token, tls=self.tls, tls_ca=self.tls_ca
        )


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds from the run's start."""

    index: int
    input_tokens: int
    output_tokens: int  # asked for (max_tokens with ignore_eos)
    scheduled_s: float | None  # open loop: the planned send time
    send_s: float = 0.0
    end_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in that chunk
    status: str = "OK"  # a grpc.StatusCode name, or CLIENT_ERROR
    error: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens the server took from its prompt cache (should stay 0)
    server_ttft_ms: float | None = None  # the router's own TTFT (receipt → first token sent)

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)


@dataclass(frozen=True)
class Load:
    """One run: `specs` (open loop when they carry arrival times), or a closed loop of `concurrency` streams over
    `specs` (stopping after `duration_s` when set)."""

    specs: Iterable[RequestSpec]
    concurrency: int | None = None
    duration_s: float | None = None
    total: int | None = None  # the number of requests when known (progress bar)


async def send_one(client, spec: RequestSpec, ids: list[int], opts: ClientOptions, t0: float) -> RequestRecord:
    """Stream one request and time it."""
    rec = RequestRecord(
        spec.index,
        spec.input_tokens,
        spec.output_tokens,
        spec.arrival_s,
        send_s=time.monotonic() - t0,
    )
    try:
        async for ch in client.stream(
            token_ids=ids, max_tokens=spec.output_tokens, ignore_eos=True, temperature=opts.temperature
        ):
            now = time.monotonic() - t0
            if ch.token_ids:
                rec.chunk_s.append(now)
                rec.chunk_tokens.append(len(ch.token_ids))
            if ch.ttft_ms is not None and rec.server_ttft_ms is None:
                rec.server_ttft_ms = ch.ttft_ms
            if ch.finish_reason is not None:
                rec.finish_reason = ch.finish_reason
                rec.cached_tokens = ch.usage.cached_tokens if ch.usage else 0
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        rec.status = code.name if code is not None else "UNKNOWN"
        rec.error = (e.details() if hasattr(e, "details") else str(e)) or ""
    except Exception as e:  # recorded: one broken request must not end the run
        rec.status, rec.error = "CLIENT_ERROR", repr(e)
    rec.end_s = time.monotonic() - t0
    return rec


async def run_load(
    load: Load,
    prompts: PromptMaker,
    opts: ClientOptions,
    t0: float | None = None,
    on_done: Callable[[int], None] | None = None,
    client=None,
) -> list[RequestRecord]:
    """Run `load` in this event loop, starting at monotonic time `t0` (default: now); `on_done(1)` per request."""
    own = client is None
    client = client or opts.client()
    t0 = time.monotonic() if t0 is None else t0
    records: list[RequestRecord] = []

    def finished(rec: RequestRecord) -> None:
        records.append(rec)
        if on_done is not None:
            on_done(1)

    try:
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        if load.concurrency is None:
            tasks = []
            for spec in load.specs:
                ids = prompts.make(spec.index, spec.input_tokens)  # built before its time comes
                await asyncio.sleep(max(0.0, t0 + (spec.arrival_s or 0.0) - time.monotonic()))
                task = asyncio.create_task(send_one(client, spec, ids, opts, t0))
                task.add_done_callback(lambda t: finished(t.result()))
                tasks.append(task)
            await asyncio.gather(*tasks)
        else:
            stop = None if load.duration_s is None else t0 + load.duration_s
            it = iter(load.specs)

            async def stream_slot() -> None:
                for spec in it:  # one iterator shared by the slots of this loop
                    if stop is not None and time.monotonic() >= stop:
                        return
                    finished(await send_one(client, spec, prompts.make(spec.index, spec.input_tokens), opts, t0))

            await asyncio.gather(*(stream_slot() for _ in range(load.concurrency)))
    finally:
        if own:
            await client.close()
    records.sort(key=lambda r: r.index)
    return records


# ---- several processes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Share:
    """One worker's requests, lazily (picklable, unlike a generator): those with index mod `mod` in [lo, hi)."""

    specs: Iterable[RequestSpec]
    lo: int
    hi: int
    mod: int

    def __iter__(self) -> Iterator[RequestSpec]:
        return (s for s in self.specs if self.lo <= s.index % self.mod < self.hi)


def split(load: Load, workers: int) -> list[Load]:
    """The workers' shares. Open loop: request i goes to worker i mod W. Closed loop: the C streams are split as
    evenly as they go and each worker takes the requests of its streams (index mod C), so shares follow streams."""
    if load.concurrency is None:
        return [Load(_Share(load.specs, w, w + 1, workers), None, load.duration_s) for w in range(workers)]
    c = load.concurrency
    workers = min(workers, c)
    bounds = [w * c // workers for w in range(workers + 1)]
    return [
        Load(_Share(load.specs, bounds[w], bounds[w + 1], c), bounds[w + 1] - bounds[w], load.duration_s)
        for w in range(workers)
    ]


def _worker(load: Load, prompts: PromptMaker, opts: ClientOptions, conn, progress) -> None:
    """A worker process: connect, say ready, wait for the start time, run, send the records back."""

    async def main() -> list[RequestRecord]:
        client = opts.client()
        try:
            conn.send("ready")
            t0 = await asyncio.to_thread(conn.recv)
            pending = [0]
            last = [time.monotonic()]

            def on_done(n: int) -> None:  # batched: a queue put per request would cost more than it tells
                pending[0] += n
                if time.monotonic() - last[0] > 0.2:
                    progress.put(pending[0])
                    pending[0], last[0] = 0, time.monotonic()

            gc.collect()
            gc.freeze()  # long-lived objects out of the collector's way: fewer pauses while timing
            recs = await run_load(load, prompts, opts, t0, on_done, client)
            if pending[0]:
                progress.put(pending[0])
            return recs
        finally:
            await client.close()

    try:
        conn.send(("ok", asyncio.run(main())))
    except BaseException as e:  # reported to the parent, which raises it
        conn.send(("error", repr(e)))


def run_workers(
    load: Load, prompts: PromptMaker, opts: ClientOptions, workers: int, on_done: Callable[[int], None] | None = None
) -> list[RequestRecord]:
    """Run `load` split over `workers` processes (1: in this process). Raises RuntimeError if a worker fails."""
    if workers <= 1:

        async def main() -> list[RequestRecord]:
            client = opts.client()
            try:
                gc.collect()
                return await run_load(load, prompts, opts, time.monotonic() + 0.05, on_done, client)
            finally:
                await client.close()

        return asyncio.run(main())
    ctx = mp.get_context("spawn")  # no fork of a process that holds gRPC threads
    progress = ctx.Queue()
    shares = split(load, workers)
    pipes = [ctx.Pipe() for _ in shares]
    procs = [
        ctx.Process(target=_worker, args=(share, prompts, opts, child, progress), daemon=True)
        for share, (_, child) in zip(shares, pipes)
    ]
    done = threading.Event()

    def pump() -> None:  # progress from the workers, until they have all exited and the queue is empty
        while True:
            try:
                n = progress.get(timeout=0.1)
            except queue.Empty:
                if done.is_set():
                    return
                continue
            if on_done is not None:
                on_done(n)

    pumper = threading.Thread(target=pump, daemon=True)
    try:
        for p in procs:
            p.start()
        for (parent, _), p in zip(pipes, procs):
            _expect(parent, p, READY_TIMEOUT_S, "ready")
        t0 = time.monotonic() + START_MARGIN_S
        for parent, _ in pipes:
            parent.send(t0)
        pumper.start()
        records = list(
            itertools.chain.from_iterable(_expect(parent, p, None, "records") for (parent, _), p in zip(pipes, procs))
        )
        for p in procs:  # they exit on their own once the records are sent (flushing their progress first)
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        done.set()
        if pumper.is_alive():
            pumper.join(5)
    records.sort(key=lambda r: r.index)
    return records


def _expect(conn, proc, timeout: float | None, what: str):
    """The worker's next message: "ready", or ("ok", records); a dead worker or ("error", ...) raises."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"bench worker {proc.name} exited (code {proc.exitcode}) before sending its {what}")
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"bench worker {proc.name} not {what} after {timeout:.0f} s")
    msg = conn.recv()
    if what == "ready":
        return msg
    kind, payload = msg
    if kind != "ok":
        raise RuntimeError(f"bench worker {proc.name} failed: {payload}")
    return payload
