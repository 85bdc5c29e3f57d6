"""The `InstanceStats` message both engine-backed services answer `Stats` with (the router's view of an instance)."""

from __future__ import annotations

from typing import Any

from pdserve.engine.loop import EngineLoop
from pdserve.kv.transfer.stats import TransferStats
from pdserve.v1 import internal_pb2


def instance_stats(
    loop: EngineLoop, active: int, transfers: TransferStats | None = None, **extra: Any
) -> internal_pb2.InstanceStats:
    """KV pool occupancy, active requests, identity (the engine's model fingerprint, pool format and page size), its
    tensor parallel size and KV transfer counters (None: this instance moves no KV between instances); `extra`:
    role-specific fields."""
    engine = loop.engine
    used, total = loop.allocator.num_used, loop.allocator.num_pages
    return internal_pb2.InstanceStats(
        kv_pages_total=total,
        kv_pages_free=total - used,
        active_requests=active,
        model_fingerprint=engine.fingerprint,
        kv_dtype=engine.pool_layout.dtype,
        page_size=engine.page_size,
        tensor_parallel_size=engine.runner.tp_size,
        kv_transports=(transfers or TransferStats()).to_proto(),
        **extra,
    )
