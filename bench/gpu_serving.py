"""Served figures on GPUs (issue 11): router + prefill + decode as real processes with the SDK as the client, beside
the in-process engine's figures from the same run.

    python bench/gpu_serving.py [--layers 32] [--workdir DIR] [--json docs/bench/gpu_serving.json] [--part all]

8B Llama-shaped random bf16 checkpoint, int8 KV, FA3, chunk 2048. Prefill on cuda:0, decode on cuda:1 when two GPUs
are visible, else both on cuda:0 (each with its own memory share). Every prompt is fresh random tokens (no cache
flattery) except where a cached prefix is the point. Prints a table; writes the issue's JSON keys (+ details).
Parts (`--part`, comma-separated; `all` = every part): engine, raw, grpc and ipc (served 2k TTFT with that transport
forced, the second token's time (`served_t2t_ms_2k_<part>`: the first leaves ahead of the KV pages, the second waits
for them), KV GB/s, and where the TTFT goes, span by span: `ttft_breakdown_2k_<part>`), load (ITL, 32 concurrent, local
cache tier), cache (Redis tier), local (not in `all`: the local-tier rows again on a traced stack, with where a cold
and a 90%-cached 4k request's time goes: `ttft_breakdown_4k_{cold,hit}_local`).
The JSON is merged, so parts may run in separate calls.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from benchutil import log, print_rows, row, token_times_ms, ttft_ms

import pdserve
from pdserve.cli.launch import Stack, start_service, wait_ready
from pdserve.server.auth import new_token
from pdserve.server.grpc_util import channel
from pdserve.server.security import ChannelSecurity
from pdserve.testing.provenance import git_commit
from pdserve.v1 import internal_pb2, internal_pb2_grpc

VOCAB = 128256


def fresh(n: int, rng: torch.Generator) -> list[int]:
    return torch.randint(5, VOCAB, (n,), generator=rng).tolist()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---- the in-process engine ------------------------------------------------------------------------------
def engine_ttft(model: Path, reps: int = 5) -> dict:
    """In-process engine on cuda:0, same settings as the served prefill: add_request → first token, median."""
    from gpu_engine import time_prefill

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    cfg = EngineConfig(
        model_dir=str(model), dtype="bfloat16", device="cuda:0", page_size=16, chunk_size=2048, kv_dtype="int8",
        attention_backend="fa3", num_pages=4096, max_num_seqs=8,
    )  # fmt: skip
    e = LLMEngine(cfg)
    rng = torch.Generator().manual_seed(1)
    ttft = time_prefill(e, lambda: fresh(2048, rng), reps)  # a fresh prompt per run
    del e
    torch.cuda.empty_cache()
    return {"engine_ttft_ms_2k": ttft}


# ---- raw gRPC ceiling -----------------------------------------------------------------------------------
RAW_METHOD = "/bench.Raw/Pull"


def raw_server(port_file: str, msg_mb: int) -> None:
    """Child process: a server streaming `n` messages of msg_mb MiB of bytes per call (request: n as text)."""
    payload = bytes(msg_mb << 20)

    def pull(request: bytes, context):
        for _ in range(int(request.decode())):
            yield payload

    handler = grpc.method_handlers_generic_handler("bench.Raw", {"Pull": grpc.unary_stream_rpc_method_handler(pull)})
    from concurrent import futures

    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    server = grpc.server(futures.ThreadPoolExecutor(8), options=opts)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def raw_grpc(workdir: Path, msg_mb: int = 4, total_mb: int = 4096) -> dict:
    port_file = workdir / "raw.port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, "--raw-server", str(port_file), "--raw-msg-mb", str(msg_mb)])
    try:
        while not port_file.exists():
            time.sleep(0.05)
        opts = [("grpc.max_receive_message_length", 64 << 20)]
        with grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}", options=opts) as ch:
            pull = ch.unary_stream(RAW_METHOD)
            n = total_mb // msg_mb
            rates = []
            for _ in range(3):
                t0, got = time.perf_counter(), 0
                for m in pull(str(n).encode()):
                    got += len(m)
                rates.append(got / (time.perf_counter() - t0) / 1e9)
    finally:
        proc.kill()
    return {"raw_grpc_gbps": median(rates), "raw_grpc_msg_mb": msg_mb}


# ---- a served stack -------------------------------------------------------------------------------------
def start(
    model: Path, workdir: Path, transport: str, redis_url: str, extra: Sequence[str] = (), env: dict | None = None
) -> Stack:
    """prefill on cuda:0, decode on cuda:1 (or cuda:0 when one GPU: each takes a share of its memory)."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**(env or {}), "PDSERVE_INTERNAL_TOKEN": new_token()}  # internal ports refuse callers without it
    two = torch.cuda.device_count() >= 2
    share = "0.85" if two else "0.40"
    common = [
        "--model", str(model), "--page-size", "16", "--chunk-size", "2048", "--kv-dtype", "int8",
        "--kv-transport", transport, "--gpu-memory-utilization", share, "--max-num-seqs", "64",
    ]  # fmt: skip
    cache = [*(["--redis-url", redis_url] if redis_url else []), *extra]  # prefill's prompt cache
    started = [
        start_service("prefill", [*common, *cache, "--device", "cuda:0"], workdir, env=env),
        start_service("decode", [*common, "--device", "cuda:1" if two else "cuda:0"], workdir, env=env),
    ]
    procs, logs = [s[0] for s in started], [s[2] for s in started]
    try:
        pre, dec = (wait_ready(*s, timeout=600) for s in started)
        r = start_service("router", ["--model", str(model), "--prefill", pre, "--decode", dec], workdir, env=env)
        procs.append(r[0])
        logs.append(r[2])
        router = wait_ready(*r, timeout=120)
    except BaseException:
        Stack("", [], [], procs, logs).stop()
        raise
    return Stack(router, [pre], [dec], procs, logs, internal_token=env["PDSERVE_INTERNAL_TOKEN"])


def stats(stack: Stack, addr: str, stub_cls) -> internal_pb2.InstanceStats:
    with channel(addr, ChannelSecurity(token=stack.internal_token)) as ch:
        return stub_cls(ch).Stats(internal_pb2.StatsRequest(), timeout=10)


def kv_counters(stack: Stack, side: str = "prefill") -> dict[str, tuple[int, float, int]]:
    """Per transport: (page bytes, transfer seconds, fallbacks) as one end measured them. Prefill: from a chunk's
    send (device -> host or staging copy) to decode's ack of its last batch; decode: from a batch's arrival to its
    bytes checked in decode's memory."""
    addr, stub = (stack.prefill[0], internal_pb2_grpc.PrefillStub) if side == "prefill" else (
        stack.decode[0], internal_pb2_grpc.DecodeStub)  # fmt: skip
    s = stats(stack, addr, stub)
    return {t.transport: (t.bytes, t.transfer_seconds, t.fallbacks) for t in s.kv_transports}


def kv_gbps(before: dict, after: dict, transport: str) -> float:
    b0, s0, _ = before.get(transport, (0, 0.0, 0))
    b1, s1, _ = after.get(transport, (0, 0.0, 0))
    return (b1 - b0) / max(s1 - s0, 1e-9) / 1e9 if b1 > b0 else float("nan")


def itl(c: pdserve.Client, ids: list[int], n: int = 128) -> float:
    """Median gap per token between chunks after the first, batch 1."""
    stamps: list[tuple[float, int]] = []
    for ch in c.stream(token_ids=ids, max_tokens=n, temperature=0, ignore_eos=True):
        if ch.token_ids:
            stamps.append((time.perf_counter(), len(ch.token_ids)))
    gaps = [(t1 - t0) * 1e3 / k for (t0, _), (t1, k) in zip(stamps[1:], stamps[2:])]
    return median(gaps)


def served_ttft(stack: Stack, transport: str, rng: torch.Generator, reps: int = 7) -> dict:
    with pdserve.Client(stack.router, timeout=120) as c:
        ttft_ms(c, fresh(2048, rng))  # warm-up (and the transport's first handshake)
        before, before_r = kv_counters(stack), kv_counters(stack, "decode")
        both = [token_times_ms(c, fresh(2048, rng)) for _ in range(reps)]  # first and second token
        time.sleep(0.5)  # the last request's acks reach prefill after its first token
        after, after_r = kv_counters(stack), kv_counters(stack, "decode")
    key = "ipc" if transport == "cuda-ipc" else "grpc"
    times = [t[0] for t in both]
    return {
        f"served_ttft_ms_2k_{key}": median(times),
        # the first token leaves ahead of the KV pages (decode --first-token-early): the second one waits for them
        f"served_t2t_ms_2k_{key}": median([t[1] for t in both]),
        f"served_t2t_ms_2k_{key}_all": [t[1] for t in both],
        f"kv_gbps_{key}": kv_gbps(before, after, transport),
        f"kv_gbps_{key}_receiver": kv_gbps(before_r, after_r, transport),
        f"served_ttft_ms_2k_{key}_all": times,
        f"kv_counters_{key}": {t: list(v) for t, v in after.items()},
    }


def decode_figures(stack: Stack, rng: torch.Generator) -> dict:
    with pdserve.Client(stack.router, timeout=300) as c:
        itl(c, fresh(512, rng), 16)  # warm-up
        i512 = median([itl(c, fresh(512, rng)) for _ in range(3)])
        i8k = median([itl(c, fresh(8192, rng)) for _ in range(3)])
    return {"itl_ms_b1_ctx512": i512, "itl_ms_b1_ctx8k": i8k}


def throughput_c32(stack: Stack, rng: torch.Generator, n: int = 64, conc: int = 32) -> dict:
    prompts = [fresh(2048, rng) for _ in range(n)]
    rejected = 0
    other_errors: list[str] = []
    lock = threading.Lock()

    ttfts: list[float] = []  # ms, per completed request: what the callers waited (queueing included)

    def one(ids: list[int]) -> int:
        nonlocal rejected
        try:
            got, t0, first = 0, time.perf_counter(), None
            with pdserve.Client(stack.router, timeout=600) as c:
                for ch in c.stream(token_ids=ids, max_tokens=128, temperature=0, ignore_eos=True):
                    if ch.token_ids and first is None:
                        first = (time.perf_counter() - t0) * 1e3
                    got += len(ch.token_ids)
            if first is not None:
                with lock:
                    ttfts.append(first)
            return got
        except grpc.RpcError as e:
            with lock:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    rejected += 1
                else:
                    other_errors.append(f"{e.code().name}: {e.details()}")
            return 0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        tokens = sum(ex.map(one, prompts))
    wall = time.perf_counter() - t0
    ttfts.sort()
    pct = (lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]) if ttfts else (lambda q: float("nan"))
    return {
        "out_tok_s_c32": tokens / wall,
        "rejected_c32": rejected,
        "errors_c32": other_errors,
        "ttft_ms_c32_p50": pct(0.5),
        "ttft_ms_c32_p90": pct(0.9),
    }


def cache_figures(stack: Stack, rng: torch.Generator, tag: str, reps: int = 5, sink=None) -> dict:
    """4096-token prompts: cold (fresh) and 90% cached (a 3680-token prefix sent once before, then fresh tails).
    With `sink` (the services export spans to it): where the cold and the cached requests' time goes."""
    cold, warm, cached = [], [], []
    spans: dict[str, list] = {"cold": [], "hit": []}

    def traced(kind: str, fn):
        if sink is not None:
            sink.clear()
        out = fn()
        if sink is not None:
            time.sleep(0.6)  # the batch span processors export every 200 ms
            spans[kind] += sink.spans()
        return out

    with pdserve.Client(stack.router, timeout=120) as c:
        ttft_ms(c, fresh(4096, rng))  # warm-up
        for _ in range(reps):
            cold.append(traced("cold", lambda: ttft_ms(c, fresh(4096, rng))))
            prefix = fresh(3680, rng)
            ttft_ms(c, prefix + fresh(416, rng))  # writes the prefix's pages to the cache
            time.sleep(1.0)  # the write-back is asynchronous (Redis tier)
            ms, hit = traced("hit", lambda: ttft_and_cached(c, prefix + fresh(416, rng)))
            warm.append(ms)
            cached.append(hit)
    breakdowns = {}
    if sink is not None:
        from pdserve.testing.span_breakdown import as_json, breakdown, format_breakdown

        for kind, got in spans.items():
            table = breakdown(got)
            print(f"\nttft_breakdown_4k_{kind}_{tag}: where a 4096-token request's time goes (median ms)")
            print(format_breakdown(table))
            breakdowns[f"ttft_breakdown_4k_{kind}_{tag}"] = as_json(table)
    return {
        **breakdowns,
        f"served_ttft_ms_4k_cold_{tag}": median(cold),
        f"served_ttft_ms_4k_90pct_{tag}": median(warm),
        f"served_ttft_ms_4k_cold_{tag}_all": cold,
        f"served_ttft_ms_4k_90pct_{tag}_all": warm,
        f"cached_tokens_4k_90pct_{tag}_all": cached,  # prompt tokens the cache served (usage), per warm request
    }


def ttft_and_cached(c: pdserve.Client, ids: list[int]) -> tuple[float, int]:
    """(ms to the first token, the prompt tokens the cache served) of a greedy two-token stream."""
    t0 = time.perf_counter()
    first, cached = None, -1
    for ch in c.stream(token_ids=ids, max_tokens=2, temperature=0, ignore_eos=True):
        if ch.token_ids and first is None:
            first = (time.perf_counter() - t0) * 1e3
        if ch.usage is not None:
            cached = ch.usage.cached_tokens
    if first is None:
        raise RuntimeError("stream ended without a token")
    return first, cached


def _sink_main(conn) -> None:
    """Child process: an OTLP receiver answering the parent's "spans" / "clear" / "stop" over a pipe."""
    from pdserve.testing.otlp_sink import OTLPSink

    sink = OTLPSink().start()
    conn.send(sink.endpoint)
    while True:
        cmd = conn.recv()
        if cmd == "spans":
            conn.send(sink.spans())
        elif cmd == "clear":
            sink.clear()
            conn.send(None)
        else:
            sink.stop()
            conn.send(None)
            return


class SinkProcess:
    """The OTLP receiver in its own process: decoding the services' span exports in this one would compete for the
    GIL with the client whose TTFT is being measured."""

    def start(self) -> SinkProcess:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_sink_main, args=(child,), daemon=True)
        self._proc.start()
        self.endpoint: str = self._conn.recv()
        return self

    def _ask(self, cmd: str):
        self._conn.send(cmd)
        return self._conn.recv()

    def spans(self) -> list:
        return self._ask("spans")

    def clear(self) -> None:
        self._ask("clear")

    def stop(self) -> None:
        self._ask("stop")
        self._proc.join(10)


def start_profilers(stack: Stack, out_dir: str, key: str, seconds: float) -> list[subprocess.Popen]:
    """py-spy (sampling, non-blocking: the services keep their timing) on prefill, decode and router for `seconds`;
    collapsed stacks per process in out_dir/<key>_<name>.txt, with GIL holders marked (--gil: only samples of the
    thread holding the GIL, i.e. what serialises the Python threads)."""
    import shutil

    exe = shutil.which("py-spy")
    if exe is None:
        log("no py-spy: no profiles")
        return []
    names = ["prefill", "decode", "router"]
    procs = []
    for name, proc in zip(names, stack.procs):
        for mode in ("all", "gil"):
            out = Path(out_dir) / f"{key}_{name}_{mode}.txt"
            cmd = [exe, "record", "--pid", str(proc.pid), "--duration", str(int(seconds)), "--rate", "250",
                   "--nonblocking", "--format", "raw", "--output", str(out)]  # fmt: skip
            if mode == "gil":
                cmd.append("--gil")
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    time.sleep(1.0)  # py-spy attaches
    return procs


def ttft_breakdown(
    stack: Stack, sink, rng: torch.Generator, key: str, reps: int = 5, profile_dir: str = "", profile_s: float = 8.0
) -> dict:
    """Where a 2048-token request's time to first token goes, from the services' own spans (OTLP to an in-process
    receiver): per span, the median start offset from the router's span and the median duration."""
    from pdserve.testing.span_breakdown import as_json, breakdown, format_breakdown

    sink.clear()
    spies = start_profilers(stack, profile_dir, key, seconds=profile_s) if profile_dir else []
    with pdserve.Client(stack.router, timeout=120) as c:
        t_end = time.monotonic() + (profile_s if spies else 0.0)
        n = 0
        while n < reps or time.monotonic() < t_end:  # while profiling: requests for the whole sampled window
            ttft_ms(c, fresh(2048, rng))
            n += 1
    for p in spies:
        try:
            p.wait(timeout=profile_s + 30)
        except subprocess.TimeoutExpired:
            p.kill()
    time.sleep(2.0)  # the batch span processors export every 200 ms
    table = breakdown(sink.spans())
    print(f"\n{key}: where a 2048-token request's time goes (median; ms from the router span's start)")
    print(format_breakdown(table))
    return {key: as_json(table)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "pdserve-gpu-serving"))
    ap.add_argument("--json", default="docs/bench/gpu_serving.json")
    ap.add_argument("--part", default="all")
    ap.add_argument("--commit", default="", help="commit measured (a device copy of the tree may lack git)")
    ap.add_argument("--profile-dir", default="", help="py-spy profiles of the services during the breakdown")
    ap.add_argument("--prefill-args", default="", help="extra prefill flags, grpc / ipc / load parts")
    ap.add_argument(
        "--service-env", default="", help="extra NAME=VALUE environment of the services, space-separated (all parts)"
    )
    ap.add_argument("--raw-server", default="")
    ap.add_argument("--raw-msg-mb", type=int, default=4)
    args = ap.parse_args()
    if args.raw_server:
        raw_server(args.raw_server, args.raw_msg_mb)
        return
    parts = {"engine", "raw", "grpc", "ipc", "load", "cache"} if args.part == "all" else set(args.part.split(","))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / f"llama8b-{args.layers}l"
    if not (model / "model.safetensors.index.json").exists():
        from pdserve.models.random_llama import write_random_llama

        t0 = time.perf_counter()
        write_random_llama(model, args.layers, device="cuda:0")
        log(f"checkpoint written in {time.perf_counter() - t0:.0f}s")
    out_path = Path(args.json)
    res: dict = json.loads(out_path.read_text()) if out_path.exists() else {}
    res.update(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        commit=git_commit(args.commit),
        device=f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}",
        layers=args.layers,
    )
    rng = torch.Generator().manual_seed(int(time.time()))

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")

    if "engine" in parts:
        res.update(engine_ttft(model))
        row("engine TTFT 2k (in-process)", f"{res['engine_ttft_ms_2k']:.1f} ms")
        save()
    if "raw" in parts:
        res.update(raw_grpc(workdir))
        row("raw gRPC stream", f"{res['raw_grpc_gbps']:.2f} GB/s", f"{res['raw_grpc_msg_mb']} MiB messages")
        save()
    from pdserve.testing.redis_server import RedisServer

    redis = RedisServer(workdir / "redis").start() if parts & {"grpc", "ipc", "load", "cache", "local"} else None
    sink = SinkProcess().start()  # the grpc and ipc stacks' spans (a TTFT breakdown per transport), off this process
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    try:  # the services' exporter (the device image's OTel wheels may lack a part of it)
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
    except ImportError as e:
        log(f"no TTFT breakdown: the OTLP exporter does not import here ({e})")
        env = {}
    traced = bool(env)
    service_env = dict(kv.split("=", 1) for kv in shlex.split(args.service_env))
    if service_env:
        res["service_env"] = service_env
        env = {**env, **service_env}
    try:
        for part, transport in (("grpc", "grpc"), ("ipc", "cuda-ipc")):
            if part not in parts:
                continue
            # each transport forced; the prompt cache on (Redis) as served, its lookups miss (fresh prompts)
            extra = shlex.split(args.prefill_args)
            stack = start(model, workdir / part, transport, redis.url if redis else "", extra, env=env)
            try:
                res.update(served_ttft(stack, transport, rng))
                save()
                if traced:
                    res.update(
                        ttft_breakdown(stack, sink, rng, key=f"ttft_breakdown_2k_{part}", profile_dir=args.profile_dir)
                    )
                    save()
            finally:
                stack.stop()
            t1, t2, gbps = (res[f"{k}_{part}"] for k in ("served_ttft_ms_2k", "served_t2t_ms_2k", "kv_gbps"))
            row(f"served TTFT 2k, {transport}", f"{t1:.1f} ms", f"second token {t2:.1f} ms, kv {gbps:.2f} GB/s")
        if "load" in parts:
            stack = start(
                model, workdir / "load", "auto", redis.url if redis else "", shlex.split(args.prefill_args), service_env
            )
            try:
                res.update(decode_figures(stack, rng))
                row("ITL b1 ctx512 / ctx8k", f"{res['itl_ms_b1_ctx512']:.2f} / {res['itl_ms_b1_ctx8k']:.2f} ms")
                save()
                spies = start_profilers(stack, args.profile_dir, "c32", seconds=8.0) if args.profile_dir else []
                res.update(throughput_c32(stack, rng))
                for p in spies:
                    p.wait(timeout=60)
                row(
                    "64 x 2048→128, 32 concurrent",
                    f"{res['out_tok_s_c32']:.0f} tok/s",
                    f"{res['rejected_c32']} rejected, TTFT p50 / p90 "
                    f"{res['ttft_ms_c32_p50']:.0f} / {res['ttft_ms_c32_p90']:.0f} ms",
                )
                save()
                res.update(cache_figures(stack, rng, "local"))
                res["served_ttft_ms_4k_cold"] = res.pop("served_ttft_ms_4k_cold_local")
                row("TTFT 4k cold / 90% local", f"{res['served_ttft_ms_4k_cold']:.0f} / "
                    f"{res['served_ttft_ms_4k_90pct_local']:.0f} ms")  # fmt: skip
                save()
            finally:
                stack.stop()
        if "local" in parts and traced:  # the local-tier rows again, traced: where a cached request's time goes
            stack = start(model, workdir / "local", "auto", redis.url if redis else "", [], env=env)
            try:
                spies = start_profilers(stack, args.profile_dir, "local", seconds=25.0) if args.profile_dir else []
                local_run = cache_figures(stack, rng, "local", sink=sink)
                for p in spies:
                    p.wait(timeout=60)
                res.update({k: v for k, v in local_run.items() if k.startswith("ttft_breakdown")})
                res["served_ttft_ms_4k_90pct_local_traced_all"] = local_run["served_ttft_ms_4k_90pct_local_all"]
                res["served_ttft_ms_4k_cold_local_traced_all"] = local_run["served_ttft_ms_4k_cold_local_all"]
                save()
            finally:
                stack.stop()
        if "cache" in parts and redis is not None:
            # no local tier and no pool prefixes: the prefix is where another instance's write left it, in Redis
            no_local = ["--cache-local-mb", "0", "--prefix-reuse", "false"]
            stack = start(model, workdir / "redis-only", "auto", redis.url, no_local, service_env)
            try:
                res.update(cache_figures(stack, rng, "redis"))
                save()
            finally:
                stack.stop()
            row("TTFT 4k cold / 90% in Redis only", f"{res['served_ttft_ms_4k_cold_redis']:.0f} / "
                f"{res['served_ttft_ms_4k_90pct_redis']:.0f} ms")  # fmt: skip
            save()
    finally:
        sink.stop()
        if redis is not None:
            redis.stop()
    print_rows()


if __name__ == "__main__":
    main()
