"""A follower rank (1..N-1) of a tensor-parallel instance: `python -m pdserve.engine.tp.follower ...`, started by
rank 0 (`supervisor.RankSupervisor`). It dies with rank 0 (a parent watch: `worker.exit_with_parent`; not
PR_SET_PDEATHSIG, which fires when the *thread* that started the process ends, e.g. an engine built on a worker
thread), ignores SIGINT (a terminal's Ctrl-C reaches rank 0, which drains and then ends its ranks), joins the
group, builds the same `ModelRunner` as rank 0 on its shard (its heads, FFN columns, vocabulary rows; the same pool
size; on CUDA the same decode graphs, captured in step with rank 0's) and runs every broadcast step, eager or a
graph replay (`graph_step`), until SHUTDOWN (exit 0) or a failed collective (exit 1).

The engine config arrives as JSON in $PDSERVE_TP_ENGINE_CONFIG (plain fields; never pickled)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys

MAX_CONFIG_BYTES = 1 << 16  # the engine config's JSON: a bound on what this process parses
PARENT_POLL_S = 0.2

log = logging.getLogger("pdserve.engine.tp")


def die_with_parent(parent: int) -> None:
    """End this process when `parent` (rank 0) is gone: now if it is already, else within PARENT_POLL_S of it."""
    from pdserve.engine.tp.worker import exit_with_parent

    if os.getppid() != parent:
        os._exit(3)
    exit_with_parent(poll_s=PARENT_POLL_S)


def engine_config_from_json(text: str):
    """The EngineConfig in `text` (its dataclass fields; unknown keys refused)."""
    from pdserve.engine.config import EngineConfig

    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(f"engine config of {len(text)} bytes exceeds {MAX_CONFIG_BYTES}")
    values = json.loads(text)
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(values) - names) if isinstance(values, dict) else type(values).__name__
    if unknown:
        raise ValueError(f"engine config JSON must be an object over EngineConfig's fields, got {unknown}")
    cfg = EngineConfig(**values)
    cfg.validate()
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve.engine.tp.follower", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True, help="rendezvous: file://PATH")
    p.add_argument("--parent", type=int, required=True, help="rank 0's pid")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--torch-threads", type=int, default=0)
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level="INFO", format=f"%(asctime)s %(levelname)s tp-rank{args.rank}: %(message)s")

    import torch

    from pdserve.engine.loader import parse_model_config
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.tp.comm import TPGroup
    from pdserve.engine.tp.graph_step import follower_handlers
    from pdserve.engine.tp.layers import RankShard
    from pdserve.engine.tp.layout import make_layout
    from pdserve.engine.tp.worker import follow

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    cfg = engine_config_from_json(os.environ.get("PDSERVE_TP_ENGINE_CONFIG", ""))
    if cfg.tensor_parallel_size != args.world or not 0 < args.rank < args.world:
        raise ValueError(f"rank {args.rank} of {args.world} for tensor_parallel_size {cfg.tensor_parallel_size}")
    device = torch.device(cfg.device)
    group = TPGroup.init(args.rank, args.world, args.init, device, args.timeout_s)
    mc = parse_model_config(cfg.model_dir)
    runner = ModelRunner(cfg, mc, tp=RankShard(group, make_layout(mc, args.world)))
    log.info("rank %d of %d ready on %s (%d KV pages)", args.rank, args.world, device, runner.num_pages)
    heads = runner.tp.rank.kv_heads if runner.tp is not None else ()
    graphs = follower_handlers(runner.graph_runner, mc.vocab_size, runner.num_pages)  # rank 0's decode graph replays
    steps = follow(runner.model, runner.kv_cache, runner.backend, group, cfg.page_size, heads, graphs)
    log.info("rank %d: shutdown after %d steps", args.rank, steps)
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
