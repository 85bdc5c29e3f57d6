"""An engine process's N shippers (`--kv-shippers`), used as one: batches spread over them, so the bytes move at
up to N times one shipper pair's rate (one pair is bound by Python gRPC's copies under one shipper's GIL; more
streams in one process do not help, more processes do).

    group = ShipperGroup.of("prefill" | "decode", n, arena_bytes, pin=cuda, host=..., port=..., environ=...)
    prefill: block = group.reserve(n, timeout); ...rows into block.tensor...; group.push(addresses, key, seq, block, n)
             group.watch(key, on_failed); group.unwatch(key); group.give(block) once decode acknowledged it
    decode:  inbox = group.inbox(key) (one inbox on every shipper); group.addresses(host): where prefill pushes

Each shipper gets `arena_bytes // n`; consecutive batches take different shippers (a rotating start, the first
with room); prefill's shipper k pushes to decode's address k % len(addresses). A transfer needs all its batches,
so any one shipper's failure fails the transfers that use the group; `ready()` starts the exited ones again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from pdserve.cache.fetch_arena import ArenaBlock
from pdserve.kv.shipper.link import Inbox, ShipperLink
from pdserve.kv.transfer.modes import MAX_SHIPPERS


@dataclass
class StagingBlock:
    """Prefill: a block of shipper `index`'s arena (that shipper pushes it and takes it back)."""

    index: int
    block: ArenaBlock

    @property
    def tensor(self) -> torch.Tensor:
        return self.block.tensor


class ShipperGroup:
    def __init__(self, links: Sequence[ShipperLink]):
        if not links or len({link.role for link in links}) != 1:
            raise ValueError("a shipper group needs one or more links of one role")
        self.links = list(links)
        self.role = self.links[0].role
        self._lock = threading.Lock()
        self._next = 0  # prefill: where the next reserve starts looking

    @classmethod
    def of(
        cls,
        role: str,
        count: int,
        arena_bytes: int,
        pin: bool,
        host: str = "127.0.0.1",
        port: int = 0,
        environ: Mapping[str, str] | None = None,
        **link_kw,
    ) -> ShipperGroup:
        """`count` links of `arena_bytes // count` each (not started); `port` > 0: decode's shippers listen on
        port, port + 1, ... (0: each picks a free one)."""
        if not 1 <= count <= MAX_SHIPPERS:
            raise ValueError(f"shipper count must be in 1..{MAX_SHIPPERS}, got {count}")
        links = [
            ShipperLink(
                role, arena_bytes // count, pin=pin, host=host, port=port + i if port else 0, environ=environ, **link_kw
            )
            for i in range(count)
        ]
        return cls(links)

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> ShipperGroup:
        """Start every shipper at once (each waits for its own readiness, up to `link.START_TIMEOUT_S`)."""
        threads = [threading.Thread(target=link.start, name="kv-shipper-start") for link in self.links]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self

    def ready(self) -> bool:
        """Whether every shipper serves; each exited one is started again as `ShipperLink.ready` allows."""
        return all([link.ready() for link in self.links])  # a list: every link gets its restart, not just the first

    @property
    def alive(self) -> bool:
        return all(link.alive for link in self.links)

    def events(self) -> dict[str, int]:
        """The shippers' counters, summed."""
        total: dict[str, int] = {}
        for link in self.links:
            for name, n in link.events().items():
                total[name] = total.get(name, 0) + n
        return total

    @property
    def arena_bytes(self) -> int:
        """The smallest shipper arena (a batch must fit in any of them)."""
        return min(link.arena.nbytes for link in self.links)

    @property
    def pids(self) -> list[int | None]:
        return [link.pid for link in self.links]

    def close(self) -> None:
        for link in self.links:
            link.close()

    # ---- prefill -----------------------------------------------------------------------------------------------
    def reserve(self, nbytes: int, timeout: float) -> StagingBlock:
        """A staging block of the first shipper with room, from a rotating start (consecutive batches go to
        different shippers); none free: wait on the rotating one up to `timeout` (TimeoutError)."""
        with self._lock:
            start = self._next
            self._next = (start + 1) % len(self.links)
        for i in range(len(self.links)):
            k = (start + i) % len(self.links)
            block = self.links[k].try_reserve(nbytes)
            if block is not None:
                return StagingBlock(k, block)
        return StagingBlock(start, self.links[start].reserve(nbytes, timeout))

    def give(self, block: StagingBlock) -> None:
        self.links[block.index].give(block.block)

    def push(self, addresses: Sequence[str], key: bytes, seq_no: int, block: StagingBlock, nbytes: int) -> None:
        """Ship `nbytes` of `block` as batch `seq_no` of transfer `key`: its shipper k pushes to decode's
        `addresses[k % len(addresses)]`."""
        address = addresses[block.index % len(addresses)]
        self.links[block.index].push(address, key, seq_no, block.block, nbytes)

    def watch(self, key: bytes, on_failed: Callable[[str], object]) -> None:
        """`on_failed` hears any shipper's failure: the transfer needs every batch, whichever shipper carries it."""
        for link in self.links:
            link.watch(key, on_failed)

    def unwatch(self, key: bytes) -> None:
        for link in self.links:
            link.unwatch(key)

    # ---- decode ------------------------------------------------------------------------------------------------
    def inbox(self, key: bytes) -> Inbox:
        """One inbox for transfer `key` on every shipper (a batch may land through any of them)."""
        inbox = Inbox(self.links, key)
        registered: list[ShipperLink] = []
        try:
            for link in self.links:
                link._register(inbox)
                registered.append(link)
        except ValueError:
            for link in registered:
                link._forget(key)
            raise
        return inbox

    def addresses(self, host: str) -> list[str]:
        """decode: where prefill's shippers push, one address per shipper."""
        return [link.address(host) for link in self.links]
