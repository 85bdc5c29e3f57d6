"""Per-transport counters of a service (what `Stats` reports as `InstanceStats.kv_transports`) and the
transfer clock of one request (the union of its batches' busy intervals)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from pdserve.v1 import kv_pb2


@dataclass
class TransportCounters:
    requests: int = 0
    pages: int = 0
    bytes: int = 0
    batches: int = 0
    transfer_seconds: float = 0.0
    fallbacks: int = 0


class TransferStats:
    """Thread-safe counters by transport name ("grpc", "cuda-ipc")."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[str, TransportCounters] = {}

    def add(self, transport: str, **deltas: float) -> None:
        with self._lock:
            c = self._by.setdefault(transport, TransportCounters())
            for k, v in deltas.items():
                setattr(c, k, getattr(c, k) + v)

    def get(self, transport: str) -> TransportCounters:
        with self._lock:
            c = self._by.get(transport, TransportCounters())
            return TransportCounters(**vars(c))

    def to_proto(self) -> list[kv_pb2.KVTransportStats]:
        with self._lock:
            return [
                kv_pb2.KVTransportStats(
                    transport=name,
                    requests=c.requests,
                    pages=c.pages,
                    bytes=c.bytes,
                    batches=c.batches,
                    transfer_seconds=c.transfer_seconds,
                    fallbacks=c.fallbacks,
                )
                for name, c in sorted(self._by.items())
            ]


class BusyClock:
    """Union of [start, end] intervals of one request's batches (started and ended from any thread).
    `seconds()` is the time at least one batch was in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[list[float]] = []  # [start, end or None]

    def start(self) -> int:
        with self._lock:
            self._spans.append([time.perf_counter(), 0.0])
            return len(self._spans) - 1

    def end(self, span: int) -> None:
        with self._lock:
            if not self._spans[span][1]:
                self._spans[span][1] = time.perf_counter()

    def seconds(self) -> float:
        with self._lock:
            spans = sorted((s, e) for s, e in self._spans if e)
        total, cur_s, cur_e = 0.0, None, 0.0
        for s, e in spans:
            if cur_s is None or s > cur_e:
                if cur_s is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_s is not None:
            total += cur_e - cur_s
        return total
