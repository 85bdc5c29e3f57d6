"""Decode-graph lockstep ranks for CPU tests (`pdserve.engine.tp.graph_step`): a gloo TP group whose rank 0 drives a
scripted series of graph replays through `LeaderGraphs` and whose followers replay them through `follower_handlers`.
The CUDA graph runner itself is the one GPU piece a CPU cannot run: `RecordingGraphs` stands in for it (its
interface: max_batch, check_chain, can_run, run, sample_masked) and records what each rank was asked to replay."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from pdserve.testing.tp_ranks import PAGE_SIZE, _join_group, _load_shard, _shard_of, make_cache

MAX_BATCH, MAX_CONTEXT = 8, 64
NUM_PAGES = 64


class RecordingGraphs:
    """The GPU-only DecodeGraphRunner's interface, recording calls: (ids or None, positions, tables) per run, and
    each masked re-draw's bitmask as a list."""

    def __init__(self) -> None:
        self.max_batch = MAX_BATCH
        self.calls: list[tuple] = []

    def check_chain(self, chained: bool, b: int) -> None:
        return None

    def can_run(self, batch_size: int, max_kv_len: int) -> bool:
        return batch_size <= MAX_BATCH and max_kv_len <= MAX_CONTEXT

    def run(self, input_ids, positions, page_tables) -> torch.Tensor:
        self.calls.append(("run", input_ids, list(positions), [list(t) for t in page_tables]))
        return torch.zeros(len(positions), 1)

    def sample_masked(self, bitmask: torch.Tensor):
        self.calls.append(("mask", bitmask.tolist()))
        return None, None


def script(vocab_size: int) -> list[tuple]:
    """The replays rank 0 drives: (kind, args). Tables are lists kept across runs and appended to in place (as a
    Sequence's page table grows), a batch change, a replaced table (preemption), chained runs and a masked draw."""
    a, b, c = [0, 1], [2], [3, 4, 5]
    words = -(-vocab_size // 32)
    mask = torch.full((2, words), -1, dtype=torch.int32)
    mask[1, 0] = 0x5  # tokens 0 and 2 only
    mask[0, -1] = -(2**31)  # the sign bit survives the int64 trip
    steps: list[tuple] = [
        ("run", [7, 8], [5, 2], [a, b]),
        ("run", None, [6, 3], [a, b]),  # chained
    ]
    b.append(6)  # b's table grew by a page: a delta of one entry
    steps += [("run", [9, 10], [7, 4], [a, b]), ("mask", mask), ("run", None, [8, 5], [a, b])]
    steps += [("run", [11, 12, 13], [9, 6, 10], [c, a, b])]  # rows now hold other sequences: whole tables
    a2 = [7, 8, 9]  # a replaced (preempted, re-admitted) table at the same row
    steps += [("run", [1, 2, 3], [10, 7, 11], [c, a2, b])]
    return steps


def graph_lockstep_rank(rank: int, world: int, init_file: str, model_dir: Path, out_dir: Path) -> None:
    """One rank (torch.multiprocessing entry): rank 0 replays `script` through LeaderGraphs, the others follow;
    each saves out_dir/rank<r>.pt with its recorded calls (and the followers the message count they ran)."""
    from pdserve.engine.attention import SdpaBackend
    from pdserve.engine.tp.graph_step import LeaderGraphs, follower_handlers
    from pdserve.engine.tp.worker import PlanLeader, follow

    group = _join_group(rank, world, init_file)
    cfg, shard = _shard_of(group, model_dir)
    model = _load_shard(model_dir, cfg, shard, "none")
    cache = make_cache(cfg, "auto", shard.layout.kv_per_rank, NUM_PAGES)
    graphs = RecordingGraphs()
    steps = 0
    if rank == 0:
        leader = LeaderGraphs(graphs, group, contextlib.nullcontext)
        for kind, *args in script(cfg.vocab_size):
            getattr(leader, "run" if kind == "run" else "sample_masked")(*args)
        PlanLeader(model, cache, SdpaBackend(), group, PAGE_SIZE).shutdown()
    else:
        handlers = follower_handlers(graphs, cfg.vocab_size, NUM_PAGES)
        steps = follow(model, cache, SdpaBackend(), group, PAGE_SIZE, handlers=handlers)
    torch.save({"calls": graphs.calls, "steps": steps}, out_dir / f"rank{rank}.pt")
    group.close()
