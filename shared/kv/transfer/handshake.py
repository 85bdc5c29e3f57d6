"""Agreeing on a transport per prefill/decode pair, in the Prefill stream's first messages.

1. Decode's PrefillRequest carries a `KVTransportOffer`: what it can receive (`grpc` always, unless forced
   otherwise; `cuda-ipc` on CUDA, or when forced), its host identity and device.
2. Prefill answers with a `KVTransportChoice` as its first message (`choose`): with `--kv-transport auto`,
   cuda-ipc when both ends are on one host with CUDA and prefill's staging buffer is registered, else grpc.
   A forced transport that cannot work is an error (FAILED_PRECONDITION), never a fallback.
   `grpc-shm` (bytes through the shippers, `pdserve.kv.shipper`) where `auto` would pick grpc, when decode offers it
   (its shippers' addresses and a transfer key, per request) and prefill's own shippers serve.
3. For cuda-ipc, decode opens the buffer and replies `KVTransportReady`; if it cannot (and neither end forced
   cuda-ipc), prefill ships this request over grpc. Every fallback, on either end, goes through `fall_back`:
   counted and logged, or TransportUnusable when cuda-ipc was forced.

Tensor parallelism: the offer carries decode's split of the KV heads over its ranks and the choice prefill's
(`ShardLayout`: TP size, KV heads per rank). Pages on the wire hold every KV head in global order whatever either
side's TP size, so any pair works; prefill refuses a decode whose split is not the one its own model gives at that
TP size (another model or a bad peer: FAILED_PRECONDITION), decode refuses a split that cannot hold the heads.

A new transport (e.g. NIXL) adds its name to `modes.TRANSPORTS`, its offer fields, and a branch in `choose`.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.tp.layout import MAX_TP_SIZE
from pdserve.errors import TransportUnusable
from pdserve.kv.transfer.modes import CUDA_IPC, GRPC, GRPC_SHM, MAX_SHIPPERS
from pdserve.kv.transfer.stats import TransferStats
from pdserve.v1 import kv_pb2

log = logging.getLogger("pdserve.kv.transfer")


def host_id() -> str:
    """Equal for two processes on one host (the kernel's boot id and the host name)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def device_identity(device: torch.device) -> tuple[str, str, int]:
    """(kind, GPU UUID or "", index) of a device."""
    if device.type != "cuda":
        return device.type, "", -1
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return "cuda", str(getattr(props, "uuid", "")), index


@dataclass(frozen=True)
class ShardLayout:
    """One side's tensor-parallel split of the KV heads (`KVShardLayout`): `tp_size` ranks, each pool holding
    `kv_heads_per_rank` KV heads (replicated heads counted on every rank that holds them)."""

    tp_size: int = 1
    kv_heads_per_rank: int = 0

    @classmethod
    def of(cls, runner) -> ShardLayout:
        """An engine's split (its `ModelRunner`: `tp_size`, `num_local_kv_heads`)."""
        return cls(runner.tp_size, runner.num_local_kv_heads)

    def to_proto(self) -> kv_pb2.KVShardLayout:
        return kv_pb2.KVShardLayout(tensor_parallel_size=self.tp_size, kv_heads_per_rank=self.kv_heads_per_rank)

    @classmethod
    def from_proto(cls, msg: kv_pb2.KVShardLayout, num_kv_heads: int) -> ShardLayout:
        """A peer's split; a peer that predates tensor parallelism (fields unset) is one rank of every head."""
        if msg.tensor_parallel_size == 0 and msg.kv_heads_per_rank == 0:
            return cls(1, num_kv_heads)
        return cls(msg.tensor_parallel_size, msg.kv_heads_per_rank)

    def problem(self, num_kv_heads: int) -> str:
        """Why this split cannot hold `num_kv_heads` KV heads ("" when it can): every head on some rank, no rank
        holding more heads than its share of query heads could read."""
        tp, per = self.tp_size, self.kv_heads_per_rank
        if not 1 <= tp <= MAX_TP_SIZE:
            return f"tensor parallel size {tp} outside 1..{MAX_TP_SIZE}"
        if not 1 <= per <= num_kv_heads or tp * per < num_kv_heads:
            return f"{tp} ranks of {per} KV heads cannot hold the model's {num_kv_heads}"
        return ""

    def __str__(self) -> str:
        return f"TP={self.tp_size} x {self.kv_heads_per_rank} KV heads"


def make_offer(mode: str, device: torch.device, shards: ShardLayout | None = None) -> kv_pb2.KVTransportOffer:
    """Decode's offer for `--kv-transport mode` on `device`; `shards`: its split of the KV heads (None: not
    told, as a peer that predates tensor parallelism)."""
    kind, uuid, index = device_identity(device)
    if mode == "auto":
        transports = [CUDA_IPC, GRPC] if kind == "cuda" else [GRPC]
    else:
        transports = [mode]
    offer = kv_pb2.KVTransportOffer(
        transports=transports,
        host_id=host_id(),
        device_kind=kind,
        gpu_uuid=uuid,
        device_index=index,
        forced=mode != "auto",
    )
    if shards is not None:
        offer.shards.CopyFrom(shards.to_proto())
    return offer


@dataclass(frozen=True)
class Choice:
    transport: str  # what this request uses ("" with an error)
    reason: str  # why (shown in logs and in the choice message)
    fallback: bool = False  # cuda-ipc was possible on paper (one host, offered) but grpc is used
    error: str = ""  # a forced transport cannot work: the request fails FAILED_PRECONDITION with this


SHIPPER_ADDRESS_MAX = 300  # host:port
TRANSFER_KEY_BYTES = 16


def shipper_offer_problem(offer: kv_pb2.KVTransportOffer) -> str:
    """Why decode's grpc-shm fields cannot be used ("" when they can): its shippers' addresses (the first and at
    most MAX_SHIPPERS more) host:port each, a transfer key of TRANSFER_KEY_BYTES."""
    if len(offer.more_shipper_addresses) > MAX_SHIPPERS:
        return f"decode offers {len(offer.more_shipper_addresses)} further shipper addresses, more than {MAX_SHIPPERS}"
    for address in [offer.shipper_address, *offer.more_shipper_addresses]:
        if not _host_port(address):
            return f"decode's shipper address {address[:SHIPPER_ADDRESS_MAX]!r} is not host:port"
    if len(offer.transfer_key) != TRANSFER_KEY_BYTES:
        return f"decode's transfer key has {len(offer.transfer_key)} bytes, not {TRANSFER_KEY_BYTES}"
    return ""


def _host_port(address: str) -> bool:
    return 0 < len(address) <= SHIPPER_ADDRESS_MAX and ":" in address and not any(c.isspace() for c in address)


def choose(
    offer: kv_pb2.KVTransportOffer | None,
    mode: str,
    local_host: str,
    local_device_kind: str,
    ipc_unavailable: str,
    shipper_unavailable: str = "prefill runs no KV shipper",
) -> Choice:
    """Prefill's pick. `ipc_unavailable` is why its staging buffer cannot serve, `shipper_unavailable` why its
    shipper cannot ("" when it can)."""
    offered = list(offer.transports) if offer is not None and offer.transports else [GRPC]
    decode_forced = offer is not None and offer.forced
    if mode == GRPC_SHM or (decode_forced and offered == [GRPC_SHM]):
        why_not = ""
        if mode not in ("auto", GRPC_SHM):
            why_not = f"prefill is forced to {mode}"
        elif GRPC_SHM not in offered or offer is None:
            why_not = f"decode offers only {offered}"
        else:
            why_not = shipper_offer_problem(offer) or shipper_unavailable
        if why_not:
            return Choice("", "", error=f"kv transport grpc-shm forced but unusable: {why_not}")
        return Choice(GRPC_SHM, "forced")
    picked = _choose_grpc_or_ipc(offer, offered, decode_forced, mode, local_host, local_device_kind, ipc_unavailable)
    if picked.transport == GRPC and mode == "auto" and offer is not None and GRPC_SHM in offered:
        if not (shipper_offer_problem(offer) or shipper_unavailable):
            return Choice(GRPC_SHM, f"{picked.reason}; bytes through the shippers", fallback=picked.fallback)
    return picked


def _choose_grpc_or_ipc(
    offer: kv_pb2.KVTransportOffer | None,
    offered: list[str],
    decode_forced: bool,
    mode: str,
    local_host: str,
    local_device_kind: str,
    ipc_unavailable: str,
) -> Choice:
    same_host = offer is not None and offer.host_id == local_host
    wants_ipc = mode == CUDA_IPC or (decode_forced and offered == [CUDA_IPC])
    if mode == GRPC or (mode == "auto" and not wants_ipc and CUDA_IPC not in offered):
        if GRPC not in offered:
            return Choice("", "", error=f"prefill is forced to grpc, decode offers only {offered}")
        return Choice(GRPC, "forced" if mode == GRPC else "decode offers grpc only")
    # cuda-ipc is wanted (forced) or offered (auto)
    why_not = ""
    if CUDA_IPC not in offered:
        why_not = f"decode offers only {offered}"
    elif not same_host:
        why_not = "prefill and decode are on different hosts"
    elif ipc_unavailable:
        why_not = ipc_unavailable
    elif not wants_ipc and (local_device_kind != "cuda" or offer is None or offer.device_kind != "cuda"):
        why_not = "cuda-ipc needs CUDA on both ends"
    if not why_not:
        return Choice(CUDA_IPC, "forced" if wants_ipc else "same host, CUDA on both ends")
    if wants_ipc:
        return Choice("", "", error=f"kv transport cuda-ipc forced but unusable: {why_not}")
    return Choice(GRPC, f"cuda-ipc unusable: {why_not}", fallback=same_host)


def fall_back(stats: TransferStats, request_id: str, reason: str, forced: bool) -> str:
    """cuda-ipc cannot serve this request (`reason`): it goes over grpc (returned), counted and logged; when cuda-ipc
    was forced on either end, TransportUnusable instead. Prefill and decode both fall back through here."""
    if forced:
        raise TransportUnusable(f"kv transport cuda-ipc forced but unusable: {reason}")
    stats.add(CUDA_IPC, fallbacks=1)
    log.warning("rid=%s kv transport: grpc instead of cuda-ipc (%s)", request_id, reason)
    return GRPC
