"""Helpers of the router tests: the router's instance listing, waiting for instance states."""

from __future__ import annotations

import time

from pdserve.server.grpc_util import channel
from pdserve.v1 import router_admin_pb2 as pb
from pdserve.v1 import router_admin_pb2_grpc


def listing(router: str) -> pb.ListInstancesResponse:
    """The Registry's listing, from the router's internal port (`launch.Address.internal`; a plain address: as is)."""
    with channel(getattr(router, "internal", router)) as ch:
        return router_admin_pb2_grpc.RegistryStub(ch).ListInstances(pb.ListInstancesRequest(), timeout=10)


def instances(router: str) -> dict[str, pb.InstanceInfo]:
    return {i.address: i for i in listing(router).instances}


def wait_states(router: str, want: dict[str, str | None], timeout: float = 60.0) -> None:
    """Wait until each address has the given state (None: absent from the router's table)."""
    deadline = time.monotonic() + timeout
    while True:
        have = instances(router)
        got = {a: (have[a].state if a in have else None) for a in want}
        if got == want:
            return
        assert time.monotonic() < deadline, f"router {router}: {got}, wanted {want}"
        time.sleep(0.1)
