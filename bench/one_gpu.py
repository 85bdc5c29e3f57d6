"""One GPU (issue 32): colocated serving against prefill + decode sharing the GPU, each started by `pdserve up` and
loaded by `pdserve bench`, beside the in-process engine's figures of the same run and the goodput ceiling they imply.

    python bench/one_gpu.py [--part all] [--json docs/bench/one_gpu.json] [--mode-data shared/data/mode_choice.json]
        [--commit SHA] [--rates 2,6,8,10,12] [--num-requests 48] [--coloc-budgets auto,1024,2048,4096]

Workload (`pdserve bench`'s SLO defaults, TTFT <= 350 ms and TPOT <= 15 ms for >= 90%): an 8B Llama-shaped random
bf16 checkpoint (written once into --workdir), int8 KV, fresh 2048-token prompts -> exactly 128 tokens, Poisson
arrivals, --num-requests per rate, arrivals seeded by --seed. Parts (`--part`, comma-separated; `all`: each, in
this order):

- engine: the engine in a child process on cuda:0: TTFT of a 2048-token prompt (`engine_ttft_ms_2k`) and the decode
  step time per batch size at context ~2k (the ceiling's inputs, in details).
- coloc, disagg: `pdserve up --colocated 1` / `pdserve up --disaggregated` on --gpus, each loaded over the rate
  sweep: goodput (`coloc_goodput_rps`, `disagg1_goodput_rps`) and TTFT p50 at 2 req/s; on the disaggregated
  stack first one request at a time (`t2t_ms_2k_ipc`: the second token; its KV transport, cuda-ipc on one GPU).
  --coloc-budgets runs the colocated stack once per step size: `auto` (the default: chosen by the instance from its
  measured step costs, `pdserve.decode.step_budget`; the only run that sets the `coloc_*` keys) or N (`--chunk-size
  N --step-token-budget N+64`: N prefill tokens beside up to 64 decode rows); each run's sweep and the budget the
  instance logged go in details (`coloc` for auto, `coloc_budget_N` for the others).
  --disagg-mps runs the disaggregated stack once per `pdserve up --mps` setting (off, auto, on, on:P with P the
  prefill's SM percent; default auto), each run in details (`disagg1_mps_<setting>`), the keys from the last.
- raw, grpc, cache: bench/gpu_serving.py's parts (stacks on `pdserve up`'s --mps default, auto): the raw gRPC stream
  (`raw_grpc_gbps`); one stack with the KV transport forced to grpc (`t2t_ms_2k_grpc`, `kv_gbps_grpc`) whose prefill
  has no local cache tier and no pool prefixes, so a 90% prefix comes from Redis only (`ttft_ms_4k_cold`; one
  3680-token prefix written once, then hit with fresh tails: `ttft_ms_4k_redis_first`, the first hit, and `_p50`, the
  median of the five after it), and the store's fetch rate as the prefill fetches (`redis_fetch_gbps`:
  bench/prompt_cache.py's `PrefixFetch` of a 4k prompt's 90% in pages, 8 connections, into pinned memory and onto the
  GPU). The cache part runs once per `--redis-shards` entry (1: one redis-server; N: a Redis Cluster of N shards on
  this host, the prefill with `--redis-cluster`; one redis-server delivers ~1.3 GB/s of megabyte values there), the
  keys from the last.

After each part: `goodput_limit_rps` once the engine part is in (`goodput_limit` below; docs/benchmarks.md), and
once both modes are in (this call or an earlier one into the same --json) --mode-data (what `pdserve up` reads to
pick the mode on one GPU; a run with `--gpus none` writes its `cpu` entry) and `default_mode`, the mode
`pdserve up`'s rule then chooses. The JSON is merged after every part, so a run cut short keeps the parts done.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import gpu_serving as gs
import torch
from benchutil import log, merge_json, pdserve_bench, provenance
from goodput import SLO_TPOT_MS, SLO_TTFT_MS, at_rate, goodput_rate

from pdserve.cli.launch import Stack
from pdserve.cli.mode_choice import SCHEMA, choose_mode, load_measurements
from pdserve.server.auth import new_token
from pdserve.testing.up_process import read_banner, stop

PARTS = ("engine", "coloc", "disagg", "raw", "grpc", "cache")  # run in this order: the mode choice's first
MODES = {"coloc": ("--colocated", "1"), "disagg": ("--disaggregated",)}  # `pdserve up` flags of each mode
KEY = {"coloc": "coloc", "disagg": "disagg1"}  # JSON key prefix: disagg1 = prefill + decode on one GPU
BATCHES = (48, 32, 24, 16, 8, 4, 1)  # decode step times measured (the CUDA graph sizes up to 48)
LOW_RATE = 2.0  # req/s: the TTFT p50 reported per mode
KEYS = (  # the JSON's keys (issue 32), beside `details`
    "date", "commit", "device", "engine_ttft_ms_2k", "coloc_goodput_rps", "disagg1_goodput_rps", "default_mode",
    "coloc_ttft_ms_p50_2rps", "disagg1_ttft_ms_p50_2rps", "t2t_ms_2k_grpc", "t2t_ms_2k_ipc", "raw_grpc_gbps",
    "kv_gbps_grpc", "goodput_limit_rps", "ttft_ms_4k_cold", "ttft_ms_4k_redis_first", "ttft_ms_4k_redis_p50",
    "redis_fetch_gbps",
)  # fmt: skip


# ---- the goodput ceiling --------------------------------------------------------------------------------------
def step_at(step_ms: dict[int, float], batch: float) -> float:
    """The decode step time at `batch` (fractional), linear between measured batch sizes and beyond the last two."""
    xs = sorted(step_ms)
    if batch <= xs[0] or len(xs) == 1:
        return step_ms[xs[0]]
    hi = next((x for x in xs if x >= batch), xs[-1])
    lo = xs[xs.index(hi) - 1]
    return step_ms[lo] + (step_ms[hi] - step_ms[lo]) * (batch - lo) / (hi - lo)


def tpot_at(rate: float, prefill_ms: float, step_ms: dict[int, float], output_tokens: int, cap_ms: float) -> float:
    """Mean TPOT (ms) at `rate` req/s: prefill takes rho = rate * prefill_ms of the GPU, decode steps run back to
    back in the rest, so TPOT = step(B) / (1 - rho), with B = rate * (output_tokens - 1) * TPOT in flight (Little).
    The fixed point, iterated from below (it grows monotonically); inf once past `cap_ms` or rho >= 1."""
    rho = rate * prefill_ms / 1e3
    if rho >= 1:
        return math.inf
    tpot = step_at(step_ms, 1) / (1 - rho)
    for _ in range(500):
        nxt = step_at(step_ms, max(1.0, rate * (output_tokens - 1) * tpot / 1e3)) / (1 - rho)
        if nxt > cap_ms:
            return math.inf
        if abs(nxt - tpot) < 1e-6:
            return nxt
        tpot = nxt
    return tpot


def goodput_limit(prefill_ms: float, step_ms: dict[int, float], output_tokens: int = 128,
                  slo_tpot_ms: float = SLO_TPOT_MS, slo_ttft_ms: float = SLO_TTFT_MS) -> float:  # fmt: skip
    """The highest rate (req/s) one GPU can serve within the SLO on average: mean TPOT (`tpot_at`) <= slo_tpot_ms
    and mean TTFT <= slo_ttft_ms, TTFT = prefill_ms + the M/D/1 wait of the prefill queue, rho * P / (2 (1 - rho)).
    Bisection (both grow with the rate). An upper bound on the measured goodput, which needs 90% within the SLO."""

    def ok(rate: float) -> bool:
        rho = rate * prefill_ms / 1e3
        ttft = prefill_ms + rho * prefill_ms / (2 * (1 - rho)) if rho < 1 else math.inf
        return ttft <= slo_ttft_ms and tpot_at(rate, prefill_ms, step_ms, output_tokens, slo_tpot_ms) <= slo_tpot_ms

    lo, hi = 0.0, 1e3 / prefill_ms
    if not ok(1e-9):
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


# ---- the parts ------------------------------------------------------------------------------------------------
def engine_figures(model: Path, seed: int) -> tuple[dict, dict]:
    """In-process engine on cuda:0 as served (bf16, int8 KV, FA3, chunk 2048, CUDA graphs): 2k TTFT, then the
    decode step at each of BATCHES, requests of 2048 prompt tokens. Run in a child process (`in_child`): the
    stacks after it size their memory by the GPU's total, so this process must not keep the engine's."""
    rng = torch.Generator().manual_seed(seed)
    from gpu_engine import fill_decode_batch, time_decode_steps, time_prefill

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    cfg = EngineConfig(
        model_dir=str(model), dtype="bfloat16", device="cuda:0", page_size=16, chunk_size=2048, kv_dtype="int8",
        attention_backend="fa3", num_pages=8192, max_num_seqs=max(BATCHES),
    )  # fmt: skip
    e = LLMEngine(cfg)
    ttft = time_prefill(e, lambda: gs.fresh(2048, rng), reps=5)
    running = max(BATCHES)
    fill_decode_batch(e, running, 2048, rng)  # requests d0.. d47
    steps: dict[int, float] = {}
    for b in BATCHES:  # descending: abort down to b
        for i in range(b, running):
            e.abort(f"d{i}")
        running = b
        e.step()
        steps[b] = statistics.median(time_decode_steps(e, 25)[5:])
        log(f"engine: decode step b{b} {steps[b]:.2f} ms")
    page_bytes = e.runner.page_bytes()
    return {"engine_ttft_ms_2k": ttft}, {"engine": {"decode_step_ms": steps, "page_bytes": page_bytes}}


def in_child(fn, *args, **kw):
    """`fn(*args, **kw)` in a fresh (spawned) process, so that its GPU memory is the driver's again when it ends."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kw).result()


def redis_fetch_gbps(url: str, page_bytes: int, pages: int = 230, reps: int = 5) -> float:
    """The synchronous lookup's read rate (`RedisStore.get_many`, redis-py, one pipeline): `pages` values of one KV
    page's size (230: the 90% prefix of a 4k prompt), median of `reps` (details only: the prefill's racing fetch
    reads in parallel straight into pinned memory, `redis_fetch_gbps`)."""
    from pdserve.cache.redis_store import RedisStore

    store = RedisStore(url, timeout_s=10.0, connect_timeout_s=5.0)
    keys = [f"one_gpu-{i}".encode() for i in range(pages)]
    store.set_many([(k, os.urandom(page_bytes)) for k in keys], ttl_ms=600_000)
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        got = store.get_many(keys, ttl_ms=600_000)
        rates.append(sum(len(v or b"") for v in got) / (time.perf_counter() - t0) / 1e9)
    store.close()
    return statistics.median(rates)


def served_part(model: Path, workdir: Path, rng: torch.Generator, grpc: bool, cache: bool, page_bytes: int,
                shards: list[int], fetch_modes: list[str] = ("auto",),  # type: ignore[assignment]
                grpc_transport: str = "grpc-shm", shippers: list[str] = ("",)):  # type: ignore[assignment]  # fmt: skip
    """gpu_serving stacks on GPU0: the grpc part (a stack of its own, its KV transport forced to `grpc_transport`:
    grpc-shm, the gRPC wire with its bytes in the shipper processes, what two hosts use by default, or grpc; one 2k
    request at a time, the second token and the KV GB/s) and the cache part once per `shards` entry (prefill's cache
    on one redis-server, or a Redis Cluster of that many shards on this host, Redis only: 4k TTFT cold, then one 90%
    prefix hit six times; then the prefill's own fetch rate from that Redis), each once per `fetch_modes` entry (the
    prefill's --cache-fetch-process; details `cache_shards_N` for the last, `cache_shards_N_fetch_MODE` for the
    others), on stacks of the one-GPU default transport (a hit ships its whole prefix to decode: through the grpc
    part's forced transport its pages would leave through host copies beside the tail's compute). The keys: the
    last run's. `shippers` other than [""] (--kv-shippers): the grpc part on stacks of its own, once
    per entry (the services' --kv-shippers), each followed by a raw gRPC stream of this host
    (`grpc_shippers_side_by_side` in details; the keys, raw_grpc_gbps included, the last entry's)."""
    from pdserve.testing.redis_cluster import RedisClusterServers
    from pdserve.testing.redis_server import RedisServer

    keys: dict[str, Any] = {}
    details: dict[str, Any] = {}
    if grpc and list(shippers) != [""]:
        keys, details = shipper_runs(model, workdir, rng, grpc_transport, list(shippers))
        if not cache:
            return keys, details
        grpc = False
    if grpc:  # a stack of its own: its forced transport never carries the cache part's hits
        stack = gs.start(model, workdir / "served-grpc", grpc_transport, {})
        try:
            details["grpc"] = got = gs.served_ttft(stack, grpc_transport, rng, reps=5)
            got["transport"] = grpc_transport
            k = "shm" if grpc_transport == "grpc-shm" else "grpc"
            keys.update(t2t_ms_2k_grpc=got[f"served_t2t_ms_2k_{k}"], kv_gbps_grpc=got[f"kv_gbps_{k}"])
        finally:
            stack.stop()
    runs = [(n, m) for n in shards for m in fetch_modes] if cache else []
    for run, (n, mode) in enumerate(runs):
        redis: Any = None
        if n == 1:
            redis = RedisServer(workdir / f"redis-{run}").start()
        elif n > 1:
            redis = RedisClusterServers(workdir / f"redis-cluster-{n}-{run}", shards=n).start()
        name = f"cache_shards_{n}" + ("" if mode == fetch_modes[-1] else f"_fetch_{mode}")
        try:
            env = {"REDIS_URL": redis.url, **gs.REDIS_ONLY} if redis else {}
            if n > 1:
                env["PDSERVE_PREFILL_REDIS_CLUSTER"] = "true"
            env["PDSERVE_PREFILL_CACHE_FETCH_PROCESS"] = mode
            stack = gs.start(model, workdir / f"served-{n}-{run}", "auto", env)  # the one-GPU default transport
            try:
                if redis:
                    details[name] = got = gs.redis_repeat_figures(stack, rng)
                    got["fetch_process"] = mode
                    keys.update({k: got[k] for k in ("ttft_ms_4k_cold", "ttft_ms_4k_redis_first",
                                                     "ttft_ms_4k_redis_p50")})  # fmt: skip
            finally:
                stack.stop()
            if redis:
                from prompt_cache import fetch_gbps  # bench/prompt_cache.py: the prefill's own background fetch

                helper = mode == "on" or (mode == "auto" and torch.cuda.is_available())
                fetch = fetch_gbps(redis.url, repeats=5, device="cuda:0", connections=8, cluster=n > 1, helper=helper)
                keys["redis_fetch_gbps"] = fetch["redis_fetch_gbps"]
                details[name]["fetch"] = fetch
                if n == 1 and mode == fetch_modes[-1]:
                    details[name]["redis_get_many_gbps"] = redis_fetch_gbps(redis.url, page_bytes)
        finally:
            if redis:
                redis.stop()
    if cache:
        details.update(cache_keys_from_shards=shards[-1], cache=None)  # None: an older run's layout, dropped
    return keys, details


def shipper_runs(model: Path, workdir: Path, rng: torch.Generator, transport: str, shippers: list[str]):
    """The grpc part once per --kv-shippers entry, in the order given (repeat entries to alternate them): a stack
    whose prefill and decode run that many shipper pairs, one 2k request at a time (second token, KV GB/s), then a
    raw gRPC stream of this host beside nothing (the ratio's denominator, measured next to each entry)."""
    k = "shm" if transport == "grpc-shm" else "grpc"
    keys: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    for i, n in enumerate(shippers):
        env = {"PDSERVE_PREFILL_KV_SHIPPERS": n, "PDSERVE_DECODE_KV_SHIPPERS": n}
        stack = gs.start(model, workdir / f"served-shippers-{n}-{i}", transport, env)
        try:
            got = gs.served_ttft(stack, transport, rng, reps=5)
        finally:
            stack.stop()
        raw = gs.raw_grpc(workdir)["raw_grpc_gbps"]
        runs.append(dict(kv_shippers=int(n), raw_grpc_gbps=raw, kv_gbps=got[f"kv_gbps_{k}"],
                         ratio=got[f"kv_gbps_{k}"] / raw, t2t_ms_2k=got[f"served_t2t_ms_2k_{k}"],
                         ttft_ms_2k=got[f"served_ttft_ms_2k_{k}"]))  # fmt: skip
        log(f"kv shippers {n}: {json.dumps(runs[-1])}")
        keys = dict(t2t_ms_2k_grpc=runs[-1]["t2t_ms_2k"], kv_gbps_grpc=runs[-1]["kv_gbps"], raw_grpc_gbps=raw)
    per = {n: [r for r in runs if r["kv_shippers"] == int(n)] for n in dict.fromkeys(shippers)}
    median = {n: {f: statistics.median(r[f] for r in rs) for f in ("kv_gbps", "ratio", "t2t_ms_2k", "ttft_ms_2k")}
              for n, rs in per.items()}  # fmt: skip
    return keys, {"grpc_shippers_side_by_side": dict(transport=transport, runs=runs, median=median)}


def budget_flags(budget: str) -> list[str]:
    """`pdserve up` engine flags of a colocated step size: none for auto, else N prefill tokens per step beside
    every decode row (max_num_seqs 64), as auto sizes a step."""
    if budget == "auto":
        return []
    n = int(budget)
    return ["--chunk-size", str(n), "--step-token-budget", str(n + 64)]


def up_stack(
    model: Path, mode: str, workdir: Path, args, token: str, extra: tuple[str, ...] = (), env_extra: dict | None = None
) -> tuple[subprocess.Popen, Any, Stack]:
    """`pdserve up` in `mode` on --gpus as a child process (`extra`: more flags, `env_extra`: more environment);
    its banner, and the stack as gpu_serving reads it."""
    from pdserve.server.grpc_util import channel
    from pdserve.server.security import ChannelSecurity
    from pdserve.v1 import router_admin_pb2 as pb
    from pdserve.v1 import router_admin_pb2_grpc

    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model), "--port", "0", "--gateway-port", "-1",
           "--metrics-port", "-1", "--gpus", args.gpus, "--drain-grace-s", "5", *MODES[mode], *extra]  # fmt: skip
    env = {**os.environ, "PDSERVE_INTERNAL_TOKEN": token, "PDSERVE_CACHE_DIR": str(workdir / mode), **(env_extra or {})}
    log(" ".join([*(f"{k}={v}" for k, v in (env_extra or {}).items()), *cmd[2:]]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        banner = read_banner(proc, timeout_s=args.ready_timeout, gateway=False)
        with channel(banner.internal, ChannelSecurity(token=token)) as ch:
            listed = router_admin_pb2_grpc.RegistryStub(ch).ListInstances(pb.ListInstancesRequest(), timeout=10)
    except BaseException:
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGINT: `up` stops what it started, then SIGKILL
            stop(proc, timeout_s=60)
        raise
    role = lambda r: [i.address for i in listed.instances if i.role == r]
    stack = Stack(banner.router, role(pb.INSTANCE_ROLE_PREFILL), role(pb.INSTANCE_ROLE_DECODE), internal_token=token)
    return proc, banner, stack


def mps_flags(entry: str) -> list[str]:
    """`pdserve up` flags of a --disagg-mps entry: off, auto, on or on:P (P: --mps-prefill-sm-percent)."""
    mode, _, pct = entry.partition(":")
    return ["--mps", mode, *(["--mps-prefill-sm-percent", pct] if pct else [])]


def mode_part(
    model: Path,
    mode: str,
    workdir: Path,
    args,
    rng: torch.Generator,
    budget: str = "auto",
    mps: str = "auto",
    yield_tpot_ms: str = "",
) -> tuple[dict, dict]:
    """One mode: `pdserve up`, (disagg on a GPU: one request's second token and KV GB/s first), the sweep.
    `budget` (colocated): the step size (`budget_flags`); a run at another than auto keeps its figures in details
    only. `mps` (disaggregated): a --disagg-mps entry (`mps_flags`); `yield_tpot_ms`: the decode's --yield-tpot-ms
    ("": its default)."""
    key = KEY[mode]
    extra = tuple(budget_flags(budget)) if mode == "coloc" else tuple(mps_flags(mps))
    env_extra = {"PDSERVE_DECODE_YIELD_TPOT_MS": yield_tpot_ms} if yield_tpot_ms else {}
    proc, banner, stack = up_stack(model, mode, workdir, args, new_token(), extra, env_extra)
    out: dict[str, Any] = {}
    served: dict[str, Any] = {}  # the disaggregated stack's one-request figures (gpu_serving.served_ttft)
    try:
        if mode == "disagg" and args.gpus != "none":
            served = gs.served_ttft(stack, "cuda-ipc", rng, reps=5)
            out["t2t_ms_2k_ipc"] = served["served_t2t_ms_2k_ipc"]
            # the same with each prompt's prompt-cache write-back done before the next (details only: the key's
            # prompts come back to back)
            spaced = gs.served_ttft(stack, "cuda-ipc", rng, reps=5, gap_s=0.5)
            served["spaced_0.5s"] = {k: v for k, v in spaced.items() if k.startswith(("served_t2t", "served_ttft"))}
        res = pdserve_bench(stack.router, workdir / f"{mode}.json", "--tokenizer", str(model), "--rates", args.rates,
                            "--num-requests", str(args.num_requests), "--input-dist", f"fixed:{args.prompt_tokens}",
                            "--output-dist", f"fixed:{args.output_tokens}", "--seed", str(args.seed), "--timeout",
                            "60", "--warmup", "4", "--slo-preset", args.slo_preset)  # fmt: skip
    finally:
        stop(proc, timeout_s=90)
    out[f"{key}_goodput_rps"] = goodput_rate(res)
    out[f"{key}_ttft_ms_p50_{LOW_RATE:g}rps"] = at_rate(res, LOW_RATE).get("ttft_ms", {}).get("p50", math.nan)
    rows = []
    for r in res["runs"]:
        s = r["summary"]
        rows.append(dict(rate=r["rate"], slo_attainment=s["slo_attainment"], ttft_ms=s["ttft_ms"],
                         tpot_ms=s["tpot_ms"], goodput_rps=s["goodput_rps"], errors=s["errors"]))  # fmt: skip
        log(f"{mode} rate {r['rate']}: SLO met {s['slo_attainment']:.0%}, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
            f"TPOT p90 {s['tpot_ms']['p90']:.1f} ms, errors {s['errors']}")  # fmt: skip
    mode_line = next((ln.strip() for ln in banner.lines if "pdserve up: mode" in ln), "")
    detail = {"up_mode_line": mode_line, "sweep": rows, "slo": res["slo"], "served_2k": served}
    if mode == "disagg":
        detail["mps"] = {"flags": " ".join(mps_flags(mps)), "log": [ln.strip() for ln in banner.lines if "MPS" in ln]}
        # how many of the decode engine's host-only commands (page reservations, first tokens, import ends) ran
        # during its steps' GPU waits (EngineLoop), from its log at stop (the reader may still take the last lines)
        mark = "host-only commands"
        deadline = time.monotonic() + 5
        while not any(mark in ln for ln in list(banner.lines)) and time.monotonic() < deadline:
            time.sleep(0.1)
        detail["decode_host_commands"] = [ln.strip() for ln in list(banner.lines) if mark in ln]
        # how long decode held its steps back for the prefill on its GPU (pdserve.engine.gpu_share), when it did
        detail["decode_yield"] = [ln.strip() for ln in list(banner.lines) if "held steps back" in ln]
    if mode == "coloc":
        detail["step_budget"] = {"flags": " ".join(budget_flags(budget)) or "auto", "log": budget_line(banner.lines)}
        if budget != "auto":
            return {}, {f"coloc_budget_{budget}": {**detail, "goodput_rps": out[f"{key}_goodput_rps"]}}
    return out, {key: detail}


def budget_line(lines: list[str]) -> str:
    """The colocated instance's step budget log line (`pdserve.decode.step_budget`) from `pdserve up`'s output
    (the services log to it)."""
    mark = "colocated step budget:"
    return next((ln.split(mark, 1)[1].strip() for ln in list(lines) if mark in ln), "")


def coloc_part(model: Path, workdir: Path, args, rng: torch.Generator) -> tuple[dict, dict]:
    """The colocated mode at each of --coloc-budgets (one stack each, one after another)."""
    keys: dict[str, Any] = {}
    details: dict[str, Any] = {}
    for budget in args.coloc_budgets.split(","):
        k, d = mode_part(model, "coloc", workdir, args, rng, budget.strip())
        keys.update(k)
        details.update(d)
    return keys, details


def entry_name(details: dict, mps: str, yield_tpot_ms: str) -> str:
    """The details key of one disaggregated run: `disagg1_mps_<mps>[_yield_<ms>]`, `_run<k>` for its k-th repeat."""
    name = f"disagg1_mps_{mps.replace(':', '_')}" + (f"_yield_{yield_tpot_ms}" if yield_tpot_ms else "")
    runs = sum(1 for n in details if n == name or n.startswith(name + "_run"))
    return name + (f"_run{runs + 1}" if runs else "")


def disagg_part(model: Path, workdir: Path, args, rng: torch.Generator) -> tuple[dict, dict]:
    """The disaggregated mode once per --disagg-mps entry and --disagg-yield entry (one stack each, alternating
    yield entries within each MPS entry); the keys from the last, every entry's figures in details
    (`disagg1_mps_<entry>`, with `_yield_<ms>` when --disagg-yield names more than the default, and `_run<k>` for
    the k-th repeat of a combination: 0,13,0,13 alternates them and keeps every run)."""
    keys: dict[str, Any] = {}
    details: dict[str, Any] = {}
    entries = [e.strip() for e in args.disagg_mps.split(",")]
    yields = [y.strip() for y in args.disagg_yield.split(",")] if args.disagg_yield else [""]
    for entry in entries:
        for y in yields:
            k, d = mode_part(model, "disagg", workdir, args, rng, mps=entry, yield_tpot_ms=y)
            keys = k
            details[entry_name(details, entry, y)] = {**d["disagg1"], **k, "decode_yield_tpot_ms": y or "default"}
            details["disagg1"] = d["disagg1"]
    return keys, details


# ---- the summary: the ceiling, the mode data, default_mode ---------------------------------------------------
def finite(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def mode_entry(doc: dict) -> dict:
    """The data file's entry of this run's placement, from the merged JSON's figures."""
    slo, load = doc["details"]["coloc"]["slo"], doc["details"]["workload"]  # slo: pdserve bench's
    workload = (
        f"{load['prompt_tokens']} -> {load['output_tokens']} tokens, SLO TTFT <= {slo['ttft_ms']:g} ms and TPOT <= "
        f"{slo['tpot_ms']:g} ms for {slo['attainment']:.0%}"
    )
    return dict(
        measured=True,
        colocated_goodput_rps=doc["coloc_goodput_rps"],
        disaggregated_goodput_rps=doc["disagg1_goodput_rps"],
        colocated_ttft_ms_p50_2rps=finite(doc.get("coloc_ttft_ms_p50_2rps")),
        disaggregated_ttft_ms_p50_2rps=finite(doc.get("disagg1_ttft_ms_p50_2rps")),
        workload=workload,
        device=doc["device"],
        date=doc["date"],
        commit=doc["commit"],
        source="bench/one_gpu.py",
    )


def summarize(args, gpus: list[int]) -> tuple[dict, dict]:
    """Keys computed from the merged JSON: goodput_limit_rps (with the engine part's figures) and, once both modes
    are in, the mode data file and default_mode (+ the line `pdserve up` prints, in details)."""
    doc = json.loads(Path(args.json).read_text())
    out: dict[str, Any] = {}
    details: dict[str, Any] = {}
    steps = doc.get("details", {}).get("engine", {}).get("decode_step_ms")
    if steps and "engine_ttft_ms_2k" in doc:
        steps = {int(b): float(t) for b, t in steps.items()}
        out["goodput_limit_rps"] = goodput_limit(doc["engine_ttft_ms_2k"], steps, args.output_tokens)
    if "coloc_goodput_rps" in doc and "disagg1_goodput_rps" in doc:
        path = Path(args.mode_data)
        data = load_measurements(path) or load_measurements() or {"schema": SCHEMA}  # else the packaged file's
        data["one_gpu" if gpus else "cpu"] = mode_entry(doc)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        log(f"wrote {path}")
        choice = choose_mode(gpus, load_measurements(path))
        out["default_mode"], details["default_mode_line"] = choice.mode, choice.line()
        log(choice.line())
    return out, details


def kv_page_bytes(json_path: Path) -> int:
    """A KV page's bytes (the Redis fetch's value size): the engine part's figure, else an 8B int8 page's (32 layers
    x K and V x 16 tokens x 8 heads x 128 channels at one byte, plus a 2-byte scale per 64 channels)."""
    doc = json.loads(json_path.read_text()) if json_path.exists() else {}
    return int(doc.get("details", {}).get("engine", {}).get("page_bytes") or 32 * 2 * 16 * 8 * (128 + 4))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="all", help=f"comma-separated of {', '.join(PARTS)}, or all")
    ap.add_argument("--json", default="docs/bench/one_gpu.json")
    ap.add_argument("--mode-data", default="shared/data/mode_choice.json", help="the mode data file written")
    ap.add_argument("--commit", default="", help="commit measured (a device copy of the tree may lack git)")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "pdserve-one-gpu"))
    ap.add_argument("--model", default="", help="an existing model directory instead of the random 8B checkpoint")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--gpus", default="0", help="`pdserve up --gpus` (none: CPU, a smoke run)")
    ap.add_argument("--rates", default="2,6,8,10,12")
    ap.add_argument("--coloc-budgets", default="auto", help="colocated step sizes, comma-separated: auto and/or "
                    "prefill tokens per step (each a stack of its own)")  # fmt: skip
    ap.add_argument("--disagg-mps", default="auto", help="the disaggregated part once per entry of `pdserve up "
                    "--mps` (off, auto, on, on:P with P the prefill's SM percent; e.g. off,on: side by side; the keys "
                    "from the last)")  # fmt: skip
    ap.add_argument("--disagg-yield", default="", help="the disaggregated part once per entry of the decode's "
                    "--yield-tpot-ms (e.g. 0,13: side by side; empty: the decode's default)")  # fmt: skip
    ap.add_argument("--redis-shards", default="1,4", help="the cache part once per entry: 1 = one redis-server, N = "
                    "a Redis Cluster of N shards on this host (the keys: the last entry's)")  # fmt: skip
    ap.add_argument("--fetch-process", default="auto", help="the cache part once per entry of the prefill's "
                    "--cache-fetch-process (e.g. off,auto: side by side; the keys from the last)")  # fmt: skip
    ap.add_argument("--grpc-transport", default="grpc-shm", choices=("grpc-shm", "grpc"), help="the grpc part's "
                    "transport (t2t_ms_2k_grpc, kv_gbps_grpc): grpc-shm moves the wire's bytes in the shipper "
                    "processes (issue 32 item 6), grpc in the engine processes")  # fmt: skip
    ap.add_argument(
        "--kv-shippers",
        default="",
        help="the grpc part once per entry of the services' "
        "--kv-shippers, on stacks of its own, each with a raw gRPC stream beside it (2,3,2,3: alternated)",
    )
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-preset", default="gpu", help="pdserve bench --slo-preset (cpu: a smoke run)")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--no-part-after-s", type=float, default=math.inf, help="start no part past this many seconds "
                    "(a device call's limit: the parts left are logged as skipped)")  # fmt: skip
    args = ap.parse_args()
    t_start = time.perf_counter()  # the checkpoint's writing included
    parts = set(PARTS) if args.part == "all" else set(args.part.split(","))
    if parts - set(PARTS):
        ap.error(f"unknown parts {sorted(parts - set(PARTS))}; known: {', '.join(PARTS)}")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else workdir / f"llama8b-{args.layers}l"
    if not args.model and not (model / "model.safetensors.index.json").exists():
        from pdserve.models.random_llama import write_random_llama

        t0 = time.perf_counter()
        in_child(write_random_llama, model, args.layers, device="cuda:0")
        log(f"checkpoint written in {time.perf_counter() - t0:.0f}s")
    gpus = [] if args.gpus == "none" else [int(g) for g in args.gpus.split(",")]
    device = f"{len(gpus)}x {torch.cuda.get_device_name(gpus[0])}" if gpus else ""
    rng = torch.Generator().manual_seed(args.seed)
    workload = dict(prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, rates=args.rates,
                    num_requests_per_rate=args.num_requests, seed=args.seed, slo_preset=args.slo_preset)  # fmt: skip

    def save(keys: dict, details: dict) -> None:
        if set(keys) - set(KEYS):
            raise ValueError(f"not keys of the JSON: {sorted(set(keys) - set(KEYS))} (details hold the rest)")
        old = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
        prov = provenance(args.commit, device)
        commands = old.get("details", {}).get("command", [])  # every run merged into this JSON, in order
        commands = [commands] if isinstance(commands, str) else list(commands)
        cmd = prov.pop("command")
        merged = {**old.get("details", {}), **details,
                  "command": commands + ([cmd] if cmd not in commands else [])}  # fmt: skip
        if parts & {"coloc", "disagg"}:  # the sweep's workload: a run without a sweep leaves the last one's
            merged["workload"] = workload
        merged = {k: v for k, v in merged.items() if v is not None}  # None: an earlier error_<part> now cleared
        merge_json(args.json, {**keys, **prov, "details": merged})

    page_bytes = lambda: kv_page_bytes(Path(args.json))
    runs = {  # in PARTS' order
        "engine": lambda: in_child(engine_figures, model, args.seed),
        "coloc": lambda: coloc_part(model, workdir, args, rng),
        "disagg": lambda: disagg_part(model, workdir, args, rng),
        "raw": lambda: ({"raw_grpc_gbps": gs.raw_grpc(workdir)["raw_grpc_gbps"]}, {}),
        "grpc,cache": lambda: served_part(
            model,
            workdir,
            rng,
            "grpc" in parts,
            "cache" in parts,
            page_bytes(),
            [int(n) for n in args.redis_shards.split(",")],
            args.fetch_process.split(","),
            args.grpc_transport,
            [n.strip() for n in args.kv_shippers.split(",")] if args.kv_shippers else [""],
        ),
    }
    failed: list[str] = []
    for name, run in runs.items():  # grpc and cache share one stack
        if parts & set(name.split(",")):
            t0 = time.perf_counter()
            if t0 - t_start > args.no_part_after_s:
                log(f"part {name}: skipped, {t0 - t_start:.0f} s in (--no-part-after-s {args.no_part_after_s:g})")
                failed.append(name)
                continue
            log(f"part {name}: start, {t0 - t_start:.0f} s in")
            try:
                keys, details = run()
            except Exception as e:  # the next parts still run: one device call measures what it can
                traceback.print_exc()
                failed.append(name)
                save({}, {f"error_{name}": f"{type(e).__name__}: {e}"[:2000]})
                continue
            save(keys, {**details, f"error_{name}": None})
            save(*summarize(args, gpus))  # after each part: a run cut short keeps what it had
            log(f"part {name}: {json.dumps(keys)} in {time.perf_counter() - t0:.0f} s")
    log(f"done in {time.perf_counter() - t_start:.0f} s" + (f"; not done: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
