"""The per-role connectors wired to each other in one process (tests of the transports and the handshake)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer import ExportedPages, for_decode, for_prefill
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.v1 import internal_pb2

LAYOUT = KVLayoutSpec("float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=16)
CPU = torch.device("cpu")
N = 5  # pages of the request


@dataclass
class Settings:
    """Both services' transfer settings (PrefillConfig's and DecodeConfig's names)."""

    kv_transport: str = "auto"
    kv_batch_mb: float = 1.0
    kv_ipc_staging_mb: float = 1.0
    kv_copy_threads: int = 2
    ack_timeout_s: float = 5.0
    page_timeout_s: float = 5.0
    page_timeout_max_s: float = 5.0
    page_timeout_slack: float = 3.0
    first_token_early: bool = False
    kv_layer_group: int = 0
    kv_shipper: str = "off"
    kv_shipper_arena_mb: float = 4.0
    kv_shippers: int = 2


def rows(n: int = N) -> torch.Tensor:
    """n finite float32 pages as batch rows (uint8 [n, page_bytes])."""
    return torch.randn(n, PageFormat(LAYOUT).page_bytes // 4, generator=torch.Generator().manual_seed(n)).view(
        torch.uint8
    )


def wire(msg) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


class Pair:
    """A prefill and a decode connector, one request between them; decode's messages reach prefill's ack reader."""

    def __init__(self, prefill: Settings, decode: Settings, prefill_device: torch.device = CPU):
        self.released: list[str] = []
        self.freed: list[int] = []
        self.imported: list[tuple[list[int], torch.Tensor]] = []
        self.cancelled: list[int] = []
        self.pc = for_prefill(prefill, prefill_device, "fp", release=self.released.append)
        self.dc = for_decode(decode, CPU, LAYOUT, "fp")
        self.rx = self.dc.open("r", N, lambda: self.freed.append(1), self.import_rows, peer="prefill-0")
        self.client = self.rx.messages(internal_pb2.PrefillRequest(request_id="r", prompt_token_ids=[5] * 17))
        self.offer = next(self.client).request.kv_transport  # the request leads the stream

    def import_rows(self, indexes: list[int], tokens: list[int], batch: torch.Tensor, layers=None) -> Future:
        f: Future = Future()
        self.imported.append((indexes, batch.clone()))
        f.set_result(None)
        return f

    def open(self):
        """Prefill's side of the handshake; the choice reaches decode (which may answer KVTransportReady)."""
        self.tx = self.pc.open("r", N, LAYOUT, self.offer)
        self.rx.attach(lambda: self.cancelled.append(1))
        self.tx.listen(self.client)
        assert self.rx.receive(wire(self.tx.choice)) is None
        return self.tx

    def ship(self, pages: torch.Tensor) -> None:
        for m in self.tx.send(ExportedPages(list(range(N)), [4] * N, pages)):
            assert self.rx.receive(wire(m)) is None

    def finish(self) -> None:
        done = internal_pb2.PrefillServerMessage(done=internal_pb2.PrefillDone(num_pages=self.tx.pages.num_shipped))
        msg = self.rx.receive(wire(done))
        assert msg is not None and msg.HasField("done")
        self.rx.finish(msg.done)
        self.tx.finish(5)
        self.rx.close()  # ends decode's side of the stream: prefill's ack reader stops
        self.tx.abort()

    def close(self) -> None:
        self.rx.close()  # idempotent: ends decode's side, so prefill's ack reader (if any) stops
        self.pc.close()
        self.dc.close()


def counters(stats, transport: str) -> tuple[int, int, int]:
    c = stats.get(transport)
    return c.requests, c.pages, c.fallbacks
