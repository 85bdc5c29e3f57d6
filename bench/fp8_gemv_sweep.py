"""FP8 decode GEMV sweep (issue 30): effective weight-stream TB/s of every fp8_gemv path and launch config at
M = 1, 2, 4, 8, 16 on the 8B and 70B layer shapes, next to the copy bandwidth and the bf16 GEMV on the same shapes.

    python bench/fp8_gemv_sweep.py [--json out.json] [--models 8b,70b] [--budget-s 100]      # GPU, < 2 min
    TRITON_INTERPRET=1 python bench/fp8_gemv_sweep.py --smoke [--json out.json]              # CPU: numerics only

GPU: every timing is a CUDA graph of `--launches` back-to-back launches (the decode graph's shape: no launch gaps)
over enough distinct weight copies that L2 holds none of them between reads, median of `--reps` replays (CUDA
events). Each (path, config, M, shape) is timed with PDL; the best config per (path, M, shape) again without PDL;
then per (path, M, model) one graph of `--launches` layers (qkv, o, gate_up, down with their best configs) with and
without PDL. TB/s = weight bytes read / time (block scales and x excluded); "copy" = bytes read + written by a
torch copy of 1 GiB (what the rooflines divide by). The kernels are compiled first on a pool of processes into
Triton's on-disk cache (the parent then loads them), so the sweep fits its wall-time budget; past
`--budget-s` the remaining timings are skipped (logged) and the JSON still written.

--smoke (CPU, Triton's interpreter): tiny shapes with N and K tails, M = 1 and 3, every path's default config
(smoke_configs), checked against the float64 product of x and the dequantized weight
(block, per-row and per-channel scales).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from benchutil import log

from pdserve.engine.kernels import gemv as bf16_gemv
from pdserve.engine.quant import fp8_gemv as F

MODELS = {
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
}
SMOKE = {"tiny": {"qkv": (96, 256), "o": (72, 200), "gate_up": (160, 264), "down": (40, 392)}}
MS = (1, 2, 4, 8, 16)
LARGE_M_CONFIGS = 3  # configs_for
L2_BYTES = 200 << 20  # weight copies per shape: at least this many bytes (H200 L2: 50 MiB)
BF16_CONFIGS = [dict(bf16_gemv.DEFAULT_CONFIG)] + [
    dict(c) for c in bf16_gemv.DEFAULT_PLAN.values() if c is not None and c != bf16_gemv.DEFAULT_CONFIG
]


class Path_:
    """One way to run a shape, `run(x, w8, w16, scale, scale_rows, counters, cfg, pdl) -> y`; its configs, its largest
    M and its bytes per weight."""

    def __init__(self, name: str, run: Callable, configs: list[dict], max_m: int, weight_bytes: int):
        self.name, self.run, self.configs, self.max_m, self.weight_bytes = name, run, configs, max_m, weight_bytes


SCALE_ROWS = {"block": 128, "rows": 1, "channel": 0}  # --scales -> fp8_gemv's scale_rows


def fp8_run(path: str) -> Callable:
    def run(x, w8, w16, scale, scale_rows, counters, cfg, pdl):
        return F.fp8_gemv(x, w8, scale, None, scale_rows, counters=counters, pdl=pdl, path=path, **cfg)

    return run


def bf16_gemv_run(x, w8, w16, scale, scale_rows, counters, cfg, pdl):
    return bf16_gemv.gemv(x, w16, pdl=pdl, **cfg)


def cublas_run(x, w8, w16, scale, scale_rows, counters, cfg, pdl):
    return torch.nn.functional.linear(x, w16)


def paths(names: list[str]) -> list[Path_]:
    """The fp8_gemv paths (configs from F.PATH_CONFIGS) and the bf16 baselines."""
    out = [Path_(p, fp8_run(p), [dict(c) for c in F.PATH_CONFIGS[p]], F.PATH_MAX_ROWS[p], 1) for p in F.PATH_CONFIGS]
    out += [
        Path_("bf16_gemv", bf16_gemv_run, BF16_CONFIGS, bf16_gemv.MAX_M, 2),
        Path_("bf16_cublas", cublas_run, [{}], max(MS), 2),
    ]
    return [p for p in out if not names or p.name in names]


def cfg_str(cfg: dict) -> str:
    short = dict(block_n="n", block_k="k", num_warps="w", num_stages="s", programs_per_sm="p")
    flags = {k for k, v in cfg.items() if v is True}  # e.g. acc_k
    return " ".join([f"{short.get(k, k)}{v}" for k, v in cfg.items() if k not in flags] + sorted(flags)) or "-"


def smoke_configs(configs: list[dict]) -> list[dict]:
    """The path's default config: the smoke run checks the script end to end; every variant's numerics (acc_k, no
    prefetch, block sizes) are the interpreter test's (tests/shared/engine/test_engine_fp8_weights.py). Without
    `half`: the interpreter runs no inline PTX (that test compiles it for Hopper instead)."""
    return [{k: v for k, v in configs[0].items() if k != "half"}]


# ---- GPU -------------------------------------------------------------------------------------------------------
class Weights:
    """Per shape: `copies` distinct e4m3 weights [N, K] (and bf16 ones for the baselines), block scales, a counter
    buffer per copy, inputs x [M, K] bf16 per M."""

    def __init__(self, n: int, k: int, ms: tuple[int, ...], dev: torch.device, bf16: bool, scale_rows: int):
        self.n, self.k = n, k
        self.copies = max(1, math.ceil(L2_BYTES / (n * k)))
        base = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        self.w8 = [base.to(torch.float8_e4m3fn) for _ in range(self.copies)]
        self.w16 = [base.clone() for _ in range(max(1, math.ceil(L2_BYTES / (2 * n * k))))] if bf16 else [base]
        self.scale, self.scale_rows = make_scale(n, k, scale_rows, dev), scale_rows
        self.counters = [torch.zeros(F.counter_slots(n), dtype=torch.int32, device=dev) for _ in range(self.copies)]
        self.x = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m in ms}

    def launch(self, p: Path_, cfg: dict, m: int, pdl: bool, i: int) -> Callable[[], torch.Tensor]:
        c8, c16 = i % len(self.w8), i % len(self.w16)
        return lambda: p.run(self.x[m], self.w8[c8], self.w16[c16], self.scale, self.scale_rows, self.counters[c8], cfg,
                             pdl)  # fmt: skip


def make_scale(n: int, k: int, scale_rows: int, dev: torch.device) -> torch.Tensor:
    """Random positive float32 scales: [N] (scale_rows 0) or [ceil(N / scale_rows), ceil(K / 128)]."""
    shape = (n,) if not scale_rows else (-(-n // scale_rows), -(-k // 128))
    return torch.rand(shape, device=dev) * 1e-2 + 1e-3


def graph_us(fns: list[Callable], reps: int) -> float:
    """Median microseconds of one replay of a CUDA graph of fns (in order), CUDA events."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    del graph
    return statistics.median(times)


def copy_tb_s(dev: torch.device) -> float:
    """Copy bandwidth, bytes read + written per second / 1e12, of a 1 GiB tensor."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    fns = [lambda: y.copy_(x)] * 5
    us = graph_us(fns, 10) / len(fns)
    del x, y
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / us / 1e6


def compile_group(jobs: list[tuple], scale_rows: int) -> int:
    """Worker process: run each job (path, cfg, m, n, k, pdl) once on uninitialized weights, which compiles its
    kernel into Triton's on-disk cache for the parent; returns how many failed (the timing reports why)."""
    dev, failed = torch.device("cuda"), 0
    by_name = {p.name: p for p in paths([])}
    for shape in sorted({(n, k) for _, _, _, n, k, _ in jobs}):
        n, k = shape
        w8 = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=dev)
        w16 = torch.empty(n, k, dtype=torch.bfloat16, device=dev)
        scale = make_scale(n, k, scale_rows, dev)
        counters = torch.zeros(F.counter_slots(n), dtype=torch.int32, device=dev)
        for name, cfg, m, jn, jk, pdl in jobs:
            if (jn, jk) == shape:
                try:
                    by_name[name].run(torch.randn(m, k, device=dev, dtype=torch.bfloat16), w8, w16, scale,
                                      scale_rows, counters, cfg, pdl)  # fmt: skip
                except Exception:
                    failed += 1
        torch.cuda.synchronize()
        del w8, w16
        torch.cuda.empty_cache()
    return failed


def compile_chunks(jobs: list[tuple], workers: int) -> list[list[tuple]]:
    """Jobs (path, cfg, m, n, k, pdl) in at most `workers` chunks of about equal size, all jobs of one kernel
    specialization (path, config, PDL, M's power-of-2 class, M == 1) in one chunk: compiled once."""
    groups: dict[tuple, list[tuple]] = {}
    for j in jobs:
        name, cfg, m, _, _, pdl = j
        groups.setdefault((name, cfg_str(cfg), pdl, 1 << (m - 1).bit_length(), m == 1), []).append(j)
    chunks: list[list[tuple]] = [[] for _ in range(max(1, min(workers, len(groups))))]
    for g in sorted(groups.values(), key=len, reverse=True):
        min(chunks, key=len).extend(g)
    return chunks


def precompile(jobs: list[tuple], workers: int, scale_rows: int):
    """Start compiling every job's kernel on `workers` processes (Triton's compiler holds the GIL, so threads do not
    help), jobs of one kernel specialization (path, config, PDL, M class) on the same worker. Returns (pool,
    AsyncResult of the failure counts); the pool takes more jobs until terminated."""
    import multiprocessing

    chunks = compile_chunks(jobs, workers)
    pool = multiprocessing.get_context("spawn").Pool(len(chunks))
    return pool, pool.starmap_async(compile_group, [(c, scale_rows) for c in chunks])


def configs_for(p: Path_, m: int) -> list[dict]:
    """The configs timed for path p at M rows: the CUDA-core paths at M >= 8 (bound by their float32 products,
    not by the weight stream) only their first LARGE_M_CONFIGS, to keep compiles within the budget."""
    return p.configs[:LARGE_M_CONFIGS] if m >= 8 and p.name in ("stream", "fma") else p.configs


def wait_compiled(compiled, t0: float, budget_s: float, what: str, n: int) -> None:
    try:  # a worker that dies (not an exception: a crash) would leave get() waiting for ever
        failed = sum(compiled.get(timeout=max(10.0, budget_s - (time.perf_counter() - t0))))
    except Exception as exc:
        failed = -1
        log(f"{what}: precompile did not finish ({type(exc).__name__}); the rest compiles in this process")
    log(f"{what}: compiled {n} launches ({failed} failed): {time.perf_counter() - t0:.0f} s")


def timed(p: Path_, d: Weights, cfg: dict, m: int, pdl: bool, args) -> float | None:
    """us per launch of a graph of args.launches launches, None (logged) where it fails."""
    try:
        return graph_us([d.launch(p, cfg, m, pdl, i) for i in range(args.launches)], args.reps) / args.launches
    except Exception as exc:
        log(f"{p.name} {cfg_str(cfg)} M={m} {d.n}x{d.k} pdl={pdl}: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def gpu_main(args) -> dict:
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    ps = paths(args.paths.split(",") if args.paths else [])
    by_name = {p.name: p for p in ps}
    models = {m: MODELS[m] for m in args.models.split(",")}
    ms = tuple(int(m) for m in args.ms.split(","))
    shapes_nk = [nk for shapes in models.values() for nk in shapes.values()]
    jobs = [(p.name, c, m, n, k, True) for p in ps for m in ms if m <= p.max_m for c in configs_for(p, m)
            for n, k in shapes_nk]  # fmt: skip
    scale_rows = SCALE_ROWS[args.scales]
    pool, compiled = precompile(jobs, args.workers, scale_rows)  # while the weights are made
    bf16 = any(p.weight_bytes == 2 for p in ps)
    data = {
        (mo, s): Weights(n, k, ms, dev, bf16, scale_rows)
        for mo, shapes in models.items()
        for s, (n, k) in shapes.items()
    }
    torch.cuda.synchronize()
    log(f"weights ready: {time.perf_counter() - t0:.0f} s")
    wait_compiled(compiled, t0, args.budget_s * 0.6, "PDL launches", len(jobs))
    copy = copy_tb_s(dev)
    log(f"copy bandwidth (read+write) {copy:.2f} TB/s")
    rows: list[dict] = []
    skipped = 0
    for m in ms:  # M outermost: a spent budget cuts the largest batches, every path keeps M = 1
        for p in ps:
            if m > p.max_m:
                continue
            for (mo, s), d in data.items():
                for c in configs_for(p, m):
                    if time.perf_counter() - t0 > args.budget_s:
                        skipped += 1
                        continue
                    us = timed(p, d, c, m, True, args)
                    if us is not None:
                        tb = p.weight_bytes * d.n * d.k / us / 1e6
                        rows.append(dict(path=p.name, m=m, model=mo, shape=s, config=c, us=us, tb_s=tb))
    if skipped:
        log(f"budget {args.budget_s} s spent: {skipped} timings skipped")
    best = best_rows(rows)
    # the winners without PDL: their kernels compiled on the same pool first
    jobs = [(b["path"], b["config"], b["m"], *MODELS[b["model"]][b["shape"]], False) for b in best]
    compiled = pool.starmap_async(compile_group, [(c, scale_rows) for c in compile_chunks(jobs, args.workers)])
    wait_compiled(compiled, time.perf_counter(), 60.0, "launches without PDL", len(jobs))
    pool.terminate()
    for b in best:
        p, d = by_name[b["path"]], data[b["model"], b["shape"]]
        us = timed(p, d, b["config"], b["m"], False, args)
        if us is not None:
            b["us_no_pdl"], b["tb_s_no_pdl"] = us, p.weight_bytes * d.n * d.k / us / 1e6
    layers = []
    for p in ps:
        for m in ms:
            for mo, shapes in models.items():
                pick = {s: next((b for b in best if (b["path"], b["m"], b["model"], b["shape"]) == (p.name, m, mo, s)),
                                None) for s in shapes}  # fmt: skip
                if m > p.max_m or any(v is None for v in pick.values()):
                    continue
                nbytes = p.weight_bytes * sum(n * k for n, k in shapes.values())
                row = dict(path=p.name, m=m, model=mo, sum_best_us=sum(v["us"] for v in pick.values()))  # type: ignore[index]
                for pdl in (True, False):
                    fns = [data[mo, s].launch(p, pick[s]["config"], m, pdl, i)  # type: ignore[index]
                           for i in range(args.launches) for s in shapes]  # fmt: skip
                    try:
                        us = graph_us(fns, args.reps) / args.launches
                    except Exception as exc:
                        log(f"layer {p.name} M={m} {mo} pdl={pdl}: {type(exc).__name__}: {str(exc)[:200]}")
                        us = float("nan")
                    row["us_pdl" if pdl else "us_no_pdl"] = us
                    row["tb_s_pdl" if pdl else "tb_s_no_pdl"] = nbytes / us / 1e6
                layers.append(row)
    log(f"done: {time.perf_counter() - t0:.0f} s")
    out = dict(copy_tb_s=copy, scales=args.scales, best=best, layers=layers, uniform=uniform_configs(rows), all=rows)
    out |= dict(auto=auto_paths(layers), wall_s=time.perf_counter() - t0, device=torch.cuda.get_device_name(dev),
                triton=triton.__version__, torch=torch.__version__)  # fmt: skip
    return out | dict(shape_configs={str(k): v for k, v in shape_configs(best, layers)["table"].items()})


def best_rows(rows: list[dict]) -> list[dict]:
    """The fastest row per (path, M, model, shape)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["path"], r["m"], r["model"], r["shape"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = dict(r)
    return list(best.values())


def uniform_configs(rows: list[dict]) -> list[dict]:
    """Per (path, M): the one config with the least summed time over every timed shape (what a path default
    should be), among configs timed on all of them."""
    total: dict[tuple, dict] = {}
    shapes: dict[tuple, set] = {}
    for r in rows:
        pm = (r["path"], r["m"])
        shapes.setdefault(pm, set()).add((r["model"], r["shape"]))
        t = total.setdefault((*pm, cfg_str(r["config"])), dict(path=r["path"], m=r["m"], config=r["config"], us=0.0,
                                                                bytes=0.0, n=0))  # fmt: skip
        t["us"] += r["us"]
        t["bytes"] += r["tb_s"] * r["us"] * 1e6
        t["n"] += 1
    best: dict[tuple, dict] = {}
    for (path, m, _), t in total.items():
        if t["n"] == len(shapes[path, m]) and ((path, m) not in best or t["us"] < best[path, m]["sum_us"]):
            best[path, m] = dict(path=path, m=m, config=t["config"], sum_us=t["us"], tb_s=t["bytes"] / t["us"] / 1e6)
    return sorted(best.values(), key=lambda r: (r["m"], r["path"]))


def auto_paths(layers: list[dict]) -> list[dict]:
    """Per (M, model): the FP8 path (not a bf16 baseline) with the fastest layer graph with PDL."""
    win: dict[tuple, dict] = {}
    for r in layers:
        key = (r["m"], r["model"])
        if not r["path"].startswith("bf16") and (key not in win or r["us_pdl"] < win[key]["us_pdl"]):
            win[key] = r
    return [dict(m=m, model=mo, path=r["path"], tb_s=r["tb_s_pdl"]) for (m, mo), r in sorted(win.items())]


def shape_configs(best: list[dict], layers: list[dict]) -> dict:
    """fp8_gemv's SHAPE_CONFIGS and AUTO_STREAM_ROWS from the sweep: per M the FP8 path with the least layer time
    (PDL, summed over the models), and that path's best config per shape; AUTO_STREAM_ROWS: the largest M up to
    which "stream" wins at every swept M."""
    total: dict[tuple, float] = {}
    for r in layers:
        if not r["path"].startswith("bf16"):
            total[r["m"], r["path"]] = total.get((r["m"], r["path"]), 0.0) + r["us_pdl"]
    win = {}
    for (m, path), us in sorted(total.items()):
        if m not in win or us < total[m, win[m]]:
            win[m] = path
    table = {}
    for b in best:
        if win.get(b["m"]) == b["path"]:
            n, k = {**MODELS, **SMOKE}[b["model"]][b["shape"]]
            table[b["path"], b["m"], n, k] = b["config"]
    rows = 0
    for m in sorted(win):
        if win[m] != "stream":
            break
        rows = m
    return dict(winner=win, table=table, auto_stream_rows=rows)


def print_tables(out: dict) -> None:
    print(f"\ncopy bandwidth (read+write, 1 GiB): {out['copy_tb_s']:.2f} TB/s")
    print("\nbest config per (path, M, shape): weight TB/s with PDL (without) and us per launch")
    copy = out["copy_tb_s"] or float("nan")
    print(f"{'path':12} {'M':>3} {'model':5} {'shape':8} {'TB/s':>6} {'/copy':>6} {'noPDL':>6} {'us':>8}  config")
    for b in sorted(out["best"], key=lambda r: (r["model"], r["shape"], r["m"], -r["tb_s"])):
        print(f"{b['path']:12} {b['m']:3} {b['model']:5} {b['shape']:8} {b['tb_s']:6.2f} {b['tb_s'] / copy:6.2f} "
              f"{b.get('tb_s_no_pdl', float('nan')):6.2f} {b['us']:8.1f}  {cfg_str(b['config'])}")  # fmt: skip
    print("\nper layer (4 GEMMs, best configs, one graph): weight TB/s and us with / without PDL")
    print(f"{'path':12} {'M':>3} {'model':5} {'TB/s':>6} {'noPDL':>6} {'us':>8} {'us noPDL':>9} {'sum best':>9}")
    for r in sorted(out["layers"], key=lambda r: (r["model"], r["m"], -r["tb_s_pdl"])):
        print(f"{r['path']:12} {r['m']:3} {r['model']:5} {r['tb_s_pdl']:6.2f} {r['tb_s_no_pdl']:6.2f} "
              f"{r['us_pdl']:8.1f} {r['us_no_pdl']:9.1f} {r['sum_best_us']:9.1f}")  # fmt: skip
    print("\nuniform config per (path, M) (least summed time over all shapes: the path default), weight TB/s")
    for u in out["uniform"]:
        print(f"{u['path']:12} {u['m']:3} {u['tb_s']:6.2f}  {cfg_str(u['config'])}")
    print("\nfastest FP8 path per (M, model) by layer graph with PDL (fp8_gemv.AUTO_*_ROWS)")
    for a in out["auto"]:
        print(f"M={a['m']:<3} {a['model']:5} {a['path']:8} {a['tb_s']:6.2f} TB/s")
    pick = shape_configs(out["best"], out["layers"])
    print(f"\nfor fp8_gemv.py (winning path per M {pick['winner']}):\nAUTO_STREAM_ROWS = {pick['auto_stream_rows']}")
    print("SHAPE_CONFIGS: dict[tuple[str, int, int, int], dict] = {")
    for key, cfg in sorted(pick["table"].items()):
        print(f"    {key!r}: dict({', '.join(f'{k}={v!r}' for k, v in cfg.items())}),")
    print("}")


# ---- CPU smoke (Triton's interpreter) ----------------------------------------------------------------------------
def smoke_main(args) -> dict:
    """Every path's default config on tiny shapes at M = 1, 3 against the float64 reference; no timing."""
    from pdserve.engine.quant.fp8_quant import expand_block_scales, quantize_weight_blocks, quantize_weight_per_channel

    torch.manual_seed(0)
    ps = [p for p in paths(args.paths.split(",") if args.paths else []) if p.weight_bytes == 1]
    rows = []
    for s, (n, k) in SMOKE["tiny"].items():
        w = torch.randn(n, k)
        wq, ws = quantize_weight_blocks(w)
        ref_w = wq.double() * expand_block_scales(ws, n, k, (128, 128)).double()
        rows_scale = ws.repeat_interleave(128, 0)[:n].contiguous()
        cq, cs = quantize_weight_per_channel(w)
        ref_c = cq.double() * cs.double()[:, None]
        b = torch.randn(n)
        for m in (1, 3):
            x = torch.randn(m, k) * 3
            for p in ps:
                for cfg in smoke_configs(p.configs):
                    if m > p.max_m:
                        continue
                    counters = torch.zeros(F.counter_slots(n), dtype=torch.int32)
                    kw = dict(counters=counters, path=p.name, out_dtype=torch.float32, **cfg)
                    xp = x.half() if p.name == "tc" else x  # "tc" takes 16-bit activations only
                    errs = [
                        rel(F.fp8_gemv(xp, wq, ws, None, 128, **kw), xp.double() @ ref_w.t()),
                        rel(F.fp8_gemv(xp, wq, rows_scale, b, 1, **kw), xp.double() @ ref_w.t() + b.double()),
                        rel(F.fp8_gemv(xp, cq, cs, None, 0, **kw), xp.double() @ ref_c.t()),
                    ]
                    assert int(counters.abs().sum()) == 0, (p.name, cfg, counters)
                    assert max(errs) < 1e-5, (p.name, cfg, m, s, errs)
                    rows.append(dict(path=p.name, m=m, model="tiny", shape=s, config=cfg, us=1.0, tb_s=0.0,
                                     max_rel_err=max(errs)))  # fmt: skip
    log(f"smoke: {len(rows)} (path, config, M, shape) runs match the reference")
    layers = [dict(path=r["path"], m=r["m"], model="tiny", sum_best_us=1.0, us_pdl=1.0, us_no_pdl=1.0, tb_s_pdl=0.0,
                   tb_s_no_pdl=0.0) for r in best_rows(rows) if r["shape"] == "qkv"]  # fmt: skip
    return dict(copy_tb_s=0.0, best=best_rows(rows), layers=layers, uniform=uniform_configs(rows), all=rows,
                auto=auto_paths(layers))  # fmt: skip


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results (best config per path, M, shape; layers; all rows) here")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: tiny shapes, numerics only")
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--scales", choices=list(SCALE_ROWS), default="block", help="FP8 weight scale layout")
    ap.add_argument("--paths", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--launches", type=int, default=20, help="launches per CUDA graph")
    ap.add_argument("--reps", type=int, default=10, help="graph replays per timing (median)")
    ap.add_argument("--budget-s", type=float, default=80.0, help="skip the remaining per-config timings after this")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    args = ap.parse_args()
    out = smoke_main(args) if args.smoke else gpu_main(args)
    print_tables(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
