"""The `InstanceStats` message both engine-backed services answer `Stats` with (the router's view of an instance)."""

from __future__ import annotations

from typing import Any

from pdserve.engine.loop import EngineLoop
from pdserve.kv.transfer.stats import TransferStats
from pdserve.v1 import internal_pb2


def instance_stats(
    loop: EngineLoop,
    active: int,
    fingerprint: str,
    kv_dtype: str,
    page_size: int,
    transfers: TransferStats,
    **extra: Any,
) -> internal_pb2.InstanceStats:
    """KV pool occupancy, active requests, identity and KV transfer counters; `extra`: role-specific fields."""
    used, total = loop.allocator.num_used, loop.allocator.num_pages
    return internal_pb2.InstanceStats(
        kv_pages_total=total,
        kv_pages_free=total - used,
        active_requests=active,
        model_fingerprint=fingerprint,
        kv_dtype=kv_dtype,
        page_size=page_size,
        kv_transports=transfers.to_proto(),
        **extra,
    )
