"""Served figures on GPUs (issue 11): router + prefill + decode as real processes with the SDK as the client, beside
the in-process engine's figures from the same run.

    python bench/gpu_serving.py [--layers 32] [--workdir DIR] [--json docs/bench/gpu_serving.json] [--part all]

8B Llama-shaped random bf16 checkpoint, int8 KV, FA3, chunk 2048. Prefill on cuda:0, decode on cuda:1 when two GPUs
are visible, else both on cuda:0 (each with its own memory share). Every prompt is fresh random tokens (no cache
flattery) except where a cached prefix is the point. Prints a table; writes the issue's JSON keys (+ details).
Parts (`--part`, comma-separated; `all` = every part): engine, raw, grpc, shm (grpc-shm: both ends' shipper
processes) and ipc (served 2k TTFT with that transport forced, the second token's time (`served_t2t_ms_2k_<part>`:
the first leaves ahead of the KV pages, the second waits for them), KV GB/s, and where the TTFT goes, span by span:
`ttft_breakdown_2k_<part>`), load (ITL, 32 concurrent, local cache tier), choices (n = 4 against four separate
requests of each prompt: `n4_out_tok_s` / `n1x4_out_tok_s`, and the KV bytes shipped per prompt), cache (Redis
tier), loop (`bench/kv_loopback.py` on cuda:0: the KV stream against a raw stream of the same bytes on loopback
without the services, alone and beside a GIL-holding thread per process, and grpc-shm beside it: `kv_loop_ratio*`).
The JSON is merged after every part, so parts may run in separate calls. The per-step costs of the KV paths are
in docs/kv_transfer.md; goodput under load is bench/goodput.py.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch
from benchutil import Table, log, merge_json, pdserve_bench, provenance, token_times_ms, ttft_ms

import pdserve
from pdserve.cli.launch import Stack, start_stack
from pdserve.server.grpc_util import channel
from pdserve.server.security import ChannelSecurity
from pdserve.v1 import internal_pb2, internal_pb2_grpc

VOCAB = 128256


def fresh(n: int, rng: torch.Generator, vocab: int = VOCAB) -> list[int]:
    return torch.randint(5, vocab, (n,), generator=rng).tolist()


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
    return {"raw_grpc_gbps": statistics.median(rates), "raw_grpc_msg_mb": msg_mb}


# ---- a served stack -------------------------------------------------------------------------------------
def start(model: Path, workdir: Path, transport: str, env: dict[str, str], mps: str = "auto") -> Stack:
    """Prefill on cuda:0, decode on cuda:1 (or both on cuda:0, each with a share of its memory; without CUDA on
    this host's CPU, a smoke run); `env`: the prompt cache's ($REDIS_URL, PDSERVE_PREFILL_* options) and the span
    exporter's settings. `mps`: `pdserve up --mps`, its default auto (MPS where prefill and decode share a GPU), so
    that a one-GPU figure is of the stack a user starts, not of two time-sliced processes."""
    gpus = [0, 1] if torch.cuda.device_count() >= 2 else [0] if torch.cuda.is_available() else []
    extra = ["--kv-transport", transport, "--max-num-seqs", "64"] + ([] if gpus else ["--torch-threads", "1"])
    return start_stack(model, workdir, gpus=gpus, extra=extra, env=env, timeout=600, mps=mps)


def kv_counters(stack: Stack, side: str = "prefill") -> dict[str, tuple[int, float, int]]:
    """Per transport: (page bytes, transfer seconds, fallbacks) as one end measured them. Prefill: from a chunk's
    send (device -> host or staging copy) to decode's ack of its last batch; decode: from a batch's arrival to its
    bytes checked in decode's memory."""
    addr, stub = (stack.prefill[0], internal_pb2_grpc.PrefillStub) if side == "prefill" else (
        stack.decode[0], internal_pb2_grpc.DecodeStub)  # fmt: skip
    with channel(addr, ChannelSecurity(token=stack.internal_token)) as ch:
        s = stub(ch).Stats(internal_pb2.StatsRequest(), timeout=10)
    return {t.transport: (t.bytes, t.transfer_seconds, t.fallbacks) for t in s.kv_transports}


def kv_gbps(before: dict, after: dict, transport: str) -> float:
    b0, s0, _ = before.get(transport, (0, 0.0, 0))
    b1, s1, _ = after.get(transport, (0, 0.0, 0))
    return (b1 - b0) / max(s1 - s0, 1e-9) / 1e9 if b1 > b0 else float("nan")


def served_ttft(stack: Stack, transport: str, rng: torch.Generator, reps: int = 7, gap_s: float = 0.0) -> dict:
    """One fresh 2k prompt at a time, `reps` times: first and second token times and the KV GB/s both ends
    measured. `gap_s`: a pause before each (0: back to back, each prompt's write-back still running beside the
    next)."""
    with pdserve.Client(stack.router, timeout=120) as c:
        ttft_ms(c, fresh(2048, rng))  # warm-up (and the transport's first handshake)
        before, before_r = kv_counters(stack), kv_counters(stack, "decode")
        both = []  # first and second token
        for _ in range(reps):
            time.sleep(gap_s)
            both.append(token_times_ms(c, fresh(2048, rng))[0])
        time.sleep(0.5)  # the last request's acks reach prefill after its first token
        after, after_r = kv_counters(stack), kv_counters(stack, "decode")
    key = {"cuda-ipc": "ipc", "grpc-shm": "shm"}.get(transport, "grpc")
    times = [t[0] for t in both]
    return {
        f"served_ttft_ms_2k_{key}": statistics.median(times),
        # the first token leaves ahead of the KV pages (decode --first-token-early): the second one waits for them
        f"served_t2t_ms_2k_{key}": statistics.median([t[1] for t in both]),
        f"served_t2t_ms_2k_{key}_all": [t[1] for t in both],
        f"kv_gbps_{key}": kv_gbps(before, after, transport),
        f"kv_gbps_{key}_receiver": kv_gbps(before_r, after_r, transport),
        f"served_ttft_ms_2k_{key}_all": times,
        f"kv_counters_{key}": {t: list(v) for t, v in after.items()},
    }


def decode_figures(stack: Stack, model: Path, workdir: Path) -> dict:
    """ITL at batch 1 (pdserve bench, one stream at a time: 3 fresh prompts -> 128 tokens) at context 512 and 8k."""
    itl = lambda n: pdserve_bench(stack.router, workdir / f"itl{n}.json", "--tokenizer", str(model), "--concurrency",
                                  "1", "--num-requests", "3", "--warmup", "1", "--input-dist", f"fixed:{n}",
                                  "--output-dist", "fixed:128")["runs"][0]["summary"]["itl_ms"]["p50"]  # fmt: skip
    return {"itl_ms_b1_ctx512": itl(512), "itl_ms_b1_ctx8k": itl(8192)}


def throughput_c32(stack: Stack, model: Path, workdir: Path, n: int = 64, conc: int = 32) -> dict:
    """`n` fresh 2048-token prompts -> 128 tokens, `conc` streams at once (pdserve bench, closed loop), retrying
    the router's pushback as the SDK does: output tokens/s, rejections that still reached a caller, callers' TTFT."""
    run = pdserve_bench(stack.router, workdir / "c32.json", "--tokenizer", str(model), "--concurrency", str(conc),
                        "--num-requests", str(n), "--input-dist", "fixed:2048", "--output-dist", "fixed:128",
                        "--retry", "--warmup", "0")["runs"][0]["summary"]  # fmt: skip
    errors = dict(run["errors"])
    return {
        "out_tok_s_c32": run["output_tokens_per_s"],
        "rejected_c32": errors.pop("RESOURCE_EXHAUSTED", 0),
        "errors_c32": errors,
        "ttft_ms_c32_p50": run["ttft_ms"]["p50"],
        "ttft_ms_c32_p90": run["ttft_ms"]["p90"],
    }


def choices_figures(
    stack: Stack, rng: torch.Generator, prompts: int = 8, prompt_len: int = 2048, out: int = 128, vocab: int = VOCAB
) -> dict:
    """`prompts` fresh prompts at once, each asked for 4 completions of `out` tokens: as one request with n = 4 (the
    prompt prefilled and shipped once, decode forks), then (other fresh prompts) as four separate requests each.
    Output tokens per second of wall time over each batch, and the KV bytes prefill shipped per prompt."""
    from concurrent.futures import ThreadPoolExecutor

    kw = dict(max_tokens=out, temperature=1.0, ignore_eos=True)
    with pdserve.Client(stack.router, timeout=300) as c, ThreadPoolExecutor(4 * prompts) as ex:
        c.generate(token_ids=fresh(prompt_len, rng, vocab), n=4, **kw)  # warm-up: the fork path's first shapes
        c.generate(token_ids=fresh(prompt_len, rng, vocab), **kw)

        def run(n: int, batch: list[list[int]]) -> tuple[float, float]:
            before = sum(b for b, _, _ in kv_counters(stack).values())
            t0 = time.perf_counter()
            tokens = sum(ex.map(lambda p: c.generate(token_ids=p, n=n, **kw).usage.completion_tokens, batch))
            rate = tokens / (time.perf_counter() - t0)
            time.sleep(0.5)  # the last acks
            shipped = (sum(b for b, _, _ in kv_counters(stack).values()) - before) / prompts
            return rate, shipped

        n4, n4_bytes = run(4, [fresh(prompt_len, rng, vocab) for _ in range(prompts)])
        batch = [fresh(prompt_len, rng, vocab) for _ in range(prompts)]
        n1x4, n1x4_bytes = run(1, [p for p in batch for _ in range(4)])
    return {
        "n4_out_tok_s": n4,
        "n1x4_out_tok_s": n1x4,
        "n4_speedup": n4 / n1x4,
        "n4_kv_bytes_per_prompt": n4_bytes,
        "n1x4_kv_bytes_per_prompt": n1x4_bytes,
        "choices_shape": f"{prompts} prompts x {prompt_len} -> 4 x {out}",
    }


REDIS_ONLY = {"PDSERVE_PREFILL_CACHE_LOCAL_MB": "0", "PDSERVE_PREFILL_PREFIX_REUSE": "false"}  # prefill's env


def cache_figures(stack: Stack, rng: torch.Generator, tag: str, reps: int = 5) -> dict:
    """4096-token prompts: cold (fresh) and 90% cached (a 3680-token prefix sent once before, then fresh tails)."""
    cold, warm, cached = [], [], []
    with pdserve.Client(stack.router, timeout=120) as c:
        ttft_ms(c, fresh(4096, rng))  # warm-up
        for _ in range(reps):
            cold.append(ttft_ms(c, fresh(4096, rng)))
            prefix = fresh(3680, rng)
            ttft_ms(c, prefix + fresh(416, rng))  # writes the prefix's pages to the cache
            time.sleep(1.0)  # the write-back runs behind the engine
            times, hit = token_times_ms(c, prefix + fresh(416, rng))
            warm.append(times[0])
            cached.append(hit)
    return {
        f"served_ttft_ms_4k_cold_{tag}": statistics.median(cold),
        f"served_ttft_ms_4k_90pct_{tag}": statistics.median(warm),
        f"served_ttft_ms_4k_cold_{tag}_all": cold,
        f"served_ttft_ms_4k_90pct_{tag}_all": warm,
        f"cached_tokens_4k_90pct_{tag}_all": cached,  # prompt tokens the cache served (usage), per warm request
    }


def redis_repeat_figures(stack: Stack, rng: torch.Generator, hits: int = 6) -> dict:
    """4096-token prompts on a stack whose prefix hits come from Redis only: cold medians, then one 3680-token prefix
    written once and hit `hits` times with fresh tails (the first hit, then the median of the later ones: a fetch
    policy must keep using Redis, issue 32 item 5)."""
    with pdserve.Client(stack.router, timeout=120) as c:
        ttft_ms(c, fresh(4096, rng))  # warm-up
        cold = [ttft_ms(c, fresh(4096, rng)) for _ in range(5)]
        prefix = fresh(3680, rng)
        ttft_ms(c, prefix + fresh(416, rng))  # writes the prefix's pages to Redis
        time.sleep(1.5)  # the write-back runs behind the engine
        runs = [token_times_ms(c, prefix + fresh(416, rng)) for _ in range(hits)]
    later = [t[0] for t, _ in runs[1:]]
    return {
        "ttft_ms_4k_cold": statistics.median(cold),
        "ttft_ms_4k_redis_first": runs[0][0][0],
        "ttft_ms_4k_redis_p50": statistics.median(later),
        "ttft_ms_4k_cold_all": cold,
        "ttft_ms_4k_redis_all": [t[0] for t, _ in runs],
        "cached_tokens_4k_redis_all": [n for _, n in runs],
    }


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


def ttft_breakdown(stack: Stack, sink, rng: torch.Generator, key: str, reps: int = 5) -> dict:
    """Where a 2048-token request's time to first token goes, from the services' own spans: per span, the median
    start offset from the router's span and the median duration."""
    from pdserve.testing.span_breakdown import as_json, breakdown, format_breakdown

    sink.clear()
    with pdserve.Client(stack.router, timeout=120) as c:
        for _ in range(reps):
            ttft_ms(c, fresh(2048, rng))
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
    ap.add_argument("--raw-server", default="", help=argparse.SUPPRESS)  # the raw gRPC server's child process
    ap.add_argument("--raw-msg-mb", type=int, default=4)
    args = ap.parse_args()
    if args.raw_server:
        return raw_server(args.raw_server, args.raw_msg_mb)
    parts = (
        {"engine", "raw", "loop", "grpc", "shm", "ipc", "load", "cache", "choices"}
        if args.part == "all"
        else set(args.part.split(","))
    )
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / f"llama8b-{args.layers}l"
    if not (model / "model.safetensors.index.json").exists():
        from pdserve.models.random_llama import write_random_llama

        write_random_llama(model, args.layers, device="cuda:0")
    device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    table = Table()
    rng = torch.Generator().manual_seed(int(time.time()))
    save = lambda keys: merge_json(args.json, {**keys, **provenance(args.commit, device), "layers": args.layers})

    if "engine" in parts:
        save(got := engine_ttft(model))
        table.row("engine TTFT 2k (in-process)", f"{got['engine_ttft_ms_2k']:.1f} ms")
    if "raw" in parts:
        save(got := raw_grpc(workdir))
        table.row("raw gRPC stream", f"{got['raw_grpc_gbps']:.2f} GB/s", f"{got['raw_grpc_msg_mb']} MiB messages")
    if "loop" in parts:
        from kv_loopback import figures

        load, shm = ["--engine-load"], ["--kv-transport", "grpc-shm", "--engine-load"]
        for sfx, extra in (("", []), ("_engine_load", load), ("_shm_engine_load", shm)):
            save(got := figures(workdir, ["--device", "cuda:0", "--raw-channels", "2", *extra]))
            kv, raw = got[f"loop_kv_gbps{sfx}"], got[f"loop_raw_grpc_gbps{sfx}"]
            table.row(f"KV / raw stream, loopback{sfx.replace('_', ' ')}", f"{kv:.2f} / {raw:.2f} GB/s",
                      f"ratio {got[f'kv_loop_ratio{sfx}']:.2f}")  # fmt: skip
    from pdserve.testing.redis_server import RedisServer

    redis = RedisServer(workdir / "redis").start() if parts & {"grpc", "shm", "ipc", "load", "cache"} else None
    cache_env = {"REDIS_URL": redis.url} if redis else {}
    sink = SinkProcess().start()  # the services' spans, received off this process
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    try:  # the services' exporter (the device image's OTel wheels may lack a part of it)
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
    except ImportError as e:
        log(f"no TTFT breakdown: the OTLP exporter does not import here ({e})")
        env = {}
    try:
        for part, transport in (("grpc", "grpc"), ("shm", "grpc-shm"), ("ipc", "cuda-ipc")):
            if part not in parts:
                continue
            # each transport forced; the prompt cache on (Redis) as served, its lookups miss (fresh prompts)
            stack = start(model, workdir / part, transport, {**cache_env, **env})
            try:
                save(got := served_ttft(stack, transport, rng))
                if env:
                    save(ttft_breakdown(stack, sink, rng, key=f"ttft_breakdown_2k_{part}"))
            finally:
                stack.stop()
            t1, t2, gbps = (got[f"{k}_{part}"] for k in ("served_ttft_ms_2k", "served_t2t_ms_2k", "kv_gbps"))
            table.row(f"served TTFT 2k, {transport}", f"{t1:.1f} ms", f"second token {t2:.1f} ms, kv {gbps:.2f} GB/s")
        if "load" in parts:
            stack = start(model, workdir / "load", "auto", cache_env)
            try:
                save(got := decode_figures(stack, model, workdir))
                table.row("ITL b1 ctx512 / 8k", f"{got['itl_ms_b1_ctx512']:.2f} / {got['itl_ms_b1_ctx8k']:.2f} ms")
                save(got := throughput_c32(stack, model, workdir))
                p50, p90 = got["ttft_ms_c32_p50"], got["ttft_ms_c32_p90"]
                table.row("64 x 2048->128, 32 concurrent", f"{got['out_tok_s_c32']:.0f} tok/s",
                          f"{got['rejected_c32']} rejected, TTFT p50 / p90 {p50:.0f} / {p90:.0f} ms")  # fmt: skip
                got = cache_figures(stack, rng, "local")
                got["served_ttft_ms_4k_cold"] = got.pop("served_ttft_ms_4k_cold_local")
                save(got)
                table.row("TTFT 4k cold / 90% local", f"{got['served_ttft_ms_4k_cold']:.0f} / "
                          f"{got['served_ttft_ms_4k_90pct_local']:.0f} ms")  # fmt: skip
            finally:
                stack.stop()
        if "choices" in parts:
            stack = start(model, workdir / "choices", "auto", {})
            try:
                save(got := choices_figures(stack, rng))
            finally:
                stack.stop()
            table.row("n=4 / 4 x n=1, output", f"{got['n4_out_tok_s']:.0f} / {got['n1x4_out_tok_s']:.0f} tok/s",
                      f"x{got['n4_speedup']:.2f}; KV bytes per prompt {got['n4_kv_bytes_per_prompt']:.0f} / "
                      f"{got['n1x4_kv_bytes_per_prompt']:.0f}")  # fmt: skip
        if "cache" in parts and redis is not None:
            # no local tier and no pool prefixes: the prefix is where another instance's write left it, in Redis
            stack = start(model, workdir / "redis-only", "auto", {**cache_env, **REDIS_ONLY})
            try:
                save(got := cache_figures(stack, rng, "redis"))
                save(rep := redis_repeat_figures(stack, rng))
            finally:
                stack.stop()
            table.row("TTFT 4k cold / Redis first / later p50", f"{rep['ttft_ms_4k_cold']:.0f} / "
                      f"{rep['ttft_ms_4k_redis_first']:.0f} / {rep['ttft_ms_4k_redis_p50']:.0f} ms",
                      f"cached {rep['cached_tokens_4k_redis_all']}")  # fmt: skip
            table.row("TTFT 4k cold / 90% in Redis only", f"{got['served_ttft_ms_4k_cold_redis']:.0f} / "
                      f"{got['served_ttft_ms_4k_90pct_redis']:.0f} ms")  # fmt: skip
    finally:
        sink.stop()
        if redis is not None:
            redis.stop()
    table.print()


if __name__ == "__main__":
    main()
