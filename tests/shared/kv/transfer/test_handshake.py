"""Decode's grpc-shm offer fields (`handshake.shipper_offer_problem`): every shipper address host:port and bounded,
at most MAX_SHIPPERS further ones, a transfer key of the agreed size; an unusable offer leaves auto on grpc and fails
a forced grpc-shm with the reason."""

from __future__ import annotations

import pytest

from pdserve.kv.transfer.handshake import SHIPPER_ADDRESS_MAX, TRANSFER_KEY_BYTES, choose, shipper_offer_problem
from pdserve.kv.transfer.modes import MAX_SHIPPERS
from pdserve.v1 import kv_pb2


def shm_offer(first: str = "d:1", more: list[str] | None = None, key_bytes: int = TRANSFER_KEY_BYTES):
    return kv_pb2.KVTransportOffer(
        transports=["grpc", "grpc-shm"],
        host_id="other",
        device_kind="cpu",
        shipper_address=first,
        more_shipper_addresses=more or [],
        transfer_key=b"k" * key_bytes,
    )


@pytest.mark.parametrize(
    "offer, problem",
    [
        (shm_offer(), ""),
        (shm_offer(more=["d:2", "[::1]:3"]), ""),
        (shm_offer(more=[f"d:{i}" for i in range(MAX_SHIPPERS)]), ""),
        (shm_offer(more=[f"d:{i}" for i in range(MAX_SHIPPERS + 1)]), "17 further shipper addresses, more than 16"),
        (shm_offer(first=""), "is not host:port"),
        (shm_offer(more=["d:2", "nocolon"]), "'nocolon' is not host:port"),
        (shm_offer(more=[""]), "'' is not host:port"),
        (shm_offer(more=["d: 2"]), "is not host:port"),
        (shm_offer(more=["d:" + "9" * SHIPPER_ADDRESS_MAX]), "is not host:port"),
        (shm_offer(key_bytes=3), "transfer key has 3 bytes"),
    ],
)
def test_shipper_offer_problem(offer, problem):
    got = shipper_offer_problem(offer)
    assert (problem in got and got) if problem else got == "", got


def test_an_unusable_further_address_keeps_auto_on_grpc_and_fails_a_forced_grpc_shm():
    bad = shm_offer(more=["d:2", "nocolon"])
    assert choose(bad, "auto", "h", "cpu", "", "").transport == "grpc"
    forced = choose(bad, "grpc-shm", "h", "cpu", "", "")
    assert forced.transport == "" and "grpc-shm forced but unusable" in forced.error and "nocolon" in forced.error
    assert choose(shm_offer(more=["d:2"]), "auto", "h", "cpu", "", "").transport == "grpc-shm"
