"""Tensor-parallel test ranks: spawn a TP group of CPU processes (gloo, a `file://` rendezvous, no port) that load a
checkpoint sharded and run greedy steps through the rank runtime (`pdserve.engine.tp.worker`), rank 0 leading;
and the same greedy run on one process (TP=1) to compare with. Results come back as `torch.save` files of
tensors in a directory the test owns (read with weights_only=True)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.engine.attention import SdpaBackend
from pdserve.engine.kernel_choice import KernelChoice
from pdserve.engine.kv_cache import KVCache, QuantizedKVCache
from pdserve.engine.loader import ModelConfig, parse_model_config
from pdserve.engine.model import CausalLM, load_model
from pdserve.engine.tp.worker import StepPlan, run_plan

PAGE_SIZE = 4
CPU = torch.device("cpu")
Variant = tuple[str, str]  # (kv_dtype auto | int8 | fp8, quantization none | fp8)
Run = tuple[Path, str, str]  # (model dir, kv_dtype, quantization): one greedy run of a TP group


def make_cache(cfg: ModelConfig, kv_dtype: str, num_kv_heads: int, num_pages: int) -> KVCache:
    """A float32 CPU pool of `num_kv_heads` (a rank's local KV heads) in `kv_dtype`."""
    shape = (cfg.num_layers, num_pages, PAGE_SIZE, num_kv_heads, cfg.head_dim, torch.float32, CPU)
    if kv_dtype == "auto":
        return KVCache(*shape, quant=KernelChoice())
    group = cfg.head_dim if kv_dtype == "fp8" else min(64, cfg.head_dim)
    storage = torch.int8 if kv_dtype == "int8" else torch.float8_e4m3fn
    return QuantizedKVCache(*shape, group, False, quant=KernelChoice(), storage=storage)


def greedy_run(
    step: Callable[[StepPlan], torch.Tensor], prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill every prompt in two chunks (the second with starts > 0), then decode `new_tokens - 1` steps, all
    sequences batched; -> (greedy tokens per prompt, logits [new_tokens, S, V])."""
    pages = -(-(max(map(len, prompts)) + new_tokens) // PAGE_SIZE)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(len(prompts))]
    halves = [len(p) // 2 for p in prompts]
    first = StepPlan([t for p, h in zip(prompts, halves) for t in p[:h]], [0] * len(prompts), halves, tables, 0, [])
    step(first)
    rest = [len(p) - h for p, h in zip(prompts, halves)]
    ids = [t for p, h in zip(prompts, halves) for t in p[h:]]
    rows = [sum(rest[: i + 1]) - 1 for i in range(len(prompts))]
    logits = [step(StepPlan(ids, halves, rest, tables, 0, rows))]
    out = [[int(t)] for t in logits[-1].argmax(-1)]
    for k in range(new_tokens - 1):
        starts = [len(p) + k for p in prompts]
        plan = StepPlan([o[-1] for o in out], starts, [1] * len(prompts), tables, len(prompts), list(range(len(out))))
        logits.append(step(plan))
        for o, t in zip(out, logits[-1].argmax(-1)):
            o.append(int(t))
    return out, torch.stack(logits)


def num_pages_for(prompts: list[list[int]], new_tokens: int) -> int:
    return len(prompts) * -(-(max(map(len, prompts)) + new_tokens) // PAGE_SIZE)


def single_process_run(
    model_dir: Path, prompts: list[list[int]], new_tokens: int, variant: Variant
) -> tuple[list[list[int]], torch.Tensor]:
    """The TP=1 reference: the same greedy steps on one process, no process group."""
    cfg = parse_model_config(model_dir)
    model = load_model(model_dir, cfg, CPU, torch.float32, KernelChoice(), variant[1])
    cache = make_cache(cfg, variant[0], cfg.num_kv_heads, num_pages_for(prompts, new_tokens))
    backend = SdpaBackend()
    return greedy_run(lambda plan: run_plan(model, cache, backend, plan, PAGE_SIZE), prompts, new_tokens)


def _join_group(rank: int, world: int, init_file: str):
    """This rank of a gloo TP group rendezvousing at `init_file`."""
    from pdserve.engine.tp.comm import TPGroup

    torch.set_num_threads(1)
    return TPGroup.init(rank, world, f"file://{init_file}", CPU, timeout_s=60.0)


def _shard_of(group, model_dir: Path):
    """(model config, this rank's RankShard of that model)."""
    from pdserve.engine.tp.layers import RankShard
    from pdserve.engine.tp.layout import make_layout

    cfg = parse_model_config(model_dir)
    return cfg, RankShard(group, make_layout(cfg, group.world_size))


def _load_shard(model_dir: Path, cfg: ModelConfig, shard, quantization: str) -> CausalLM:
    return load_model(model_dir, cfg, CPU, torch.float32, KernelChoice(), quantization, tp=shard)


def greedy_rank(
    rank: int,
    world: int,
    init_file: str,
    runs: list[Run],
    prompts: list[list[int]],
    new_tokens: int,
    out_dir: Path,
) -> None:
    """One rank of a TP group (torch.multiprocessing entry): for each run, load the rank's shard of its model and
    run `greedy_run` (rank 0 leads, the others follow); each rank saves out_dir/rank<r>.pt: rank 0 its tokens and
    logits per run, the others the steps they ran, and each its pool's KV heads per run."""
    from pdserve.engine.tp.worker import PlanLeader, follow

    group = _join_group(rank, world, init_file)
    result: dict[str, object] = {}
    for i, (model_dir, kv_dtype, quantization) in enumerate(runs):
        cfg, shard = _shard_of(group, model_dir)
        result[f"kv_heads{i}"] = list(shard.rank.kv_heads)
        model = _load_shard(model_dir, cfg, shard, quantization)
        cache = make_cache(cfg, kv_dtype, shard.layout.kv_per_rank, num_pages_for(prompts, new_tokens))
        if rank == 0:
            leader = PlanLeader(model, cache, SdpaBackend(), group, PAGE_SIZE)
            tokens, logits = greedy_run(leader.step, prompts, new_tokens)
            leader.shutdown()
            result[f"tokens{i}"], result[f"logits{i}"] = torch.tensor(tokens), logits
        else:
            result[f"steps{i}"] = follow(model, cache, SdpaBackend(), group, PAGE_SIZE)
    torch.save(result, out_dir / f"rank{rank}.pt")
    group.close()


def idle_rank(rank: int, world: int, init_file: str, model_dir: Path, out_dir: Path) -> None:
    """One rank of a TP group that runs one greedy step, writes out_dir/ready<r>, then idles (rank 0 sends
    heartbeats, the others follow) until a collective fails (a rank died): the process then exits non-zero."""
    from pdserve.engine.tp.worker import PlanLeader, follow

    group = _join_group(rank, world, init_file)
    cfg, shard = _shard_of(group, model_dir)
    model = _load_shard(model_dir, cfg, shard, "none")
    cache = make_cache(cfg, "auto", shard.layout.kv_per_rank, 4)
    plan = StepPlan([5, 6, 7], [0], [3], [[0]], 0, [2])
    if rank == 0:
        leader = PlanLeader(model, cache, SdpaBackend(), group, PAGE_SIZE)
        leader.step(plan)
        (out_dir / f"ready{rank}").touch()
        while True:
            leader.idle()
            time.sleep(0.05)
    (out_dir / f"ready{rank}").touch()
    follow(model, cache, SdpaBackend(), group, PAGE_SIZE)


def spawn_ranks(fn: Callable, world: int, args: tuple, join: bool = True, timeout_s: float = 120.0):
    """Start `world` processes fn(rank, world, *args) (forkserver start method); join=True waits (a rank's exception is
    raised here, a run past `timeout_s` is killed); join=False returns the ProcessContext."""
    import multiprocessing

    import torch.multiprocessing as mp

    # forkserver: one server process imports torch and this module once; each rank is a fork of it (a fresh
    # interpreter per rank would import torch again), and no rank is a fork of the test process and its threads
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    ctx = mp.start_processes(fn, args=(world, *args), nprocs=world, join=False, start_method="forkserver")
    if not join:
        return ctx
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"TP ranks still running after {timeout_s} s")
    finally:
        kill_all(ctx)
    return ctx


def kill_all(ctx) -> None:
    """SIGKILL the context's processes still alive (a test's cleanup: no orphans)."""
    for p in ctx.processes:
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
