"""Instance side of router membership: `--router HOST:PORT` (the router's internal port) makes a prefill/decode
instance Register with the router once it serves, Heartbeat at the interval the router asks for (registering again
when the router forgot it, e.g. after a router restart), and Deregister when it shuts down so the router drains it
first. Its calls carry the instance's internal identity (token, client certificate)."""

from __future__ import annotations

import logging
import socket
import threading

import grpc

from pdserve.server.grpc_util import channel
from pdserve.server.security import ChannelSecurity
from pdserve.v1 import router_admin_pb2 as pb
from pdserve.v1 import router_admin_pb2_grpc

log = logging.getLogger("pdserve.server.announce")

ROLES = {
    "prefill": pb.INSTANCE_ROLE_PREFILL,
    "decode": pb.INSTANCE_ROLE_DECODE,
    "colocated": pb.INSTANCE_ROLE_COLOCATED,
}
RPC_TIMEOUT_S = 2.0
RETRY_MAX_S = 5.0


def advertised(host: str, port: int) -> str:
    """The address the router should dial: the bound host, or this machine's name for a wildcard bind."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


class Announcer:
    def __init__(
        self,
        router: str,
        role: str,
        address: str,
        capacity_pcs: float = 0.0,
        security: ChannelSecurity | None = None,
        model_name: str = "",
        model_path: str = "",
    ):
        """`router`: the router's internal (Registry) port; `security`: this instance's internal identity (None:
        the environment's, `pdserve.server.grpc_util.channel`); `model_name`: the served model name requests use
        ("" = the router's own --model), `model_path`: the model directory (the router loads its tokenizer)."""
        self.router, self.address = router, address
        self.role = ROLES[role]
        self.capacity_pcs = capacity_pcs
        self.model_name, self.model_path = model_name, model_path
        self._channel = channel(router, security)
        self._stub = router_admin_pb2_grpc.RegistryStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="announce", daemon=True)

    def start(self) -> Announcer:
        self._thread.start()
        return self

    def _register(self) -> float:
        r = self._stub.Register(
            pb.RegisterRequest(
                role=self.role,
                address=self.address,
                capacity_pcs=self.capacity_pcs,
                model_name=self.model_name,
                model_path=self.model_path,
            ),
            timeout=RPC_TIMEOUT_S,
        )
        log.info("registered %s (model %r) with router %s", self.address, self.model_name, self.router)
        return r.heartbeat_interval_s

    def _run(self) -> None:
        interval, registered, backoff = 1.0, False, 0.2
        while not self._stop.is_set():
            try:
                if not registered:
                    interval, registered = self._register(), True
                elif not self._stub.Heartbeat(
                    pb.HeartbeatRequest(role=self.role, address=self.address), timeout=RPC_TIMEOUT_S
                ).known:
                    registered = False
                    continue
                backoff = 0.2
                wait = interval
            except grpc.RpcError as e:
                if backoff == 0.2:
                    log.warning("router %s unreachable (%s); retrying", self.router, e.code().name)
                wait, backoff = backoff, min(RETRY_MAX_S, backoff * 2)
            self._stop.wait(wait)

    def stop(self) -> None:
        """Deregister (best effort) so the router stops sending work, then stop heartbeating."""
        self._stop.set()
        self._thread.join(timeout=RPC_TIMEOUT_S + 1)
        try:
            self._stub.Deregister(pb.DeregisterRequest(role=self.role, address=self.address), timeout=1.0)
        except grpc.RpcError as e:
            log.warning("could not deregister from router %s: %s", self.router, e.code().name)
        self._channel.close()
